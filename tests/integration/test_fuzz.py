"""10,000 malformed control messages and 2,000 malformed HTTP requests against live managers
and a bootstrap server: nothing dies, everything is counted, a normal room still succeeds."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import struct
import time
from typing import Any

import aiohttp
import numpy as np
import pytest
import zmq
import zmq.asyncio

from asynckv import KVPoll
from asynckv.proto.auth import Authenticator
from asynckv.proto.messages import (
    MAGIC,
    Abort,
    Bye,
    Message,
    Ping,
    Pong,
    Register,
    Status,
    TransferInfo,
    decode,
    encode,
)
from asynckv.proto.topology import stub_agent_metadata
from asynckv.transport.base import ControlPlane

from ..proto.samples import SAMPLES
from .conftest import Pair, make_pair, transfer_room

pytestmark = [pytest.mark.integration, pytest.mark.zmq_wire]


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


def accounted(control: ControlPlane) -> int:
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


def hostile(rng: np.random.Generator, i: int, pair: Pair, real_register: Register) -> Message:
    """A well-formed message an attacker could send: forged ids and sessions, claims of huge
    geometry, another decode's NIXL metadata, destinations for rooms it guesses."""
    p, d = pair.prefill.name, pair.decode.name
    # random ids, and small ones as if the attacker had learned them (not the ids of the real rooms
    # below: whoever learns a room id and a decode's id, from /peers on this host, can abort it)
    room = int(rng.integers(0, 2**63 - 1)) if i % 2 else int(rng.integers(1000, 1064))
    session = int(rng.integers(0, 16)) if i % 3 else int(rng.integers(0, 2**63))
    kind = i % 9
    if kind == 0:  # claims a pool of up to a million pages (4 entries): rows nobody should build
        pages = int(rng.integers(1, 1 << 20))
        return dataclasses.replace(real_register, decode_id=f"evil-{i}", session=session, kv_lens=(pages * 256,) * 4,
                                   agent_metadata=stub_agent_metadata(f"evil-{i}"))
    if kind == 1:  # the real decode's metadata under a new name
        return dataclasses.replace(real_register, decode_id=f"thief-{i}", session=session)
    if kind == 2:
        n = int(rng.integers(0, 5000))
        who = f"evil-{i % 50}" if i % 4 else d
        return TransferInfo(room, int(rng.integers(0, 9)), who, p, int(rng.integers(-1, 99)),
                            int(rng.integers(0, 3)), bool(i % 2), bool(i % 3), 0,
                            rng.integers(-10, 1 << 20, n).astype(np.int32), np.empty(0, np.int32))
    if kind == 3:
        return Abort(room, int(rng.integers(0, 9)), d if i % 2 else f"evil-{i}", bool(i % 3), 1, "forged")
    if kind == 4:  # names the real, public, prefill id: only the session it cannot know is missing
        return Status(room, int(rng.integers(0, 9)), p, session, 0, bool(i % 2), "forged")
    if kind == 5:
        return Ping(d if i % 2 else p, f"tcp://127.0.0.1:{int(rng.integers(1, 65535))}", session, i)
    if kind == 6:
        return Pong(d if i % 2 else p, session, i)
    if kind == 7:
        return Bye(d if i % 2 else p, session, "forged goodbye")
    return dataclasses.replace(real_register, decode_id=f"odd-{i}", session=session, page_size=int(rng.integers(1, 99)),
                               agent_metadata=rng.bytes(int(rng.integers(0, 600))))


def accounting(mgr: Any) -> tuple[int, int, int]:
    """(received, dropped by the reader, handed to the core) of a manager's control channel."""
    control = mgr.control
    dropped = sum(v for k, v in control.dropped.items() if k not in ("send_failed", "reply_limited"))  # (sends)
    return control.received, dropped, sum(v for k, v in mgr.stats.items() if k.startswith("msg_"))


def _rss_mib() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024


