"""asynckv managers on SGLang's wire (``Config(wire="sglang-0.5.10")``) against a real SGLang 0.5.10
rank running its own connector in its own process: both directions, MHA and MLA, several chunks
with an uneven last one, scattered pages, the aux row, byte for byte with every other page
untouched; a killed peer on either side; capability mismatches and an out-of-scope feature
refused with the reason. Skipped, with the reason, when the SGLang venv is not built."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pathlib
import signal
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from asynckv import Config, KVManager, KVPoll, LayoutMismatch, Mode, PeerUnreachable
from asynckv.testing import KVPool, fill_aux, fill_pages

from .conftest import PEER
from .sglang_peer import ITEM, LAYERS, PAGES, pattern

pytestmark = pytest.mark.integration

WIRE = "sglang-0.5.10"
PREFILL = pathlib.Path(__file__).with_name("asynckv_prefill.py")
SRC, DST, CHUNK, SRC_AUX, DST_AUX = [3, 8, 1, 12, 5, 6, 14], [9, 2, 15, 4, 11, 0, 7], 3, 2, 5


def pool(mla: bool) -> KVPool:
    """The SGLang peer's geometry: 16 pages of 256 bytes per buffer, 10 aux buffers of 8 x 64 bytes."""
    return KVPool(LAYERS if mla else 2 * LAYERS, PAGES, ITEM, aux_rows=8, aux_buffers=10)


def page_bytes(p: KVPool, buffer: int, page: int) -> np.ndarray:
    row: np.ndarray = p.kv[buffer, page].view(np.uint8)
    return row


@contextlib.asynccontextmanager
async def peer(python: pathlib.Path, *args: str, env: dict[str, str] | None = None
               ) -> AsyncIterator[asyncio.subprocess.Process]:
    proc = await asyncio.create_subprocess_exec(str(python), *args, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE, env={**os.environ, **(env or {})})
    try:
        yield proc
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def line(proc: asyncio.subprocess.Process, timeout: float = 120) -> dict[str, Any]:
    """The next JSON line a peer prints (NIXL logs to stdout too)."""
    assert proc.stdout is not None and proc.stderr is not None
    while True:
        raw = await asyncio.wait_for(proc.stdout.readline(), timeout)
        assert raw, (await proc.stderr.read()).decode(errors="replace")[-3000:]
        if raw.startswith(b"{"):
            data: dict[str, Any] = json.loads(raw)
            return data


# -- asynckv decode <- SGLang prefill ----------------------------------------------------------


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
async def test_asynckv_decode_receives_from_a_stock_sglang_prefill(sglang_python: pathlib.Path, mla: bool) -> None:
    room, dst_pool = 4535838703865032264, pool(mla)
    config = Config(wire=WIRE, waiting_timeout_s=60.0)
    async with peer(sglang_python, str(PEER), "prefill-send", str(room), ",".join(map(str, SRC)), str(CHUNK),
                    str(SRC_AUX), "mla" if mla else "mha") as proc:
        boot = (await line(proc))["bootstrap"]
        async with KVManager(Mode.DECODE, dst_pool.kv_args(4, is_mla=mla), config=config) as decode:
            receiver = decode.receiver(boot, room)
            # (the stock prefill sends as soon as it hears: a descheduled decode may find it done)
            assert await receiver.init(DST, DST_AUX) != KVPoll.Failed, receiver.failure_reason
            assert await receiver.wait(60) == KVPoll.Success, receiver.failure_reason
            assert (await line(proc))["done"]
            assert decode.stats.get("dropped_unknown_room", 0) == 0
            receiver.clear()
            assert all(v == 0 for v in decode.room_counts().values()), decode.room_counts()
    for b in range(dst_pool.entries):  # each destination page holds its source page; nothing else was written
        for s, d in zip(SRC, DST, strict=True):
            assert (page_bytes(dst_pool, b, d) == pattern(b, s)).all(), (b, s, d)
        assert not dst_pool.kv[b, [p for p in range(PAGES) if p not in DST]].any()
    for i, rows in enumerate(dst_pool.aux):
        assert (rows[DST_AUX].view(np.uint8) == 100 + i).all() and not np.delete(rows, DST_AUX, axis=0).any()


