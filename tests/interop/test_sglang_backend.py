"""asynckv as SGLang 0.5.10's transfer backend, proven with SGLang's own code: classes resolved
through SGLang's ``get_kv_class`` after ``install()``; the prefill and decode schedulers' call
sequences replayed in separate OS processes, two TP ranks per side, every ``poll()`` MIN-reduced
over a real gloo group with SGLang's ``poll_and_all_reduce`` (``sglang_backend_rank.py``).
Skipped, with the reason, when the SGLang venv is not built."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pathlib
import signal
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from .conftest import ROOT

pytestmark = pytest.mark.integration

RANK = pathlib.Path(__file__).with_name("sglang_backend_rank.py")
WORLD = 2
ENV = {"PYTHONPATH": str(ROOT), "SGLANG_HOST_IP": "127.0.0.1", "ASYNCKV_HEARTBEAT_INTERVAL_S": "0.5",
       "ASYNCKV_HEARTBEAT_MAX_FAILURES": "4", "ASYNCKV_WAITING_TIMEOUT_S": "60"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def start(python: pathlib.Path, *args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(str(python), str(RANK), *args, stdin=asyncio.subprocess.PIPE,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                                                env={**os.environ, **ENV})


async def json_line(proc: asyncio.subprocess.Process, timeout: float = 180) -> dict[str, Any]:
    assert proc.stdout is not None and proc.stderr is not None
    while True:
        raw = await asyncio.wait_for(proc.stdout.readline(), timeout)
        if not raw:
            raise AssertionError((await proc.stderr.read()).decode(errors="replace")[-4000:])
        if raw.startswith(b"{"):
            data: dict[str, Any] = json.loads(raw)
            return data


@contextlib.asynccontextmanager
async def cluster(python: pathlib.Path, prefill_plan: dict[str, Any], decode_plan: dict[str, Any]
                  ) -> AsyncIterator[tuple[list[asyncio.subprocess.Process], list[asyncio.subprocess.Process]]]:
    """A bootstrap-server process (SGLang's tokenizer side), two prefill ranks and two decode ranks."""
    boot_port = free_port()
    procs: list[asyncio.subprocess.Process] = []
    try:
        boot = await start(python, "bootstrap", str(boot_port))
        procs.append(boot)
        assert (await json_line(boot))["ready"] == "AsynckvKVBootstrapServer"
        ports = free_port(), free_port()
        prefill = [await start(python, "prefill", str(r), str(WORLD), str(ports[0]), str(boot_port),
                               json.dumps(prefill_plan)) for r in range(WORLD)]
        procs += prefill
        decode = [await start(python, "decode", str(r), str(WORLD), str(ports[1]), str(boot_port),
                              json.dumps(decode_plan)) for r in range(WORLD)]
        procs += decode
        for proc in prefill + decode:
            assert "ready" in await json_line(proc)
        yield prefill, decode
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


async def test_get_kv_class_returns_asynckvs_classes_only_after_install(sglang_backend_python: pathlib.Path) -> None:
    proc = await start(sglang_backend_python, "classes")
    out = await json_line(proc)
    await proc.wait()
    assert out["before"].startswith("ValueError") and "asynckv" in out["before"]
    assert out["classes"] == {
        "kvargs": "sglang.srt.disaggregation.base.conn.KVArgs",
        "manager": "asynckv.integrations.sglang.backend.AsynckvKVManager",
        "sender": "asynckv.integrations.sglang.backend.AsynckvKVSender",
        "receiver": "asynckv.integrations.sglang.backend.AsynckvKVReceiver",
        "bootstrap_server": "asynckv.integrations.sglang.backend.AsynckvKVBootstrapServer"}
    assert set(out["bound"].values()) == {"asynckv.integrations.sglang.backend"}  # the importers' bindings too
    assert out["nixl"].endswith("NixlKVManager") and out["nixl"].startswith("sglang.")  # the others are untouched
    assert "asynckv" in out["choices"] and out["member"] == "ASYNCKV"
    checks = out["checks"]  # (what the replayed sequences do not reach)
    assert checks["state_0510"] == checks["state_0523"] == [3, 4] and checks["state_empty"] is None
    assert "2 state kinds" in checks["state_two_kinds"]
    assert checks["empty_last_chunk"] is True and checks["empty_middle_chunk"] is False
    assert "SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX" in checks["early_send"]
    assert "follow_bootstrap_room" in checks["round_robin"] and checks["follow"] == ""
    for side, abort in (("receiver", "aborted by the scheduler"), ("sender", "cleared")):  # (failed first on
        reason, after = checks["failed_elsewhere"][side].split(" | after: ")  # another rank; this rank's abort
        assert "another TP rank" in reason and abort not in reason, reason  # lands before the reason is read)
        assert after == abort, after


async def test_the_launcher_offers_the_backend_on_sglangs_own_command_line(sglang_backend_python: pathlib.Path) -> None:
    proc = await start(sglang_backend_python, "launch-help")
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, err.decode(errors="replace")[-3000:]
    [choices] = [line for line in out.decode().splitlines()
                 if line.strip().startswith("--disaggregation-transfer-backend")]
    assert "asynckv}" in choices and "nixl" in choices, choices


def room(room_id: int, src: list[int], dst: list[int], chunk: int, aux: tuple[int, int],
         abort: str | None = None) -> dict[str, Any]:
    return {"room": room_id, "src": src, "dst": dst, "chunk": chunk, "src_aux": aux[0], "dst_aux": aux[1],
            "abort": abort}


async def test_sglang_schedulers_move_pages_over_asynckv_with_two_tp_ranks_a_side(
        sglang_backend_python: pathlib.Path) -> None:
    """Three rooms, chunked with an uneven last chunk, scattered pages, aux rows; a room the decode
    client aborts and one the prefill client aborts fail on both sides with the reason; every byte
    checked on each decode rank; nothing left in any manager after ``clear()``."""
    rooms = [room(4535838703865032264, [3, 8, 1, 12, 5, 6, 14], [9, 2, 15, 4, 11, 0, 7], 3, (2, 5)),
             room(11, [0, 1], [12, 13], 2, (1, 1)), room(12, [7], [14], 1, (3, 2)),
             room(13, [9, 10], [6, 8], 1, (4, 3), abort="decode"), room(14, [11], [10], 1, (5, 4), abort="prefill")]
    plan = {"rooms": rooms}
    async with cluster(sglang_backend_python, plan, plan) as (prefill, decode):
        outs = [await json_line(p, 120) for p in prefill + decode]
    for side in (outs[:2], outs[2:]):
        for out in side:
            results = {int(k): v for k, v in out["results"].items()}
            assert [results[r["room"]] for r in rooms[:3]] == ["Success"] * 3, out
            for aborted in (13, 14):  # (a rank the MIN-reduce failed first says so; the other has the reason)
                assert "aborted" in results[aborted] or "another TP rank" in results[aborted], out
            assert all(v == 0 for v in out["room_counts"].values()), out["room_counts"]
        for aborted in (13, 14):
            assert any("aborted" in out["results"][str(aborted)] for out in side), side
    for out in outs[2:]:  # decode ranks: each rank's heads landed where they belong, nothing else written
        assert out["bad_pages"] == 0 and out["untouched"], out
        for key, result in out["results"].items():  # a failure this rank saw itself reads Failed after its
            if "another TP rank" not in result and result != "Success":  # fence; one seen first elsewhere
                assert out["fenced_at_failure"][key], (key, result)  # is held (0.5.23's deferred release)
        assert all(out["fenced_later"].values()), out["fenced_later"]  # until its fence


async def test_a_killed_prefill_fails_decodes_rooms_with_a_reason_within_the_heartbeat_bound(
        sglang_backend_python: pathlib.Path) -> None:
    rooms = [room(21, [1, 2], [3, 4], 2, (0, 0)), room(22, [5], [6], 1, (1, 1))]
    async with cluster(sglang_backend_python, {"rooms": rooms, "hold": True}, {"rooms": rooms}) as (prefill, decode):
        await asyncio.sleep(3)  # the rooms reach WaitingForInput on prefill, Transferring on decode
        killed = time.time()
        for proc in prefill:
            proc.send_signal(signal.SIGKILL)
        outs = [await json_line(d, 60) for d in decode]
    bound = 0.5 * (4 + 1) + 2.0  # interval x (failures + 1), plus the MIN-reduce loop and margin
    for r in rooms:
        key = str(r["room"])
        results = [out["results"][key] for out in outs]
        assert any("unheard" in result for result in results), results  # the reason, on the rank that saw it
        assert all("unheard" in result or "another TP rank" in result for result in results), results
        took = min(out["failed_at"][key] for out in outs) - killed
        assert took < bound, (key, took)
    for out in outs:
        assert all(v == 0 for v in out["room_counts"].values()), out["room_counts"]


async def test_failed_rooms_leave_nothing_when_the_scheduler_only_calls_failure_exception(
        sglang_backend_python: pathlib.Path) -> None:
    """SGLang never calls ``clear()`` on a Failed room in its prefill queues (0.5.10 and 0.5.23) nor in
    0.5.10's decode queues: it calls ``failure_exception()`` and drops the sender/receiver (stock
    backends clear in ``failure_exception()``). Nothing may be left in either manager."""
    rooms = [room(31, [9, 10], [6, 8], 1, (4, 3), abort="decode"), room(32, [11], [10], 1, (5, 4), abort="prefill")]
    plan = {"rooms": rooms, "sglang_failure_path": True}
    async with cluster(sglang_backend_python, plan, plan) as (prefill, decode):
        outs = [await json_line(p, 120) for p in prefill + decode]
    for out in outs:
        assert all(v.startswith("Failed") for v in out["results"].values()), out
    for out in outs:
        assert all(v == 0 for v in out["room_counts"].values()), (out["rank"], out["room_counts"])