@pytest.mark.parametrize("token", ["", "s3cret"], ids=["no-token", "token"])
async def test_ten_thousand_hostile_control_messages(token: str) -> None:
    rng = np.random.default_rng(7)
    async with make_pair(auth_token=token) as pair:
        assert await transfer_room(pair, 1, [1, 2], [3, 4]) == (KVPoll.Success, KVPoll.Success)
        real_register = dataclasses.replace(pair.decode._svc.core._register,  # type: ignore[union-attr]
                                            prefill_id=pair.prefill.name)
        lag = 0.0
        ticking = True

        async def ticker() -> None:
            nonlocal lag
            loop = asyncio.get_running_loop()
            while ticking:
                t = loop.time()
                await asyncio.sleep(0.01)
                lag = max(lag, loop.time() - t - 0.01)

        tick = asyncio.create_task(ticker())
        ctx = zmq.asyncio.Context()
        wrong, right = Authenticator("guess"), Authenticator(token or "unused")
        rss0 = _rss_mib()
        targets = {"prefill": pair.prefill, "decode": pair.decode}
        sent = dict.fromkeys(targets, 0)
        before = {name: accounting(mgr) for name, mgr in targets.items()}
        try:
            for name, mgr in targets.items():
                push = ctx.socket(zmq.PUSH)
                push.connect(mgr.endpoint)
                captured = None
                for i in range(5000):
                    frames = garbage(rng, i) if i % 2 else encode(hostile(rng, i, pair, real_register))
                    if i % 500 == 7:  # a few oversized destinations (8 MB of pages)
                        frames = encode(TransferInfo(i, 1, pair.decode.name, pair.prefill.name, -1, 1, False, False,
                                                     0, np.arange(2 << 20, dtype=np.int32), np.empty(0, np.int32)))
                    if token and i % 5 == 1:
                        frames = wrong.seal(frames, mgr.endpoint, time.time_ns())
                    elif token and i % 5 == 2:  # one message the attacker saw, replayed over and over
                        captured = captured or right.seal(encode(Ping("x", "tcp://127.0.0.1:9", 1, 1)),
                                                          mgr.endpoint, time.time_ns())
                        frames = captured
                    await push.send_multipart(frames)
                    sent[name] += 1
                    if i % 250 == 0:
                        await asyncio.sleep(0)
                push.close(linger=5000)
            for _ in range(3000):
                if all(m.control.received - before[n][0] >= sent[n] for n, m in targets.items()):
                    break
                await asyncio.sleep(0.01)
            growth = _rss_mib() - rss0
            for name, mgr in targets.items():
                control = mgr.control
                assert control.reader_alive and mgr.healthy
                after = accounting(mgr)
                received, dropped, handled = (now - then for now, then in zip(after, before[name], strict=True))
                assert received >= sent[name] == 5000  # (plus the pair's own heartbeats meanwhile)
                assert dropped + handled == received, (control.dropped, mgr.stats)  # each dropped or handled
                if token:  # nothing unauthenticated got through (one copy of the replayed Ping did)
                    assert control.dropped["auth_replayed"] >= 990 and control.dropped["auth_bad_mac"] >= 1000
            print(f"token={bool(token)}: RSS +{growth:.0f} MiB, loop lag max {lag * 1000:.0f} ms, "
                  f"prefill dropped {dict(pair.prefill.control.dropped)}, stats {dict(pair.prefill.stats)}")
            assert growth < 256, f"RSS grew {growth:.0f} MiB"
            assert lag < 1.0, f"event loop stalled {lag:.2f} s"
            # nothing hostile stayed: once the queued registrations were refused (they connect
            # max_connecting_peers at a time, in order), the only peer is the real decode
            t = time.monotonic()
            while [peer["peer"] for peer in pair.prefill.snapshot()["peers"]] != [pair.decode.name]:
                assert time.monotonic() - t < 60, pair.prefill.snapshot()["peers"][:3]
                await asyncio.sleep(0.05)
            print(f"hostile registrations all refused {time.monotonic() - t:.1f} s after the last message")
            assert await transfer_room(pair, 2, [5, 6, 7], [8, 9, 10]) == (KVPoll.Success, KVPoll.Success)
        finally:
            ticking = False
            await tick
            ctx.term()
