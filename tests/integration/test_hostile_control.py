"""Hostile registrations and API edges against live managers (real NIXL, ZMQ, bootstrap server):
a registration cannot touch another peer's NIXL agent, protected mode keeps UCX on loopback,
and bad arguments are refused, not truncated."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
from collections.abc import Callable
from typing import Any, cast

import numpy as np
import pytest
import zmq
import zmq.asyncio

from asynckv import KVPoll
from asynckv.errors import InvalidArgument
from asynckv.proto.messages import Register, RegisterResult, Status, decode, encode

from .conftest import CONTROL, Pair, make_pair, transfer_room

pytestmark = [pytest.mark.integration, pytest.mark.zmq_wire]


def _decode_register(pair: Pair) -> Register:
    """The Register the pair's decode sends (its real NIXL metadata), addressed to the prefill."""
    template: Register = pair.decode._svc.core._register  # type: ignore[union-attr]
    return dataclasses.replace(template, prefill_id=pair.prefill.name, session=99, lease_ms=3000)


async def _register_and_answer(pair: Pair, reg: Register) -> RegisterResult:
    """Send ``reg`` to the prefill from a socket of our own; return its answer."""
    ctx = zmq.asyncio.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    try:
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        push.connect(pair.prefill.endpoint)
        await push.send_multipart(encode(dataclasses.replace(reg, endpoint=f"tcp://127.0.0.1:{port}")))
        answer = decode(await asyncio.wait_for(pull.recv_multipart(), 10))
        assert isinstance(answer, RegisterResult)
        return answer
    finally:
        pull.close(0)
        push.close(0)
        ctx.term()


def _spy_on_agent(pair: Pair) -> list[tuple[str, Any]]:
    """Record the prefill agents' add/remove_remote_agent calls (the real agents still do them)."""
    plane = pair.prefill.data_plane
    calls: list[tuple[str, Any]] = []
    for agent, name in itertools.product([lane._agent for lane in getattr(plane, "lanes", [plane])],
                                         ("add_remote_agent", "remove_remote_agent")):
        real = getattr(agent, name)

        def spy(arg: Any, _real: Callable[[Any], Any] = real, _name: str = name) -> Any:
            calls.append((_name, arg))
            return _real(arg)
        setattr(agent, name, spy)
    return calls


async def test_a_registration_carrying_another_decodes_metadata_cannot_remove_its_agent() -> None:
    async with make_pair() as pair:
        assert await transfer_room(pair, 1, [1, 2], [3, 4]) == (KVPoll.Success, KVPoll.Success)
        calls = _spy_on_agent(pair)
        stolen = _decode_register(pair)
        answer = await _register_and_answer(pair, dataclasses.replace(stolen, decode_id="impostor-decode"))
        assert not answer.ok and "carries agent" in answer.reason, answer
        assert calls == []  # refused before NIXL saw anything: the real decode's agent is untouched
        for room in (2, 3):  # (it was removed before, and every later room failed NIXL_ERR_NOT_FOUND)
            assert await transfer_room(pair, room, [5, 6, 7], [8, 9, 10]) == (KVPoll.Success, KVPoll.Success)


async def test_metadata_naming_an_agent_that_is_not_utf8_is_refused_before_it_is_loaded() -> None:
    async with make_pair() as pair:
        calls = _spy_on_agent(pair)
        reg = _decode_register(pair)
        md = bytearray(reg.agent_metadata)
        at = md.index(reg.decode_id.encode())
        md[at:at + 4] = b"\xff\xfe\xfd\xfc"  # same length: still well-formed NIXL metadata
        answer = await _register_and_answer(pair, dataclasses.replace(reg, decode_id="x" + reg.decode_id[1:],
                                                                      agent_metadata=bytes(md)))
        assert not answer.ok and "carries agent" in answer.reason
        assert calls == []  # (it was loaded, then could not be named to remove: leaked)
        assert pair.prefill.snapshot()["peers"] == []
        assert await transfer_room(pair, 4, [1], [2]) == (KVPoll.Success, KVPoll.Success)


