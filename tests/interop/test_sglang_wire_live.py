"""Against a real SGLang 0.5.10 (its own connector, in its own venv and process): what its decode
sends is exactly what ``asynckv.proto.sglang`` decodes. Skipped, with the reason, when the SGLang
venv is not built (``bash scripts/sglang-venv.sh``; ``.ci/run`` builds it)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import pathlib
from collections.abc import AsyncIterator

import aiohttp
import numpy as np
import pytest
import zmq
import zmq.asyncio

from asynckv.proto.sglang import SglangRegister, SglangTransferInfo, decode_frames
from asynckv.proto.topology import metadata_agent_name
from asynckv.service.sglang_bootstrap import SglangBootstrapServer

from .conftest import PEER

pytestmark = pytest.mark.integration

PARAMS = ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank")


@contextlib.asynccontextmanager
async def bootstrap_server(which: str) -> AsyncIterator[str]:
    """"": the peer starts SGLang's own; "asynckv": ours, speaking SGLang's HTTP API."""
    if which == "sglang":
        yield ""
        return
    async with SglangBootstrapServer("127.0.0.1", 0) as server:
        yield server.addr


@pytest.mark.parametrize("which", ["sglang", "asynckv"])
async def test_what_a_stock_sglang_decode_sends_decodes_field_for_field(sglang_python: pathlib.Path,
                                                                        which: str) -> None:
    """With asynckv's bootstrap server, SGLang's decode also finds its prefill through our
    ``GET /route`` answers (topology, then the rank's endpoint)."""
    ctx = zmq.asyncio.Context()
    pull = ctx.socket(zmq.PULL)
    try:
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        room, pages, aux = 4535838703865032264, [9, 3, 15, 4, 5], 6
        async with bootstrap_server(which) as boot:
            proc = await asyncio.create_subprocess_exec(
                str(sglang_python), str(PEER), "decode-send", str(port), str(room), ",".join(map(str, pages)),
                str(aux), boot, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            out, err = await asyncio.wait_for(proc.communicate(), 180)
        assert proc.returncode == 0, err.decode(errors="replace")[-3000:]
        sent = json.loads(out.decode().strip().splitlines()[-1])
        raw = [await asyncio.wait_for(pull.recv_multipart(), 10) for _ in range(2)]
    finally:
        pull.close(0)
        ctx.term()
    reg, info = (decode_frames(frames) for frames in raw)
    assert isinstance(reg, SglangRegister) and isinstance(info, SglangTransferInfo)
    assert reg.agent_name == info.agent_name == sent["agent"]
    assert metadata_agent_name(reg.agent_metadata) == sent["agent"].encode()  # real NIXL metadata
    assert list(reg.kv_ptrs) == sent["kv_ptrs"] and list(reg.aux_ptrs) == sent["aux_ptrs"]
    assert reg.kv_item_len == sent["item"] and (reg.tp_size, reg.engine_rank, reg.gpu_id) == (1, 0, 0)
    assert reg.endpoint == info_endpoint(info) == f"tcp://{sent['ip']}:{sent['port']}"
    assert info.room == room and info.aux_index == aux and info.required_dst_info_num == 1
    assert np.array_equal(info.dst_pages, pages) and info.state_indices.size == 0
    assert reg.encode() == raw[0] and info.encode() == raw[1]  # byte for byte, both ways


async def _lookup(addr: str) -> str:
    async with aiohttp.ClientSession() as http:
        for _ in range(200):
            async with http.get(f"http://{addr}/route", params=dict.fromkeys(PARAMS, "-1")) as resp:
                if resp.status == 200:
                    info = await resp.json()
                    break
            await asyncio.sleep(0.05)
        assert info["page_size"] == 4 and info["kv_cache_dtype"] == "auto" and info["dp_size"] == 1
        async with http.get(f"http://{addr}/route", params=dict.fromkeys(PARAMS, "0")) as resp:
            rank = await resp.json()
    return f"tcp://{rank['rank_ip']}:{rank['rank_port']}"


def info_endpoint(info: SglangTransferInfo) -> str:
    return f"tcp://{info.ip}:{info.port}"


@pytest.mark.parametrize("which", ["sglang", "asynckv"])
async def test_a_stock_sglang_prefill_fills_pages_announced_with_our_frames(sglang_python: pathlib.Path,
                                                                          which: str) -> None:
    """Our frames (``SglangRegister``/``SglangTransferInfo``) drive a real SGLang prefill; its NIXL
    notifications parse, ``SglangCompletion`` concludes the room, and every byte is where it belongs:
    several chunks with an uneven last one, scattered pages, the aux row, nothing else touched.
    With asynckv's bootstrap server, the prefill registered there and we found it there."""
    async with bootstrap_server(which) as boot:
        await _prefill_room(sglang_python, boot)


async def _prefill_room(sglang_python: pathlib.Path, boot: str) -> None:
    from nixl._api import nixl_agent, nixl_agent_config

    from asynckv.proto.sglang import SglangCompletion, parse_notification

    from .sglang_peer import ITEM, LAYERS, pattern

    room, src, dst, chunk, src_aux, dst_aux = 77, [3, 8, 1, 12, 5, 6, 14], [9, 2, 15, 4, 11, 0, 7], 3, 2, 5
    kv = [np.zeros((16, ITEM), dtype=np.uint8) for _ in range(2 * LAYERS)]
    aux = [np.zeros((8, 64), dtype=np.uint8) for _ in range(10)]
    agent = nixl_agent("asynckv-sglang-decode-test", nixl_agent_config(backends=["UCX"]))
    for arrays in (kv, aux):
        agent.register_memory([(int(a.ctypes.data), int(a.nbytes), 0, "") for a in arrays], "DRAM")
    proc = await asyncio.create_subprocess_exec(
        str(sglang_python), str(PEER), "prefill-send", str(room), ",".join(map(str, src)), str(chunk), str(src_aux),
        "mha", boot, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    ctx = zmq.asyncio.Context()
    push = ctx.socket(zmq.PUSH)
    try:
        assert proc.stdout is not None
        first = b""
        while not first.startswith(b"{"):  # (NIXL logs to stdout too)
            first = await asyncio.wait_for(proc.stdout.readline(), 120)
            assert first, (await proc.stderr.read()).decode(errors="replace")[-3000:]  # type: ignore[union-attr]
        endpoint = json.loads(first)["endpoint"]
        if boot:  # look it up the way SGLang's decode does
            endpoint = await _lookup(boot)
        push.connect(endpoint)
        name = agent.name if isinstance(agent.name, str) else agent.name.decode()
        await push.send_multipart(SglangRegister(
            "127.0.0.1", 1, name, bytes(agent.get_agent_metadata()), tuple(int(a.ctypes.data) for a in kv),
            tuple(int(a.ctypes.data) for a in aux), (), 0, 1, 0, ITEM).encode())
        await push.send_multipart(SglangTransferInfo(room, "127.0.0.1", 1, name, np.array(dst, dtype=np.int32),
                                                     dst_aux, 1, np.empty(0, dtype=np.int32)).encode())
        done, notes = SglangCompletion(), []
        for _ in range(6000):
            for messages in agent.get_new_notifs().values():
                for raw in messages:
                    notes.append(raw)
                    done.add(parse_notification(raw))
            if done.done or done.error:
                break
            await asyncio.sleep(0.01)
        assert done.done and done.error is None, (notes, done.error)
        _, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, err.decode(errors="replace")[-3000:]
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        push.close(0)
        ctx.term()
    assert sorted(notes) == sorted([f"{room}_kv_{i}_{int(i == 2)}_0".encode() for i in range(3)] + [b"77_aux"])
    for b, buf in enumerate(kv):  # each destination page holds its source page; the others are untouched
        for s, d in zip(src, dst, strict=True):
            assert (buf[d] == pattern(b, s)).all(), (b, s, d)
        assert not buf[[p for p in range(16) if p not in dst]].any()
    for i, rows in enumerate(aux):
        assert (rows[dst_aux] == 100 + i).all() and not np.delete(rows, dst_aux, axis=0).any()