async def test_a_killed_sglang_prefill_fails_the_room_within_the_heartbeat_bound(
        sglang_python: pathlib.Path) -> None:
    """SGLang's prefill holds the room, then is SIGKILLed (its bootstrap server dies with it): our
    decode's health checks fail and the room fails with the reason, within interval x failures."""
    interval, failures = 0.5, 4
    config = Config(wire=WIRE, heartbeat_interval_s=interval, heartbeat_max_failures=failures)
    async with peer(sglang_python, str(PEER), "prefill-send", "7", "1,2", "0", "0", "mha") as proc:
        boot = (await line(proc))["bootstrap"]
        async with KVManager(Mode.DECODE, pool(False).kv_args(4), config=config) as decode:
            receiver = decode.receiver(boot, 7)
            assert await receiver.init([5, 6], 1) == KVPoll.WaitingForInput
            assert (await line(proc))["holding"] == 7
            proc.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            assert await receiver.wait(30) == KVPoll.Failed
            took = time.monotonic() - killed
            print(f"killed SGLang prefill: room failed {took:.2f}s after the kill")
            assert isinstance(receiver.failure_exception(), PeerUnreachable), receiver.failure_reason
            assert "health checks" in (receiver.failure_reason or "")
            assert took < interval * (failures + 1) + 1.5, took
            receiver.clear()


@pytest.mark.parametrize(("field", "fields", "expected"), [
    ("page_size", {"page_size": 8}, "page_size mismatch: prefill has 4, decode has 8"),
    ("kv_cache_dtype", {"sglang_kv_cache_dtype": "fp8_e4m3"}, "kv_cache_dtype mismatch: prefill has 'auto'"),
])
async def test_asynckv_decode_refuses_a_mismatched_sglang_prefill_naming_the_field(
        sglang_python: pathlib.Path, field: str, fields: dict[str, Any], expected: str) -> None:
    page_size = fields.pop("page_size", 4)
    async with peer(sglang_python, str(PEER), "prefill-send", "9", "1", "0", "0", "mha") as proc:
        boot = (await line(proc))["bootstrap"]
        async with KVManager(Mode.DECODE, pool(False).kv_args(page_size), config=Config(wire=WIRE, **fields)) as d:
            receiver = d.receiver(boot, 9)
            started = time.monotonic()
            assert await receiver.init([1], 0) == KVPoll.Failed
            assert time.monotonic() - started < 5
            assert isinstance(receiver.failure_exception(), LayoutMismatch)
            assert expected in (receiver.failure_reason or ""), receiver.failure_reason


# -- SGLang decode <- asynckv prefill ----------------------------------------------------------


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
async def test_a_stock_sglang_decode_receives_from_asynckv_prefill(sglang_python: pathlib.Path, mla: bool) -> None:
    room, src_pool = 8080, pool(mla)
    fill_pages(src_pool, room, SRC)
    fill_aux(src_pool, room, SRC_AUX)
    async with KVManager(Mode.PREFILL, src_pool.kv_args(4, is_mla=mla), bootstrap_addr="127.0.0.1:0",
                         config=Config(wire=WIRE)) as prefill:
        sender = prefill.sender(room)
        assert prefill.bootstrap_addr is not None
        async with peer(sglang_python, str(PEER), "decode-recv", prefill.bootstrap_addr, str(room),
                        ",".join(map(str, DST)), str(DST_AUX), "mla" if mla else "mha") as proc:
            assert (await line(proc))["sent"] == room
            assert await sender.wait_ready(30) == KVPoll.WaitingForInput
            sender.init(len(SRC), SRC_AUX)
            for i in range(0, len(SRC), CHUNK):
                await sender.send(np.array(SRC[i:i + CHUNK]))
            assert await sender.wait(30) == KVPoll.Success, sender.failure_reason
            result = await line(proc)
        assert result["outcome"] == "Success", result
        sender.clear()
        assert all(v == 0 for v in prefill.room_counts().values()), prefill.room_counts()
    kv = [np.frombuffer(bytes.fromhex(h), dtype=np.uint8).reshape(PAGES, ITEM) for h in result["kv"]]
    for b, buf in enumerate(kv):
        for s, d in zip(SRC, DST, strict=True):
            assert (buf[d] == page_bytes(src_pool, b, s)).all(), (b, s, d)
        assert not buf[[p for p in range(PAGES) if p not in DST]].any()
    for i, hexed in enumerate(result["aux"]):
        rows = np.frombuffer(bytes.fromhex(hexed), dtype=np.uint8).reshape(8, 64)
        assert (rows[DST_AUX] == src_pool.aux[i][SRC_AUX].view(np.uint8)).all()
        assert not np.delete(rows, DST_AUX, axis=0).any()