def _listening(pid: int) -> set[str]:
    """host:port of every IPv4 TCP socket of ``pid`` in LISTEN state (from /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    with open(f"/proc/{pid}/net/tcp") as table:
        for line in list(table)[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:
                hexip, hexport = fields[1].split(":")
                ip = ".".join(str(b) for b in reversed(bytes.fromhex(hexip)))
                found.add(f"{ip}:{int(hexport, 16)}")
    return found


@pytest.mark.skipif(not os.path.exists("/proc/self/net/tcp"), reason="needs /proc/<pid>/net/tcp")
@pytest.mark.parametrize("opt_out", [False, True])
async def test_protected_mode_keeps_ucx_listening_on_loopback(opt_out: bool, netns: tuple[str, str]) -> None:
    """By default UCX's TCP transport listens on every interface (here the veth address too),
    whatever the control socket binds to; in protected mode it listens on loopback only."""
    before = _listening(os.getpid())
    async with make_pair(allow_unauthenticated=opt_out) as pair:
        assert await transfer_room(pair, 5, [1, 2], [3, 4]) == (KVPoll.Success, KVPoll.Success)
        new = _listening(os.getpid()) - before
    others = sorted(a for a in new if not a.startswith("127."))
    print(f"allow_unauthenticated={opt_out}: new listeners {sorted(new)}")
    assert new, "the managers' UCX listeners were not found"
    if opt_out:
        assert others, "expected UCX on the other interfaces too without protected mode"
    else:
        assert others == [], others


async def test_bad_indices_are_refused_not_truncated_and_numpy_integers_are_taken() -> None:
    async with make_pair() as pair:
        for bad in (2.9, True, "1", None):
            receiver = pair.decode.receiver(pair.addr, 10)
            with pytest.raises(InvalidArgument, match="aux_index"):
                await receiver.init([1, 2], bad)  # type: ignore[arg-type]
            receiver.clear()
            sender = pair.prefill.sender(10)
            with pytest.raises(InvalidArgument, match="aux_index"):
                sender.init(2, bad)  # type: ignore[arg-type]
            with pytest.raises(InvalidArgument, match="num_pages"):
                sender.init(bad)  # type: ignore[arg-type]
            sender.clear()
        src, dst = np.array([3, 4]), np.array([5, 6])
        receiver, sender = pair.decode.receiver(pair.addr, 11), pair.prefill.sender(11)
        assert await receiver.init(dst, np.int64(1)) == KVPoll.WaitingForInput
        assert await sender.wait_ready(10) == KVPoll.WaitingForInput
        sender.init(np.int64(2), np.int32(1))
        await sender.send(src)
        assert await receiver.wait(10) == KVPoll.Success and await sender.wait(10) == KVPoll.Success


async def test_a_forged_status_naming_the_public_prefill_id_completes_nothing() -> None:
    """The prefill's agent id is public (GET /route), so a Status naming it proves nothing; only the
    prefill that received decode's Register knows the session (63 random bits) it must also name."""
    async with make_pair() as pair:
        assert await transfer_room(pair, 20, [1], [2]) == (KVPoll.Success, KVPoll.Success)
        receiver = pair.decode.receiver(pair.addr, 21)
        assert await receiver.init([3, 4]) == KVPoll.WaitingForInput
        ctx = zmq.asyncio.Context()
        push = ctx.socket(zmq.PUSH)
        push.connect(pair.decode.endpoint)
        try:
            epoch = receiver.state.epoch  # (an insider might know the room id and epoch)
            for session in range(64):  # guesses
                await push.send_multipart(encode(Status(21, epoch, pair.prefill.name, session, 0, True, "")))
            for _ in range(400):
                if pair.decode.stats["msg_Status"] >= 65:
                    break
                await asyncio.sleep(0.005)
            assert pair.decode.stats["dropped_wrong_session"] == 64
            assert receiver.poll() == KVPoll.WaitingForInput  # (it was Success with 0 of 2 pages written)
            sender = pair.prefill.sender(21)
            assert await sender.wait_ready(10) == KVPoll.WaitingForInput
            sender.init(2)
            await sender.send([5, 6])
            assert await receiver.wait(10) == KVPoll.Success
        finally:
            push.close(0)
            ctx.term()


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_replies_to_made_up_endpoints_open_a_bounded_number_of_sockets() -> None:
    """A ping of an unknown session is answered Bye at the endpoint it names: 1,500 pings naming
    1,500 made-up endpoints opened 1,500 sockets for good (then 'Too many open files' for every
    send, and no new decode could register). Now such replies share a small pool, rate limited."""
    from asynckv import Config, KVManager, Mode
    from asynckv.proto.messages import Ping
    from asynckv.testing import KVPool
    from asynckv.transport.control import TRANSIENT_SOCKETS, ControlChannel

    async with make_pair() as pair:
        fds = _open_fds()
        ctx = zmq.asyncio.Context()
        push = ctx.socket(zmq.PUSH)
        push.connect(pair.prefill.endpoint)
        try:
            for i in range(1500):
                await push.send_multipart(encode(Ping("nobody", f"tcp://127.0.0.1:{20000 + i}", 42, i)))
            for _ in range(500):
                if pair.prefill.control.received >= 1500:
                    break
                await asyncio.sleep(0.01)
        finally:
            push.close(0)
            ctx.term()
        control = cast(ControlChannel, pair.prefill.control)  # (a zmq_wire test: ZMQ's channel)
        print(f"fds {fds} -> {_open_fds()}, dropped {dict(control.dropped)}")
        assert len(control._transient) <= TRANSIENT_SOCKETS
        assert control.dropped["reply_limited"] >= 1000 and control.send_failures == 0
        assert _open_fds() - fds < 3 * TRANSIENT_SOCKETS
        pool = KVPool(4, 64, 256, aux_rows=16)  # a decode that comes later still registers
        async with KVManager(Mode.DECODE, pool.kv_args(4), config=Config(**CONTROL, waiting_timeout_s=30)) as late:
            receiver, sender = late.receiver(pair.addr, 40), pair.prefill.sender(40)
            assert await receiver.init([1, 2]) == KVPoll.WaitingForInput, receiver.failure_reason
            assert await sender.wait_ready(10) == KVPoll.WaitingForInput
            sender.init(2)
            await sender.send([3, 4])
            assert await receiver.wait(10) == KVPoll.Success


