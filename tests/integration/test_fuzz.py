"""10,000 malformed control messages and 2,000 malformed HTTP requests against live managers
and a bootstrap server: nothing dies, everything is counted, a normal room still succeeds."""

from __future__ import annotations

import asyncio
import json
import struct

import aiohttp
import numpy as np
import pytest
import zmq
import zmq.asyncio

from asynckv import KVPoll
from asynckv.proto.messages import MAGIC, decode, encode
from asynckv.transport.control import ControlChannel

from ..proto.samples import SAMPLES
from .conftest import make_pair, transfer_room

pytestmark = pytest.mark.integration


def garbage(rng: np.random.Generator, i: int) -> list[bytes]:
    kind = i % 6
    if kind == 0:  # random frames
        return [rng.bytes(int(rng.integers(0, 40))) for _ in range(int(rng.integers(1, 10)))]
    valid = encode(SAMPLES[sorted(SAMPLES)[i % len(SAMPLES)]])
    if kind == 1:  # one byte flipped somewhere
        frames = [bytearray(f) for f in valid]
        f = int(rng.integers(0, len(frames)))
        if frames[f]:
            frames[f][int(rng.integers(0, len(frames[f])))] ^= 0xFF
        return [bytes(x) for x in frames]
    if kind == 2:  # truncated
        cut = int(rng.integers(0, len(valid)))
        return valid[:cut] or [b""]
    if kind == 3:  # another protocol version or an unknown type
        return [struct.pack("<4sHH", MAGIC, int(rng.integers(2, 9)), int(rng.integers(0, 300))), *valid[1:]]
    if kind == 4:  # well-formed JSON of the wrong shape
        body = json.dumps({"room": int(rng.integers(-5, 5)), "x": [1, 2]}).encode()
        return [valid[0], body, *valid[2:]]
    return [valid[0], rng.bytes(int(rng.integers(0, 200))), *valid[2:]]  # binary body


def accounted(control: ControlChannel) -> int:
    return sum(control.dropped.values())


async def test_fuzzing_the_control_plane_and_the_bootstrap_server() -> None:
    rng = np.random.default_rng(2026)
    async with make_pair() as pair:
        ctx = zmq.asyncio.Context()
        sockets = []
        try:
            sent: dict[str, int] = {"prefill": 0, "decode": 0}
            decodable: dict[str, int] = {"prefill": 0, "decode": 0}
            for name, mgr in (("prefill", pair.prefill), ("decode", pair.decode)):
                push = ctx.socket(zmq.PUSH)
                push.connect(mgr.endpoint)
                sockets.append(push)
                for i in range(5000):
                    frames = garbage(rng, i)
                    try:
                        decode(frames)
                        decodable[name] += 1
                    except Exception:
                        pass
                    await push.send_multipart(frames)
                    sent[name] += 1
            for _ in range(1000):
                controls = [m.control for m in (pair.prefill, pair.decode)]
                if all(c.received >= 5000 for c in controls):
                    break
                await asyncio.sleep(0.01)
            for name, mgr in (("prefill", pair.prefill), ("decode", pair.decode)):
                control = mgr.control
                assert control.reader_alive and mgr.healthy
                assert control.received == sent[name] == 5000
                # every message is either dropped by the reader or decoded and then handled (or dropped) by the manager
                assert accounted(control) + decodable[name] == sent[name], (control.dropped, decodable)
            async with aiohttp.ClientSession() as http:
                statuses: dict[int, int] = {}
                for i in range(2000):
                    method = ["PUT", "GET", "DELETE", "POST", "PATCH"][i % 5]
                    path = ["/route", "/health", "/route?tp_rank=x", "/nope", "/route?" + rng.bytes(4).hex()][i % 7 % 5]
                    body = rng.bytes(int(rng.integers(0, 300))) if i % 3 else json.dumps({"tp_size": i}).encode()
                    async with http.request(method, f"http://{pair.addr}{path}", data=body) as resp:
                        statuses[resp.status] = statuses.get(resp.status, 0) + 1
                assert all(code < 500 for code in statuses), statuses
                server = pair.prefill.bootstrap_server
                assert server is not None and server.requests_refused >= statuses.get(400, 0)
                async with http.get(f"http://{pair.addr}/health") as resp:
                    assert resp.status == 200
            assert await transfer_room(pair, 77, [1, 2, 3], [9, 8, 7]) == (KVPoll.Success, KVPoll.Success)
        finally:
            for s in sockets:
                s.close(0)
            ctx.term()