async def test_a_killed_asynckv_prefill_fails_the_sglang_decode_by_its_own_heartbeat(
        sglang_python: pathlib.Path) -> None:
    """SGLang's decode checks the prefill's ``GET /health`` (every max(interval, 2 s); 2 failures
    fail the room). The asynckv prefill process, with its embedded bootstrap server, is SIGKILLed
    while holding the room: SGLang's decode reports Failed by its own heartbeat (measured here)."""
    async with peer(pathlib.Path(sys.executable), str(PREFILL), "31", "mha") as prefill:
        boot = (await line(prefill))["bootstrap"]
        env = {"SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "2", "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "2"}
        async with peer(sglang_python, str(PEER), "decode-recv", boot, "31", "1,2,3", "0", "mha", env=env) as decode:
            assert (await line(decode))["sent"] == 31
            assert (await line(prefill))["ready"] == 31
            prefill.send_signal(signal.SIGKILL)
            result = await line(decode, 60)
    assert result["outcome"] == "Failed", result
    assert result["seconds"] < 15, result
    print(f"killed asynckv prefill: SGLang decode failed the room {result['seconds']:.2f}s after its metadata went")


async def test_a_stock_sglang_decode_refuses_a_mismatched_asynckv_prefill(sglang_python: pathlib.Path) -> None:
    """Both sides compare ``kv_cache_dtype``: SGLang's decode refuses ours with its own message."""
    config = Config(wire=WIRE, sglang_kv_cache_dtype="fp8_e5m2")
    async with KVManager(Mode.PREFILL, pool(False).kv_args(4), bootstrap_addr="127.0.0.1:0", config=config) as p:
        assert p.bootstrap_addr is not None
        async with peer(sglang_python, str(PEER), "decode-recv", p.bootstrap_addr, "3", "1", "0", "mha") as proc:
            result = await line(proc)
    assert result["outcome"] == "refused" and "KV cache dtype mismatch" in result["error"], result


async def test_sglang_hybrid_state_is_refused_with_the_reason_not_a_hang(sglang_python: pathlib.Path) -> None:
    """Out of scope on this wire: hybrid-model state. A real SGLang decode sends state indices with
    its transfer info; asynckv's sender fails at once naming them (SGLang's decode cannot be told:
    it waits for its own timeout, documented)."""
    async with KVManager(Mode.PREFILL, pool(False).kv_args(4), bootstrap_addr="127.0.0.1:0",
                         config=Config(wire=WIRE)) as prefill:
        sender = prefill.sender(12)
        assert prefill.bootstrap_addr is not None
        async with peer(sglang_python, str(PEER), "decode-recv", prefill.bootstrap_addr, "12", "1,2", "0", "mha",
                        "state"):
            assert await sender.wait_ready(60) == KVPoll.Failed
        assert "state indices" in (sender.failure_reason or ""), sender.failure_reason
        assert "not supported on the SGLang wire" in (sender.failure_reason or "")
        sender.clear()