_FLOOD = """
import sys, zmq
ctx = zmq.Context()
push = ctx.socket(zmq.PUSH)
push.setsockopt(zmq.SNDHWM, 0)
push.connect(sys.argv[1])
for i in range(int(sys.argv[2])):
    push.send_multipart([b"AKVP\\x03\\x00", b"{}"])
push.close(linger=10000)
"""


async def test_a_flood_of_tiny_messages_does_not_hold_the_event_loop() -> None:
    """ZMQ hands a queued message over without suspending: 200,000 tiny malformed messages held the
    loop for 9 s in one go. The reader now yields every batch."""
    import sys
    import time

    async with make_pair() as pair:
        lag = 0.0
        ticking = True

        async def ticker() -> None:
            nonlocal lag
            while ticking:
                t = time.monotonic()
                await asyncio.sleep(0.01)
                lag = max(lag, time.monotonic() - t - 0.01)

        tick = asyncio.create_task(ticker())
        n = 100_000
        flood = await asyncio.create_subprocess_exec(sys.executable, "-c", _FLOOD, pair.prefill.endpoint, str(n))
        try:
            assert await asyncio.wait_for(flood.wait(), 60) == 0
            for _ in range(3000):
                if pair.prefill.control.dropped["malformed"] >= n:
                    break
                await asyncio.sleep(0.01)
        finally:
            ticking = False
            await tick
        print(f"{n} tiny messages: worst loop lag {lag * 1000:.0f} ms")
        assert pair.prefill.control.dropped["malformed"] >= n
        assert lag < 0.5
        assert await transfer_room(pair, 41, [1], [2]) == (KVPoll.Success, KVPoll.Success)
