"""Real NIXL (UCX, DRAM) split writes through a ``LanedDataPlane`` into a peer process that is stopped
(SIGSTOP) or killed (SIGKILL) mid-write: each settles once, with at most one handle per lane landing
after a cancel, a close does not hang and keeps the agents of lanes with handles still in flight.
UCX_TLS=tcp, so that a stopped peer really holds handles in flight. Written by a review of the lanes'
data plane (these held). The last two end a lane's engine thread (an engine bug, the one fault here
no peer can cause, injected at its progress call) and close the plane with the real agent behind it:
it keeps that agent until exit while a handle of it may still run, and releases everything otherwise."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from typing import Any

import numpy as np
import pytest

from asynckv.transport import agent as agent_module
from asynckv.transport.base import MemoryLayout, PreppedPiece, Write
from asynckv.transport.lanes import LanedDataPlane
from asynckv.transport.nixl import NixlDataPlane

from ..transport.waiting import until

pytestmark = pytest.mark.integration

MIB = 1 << 20
ROWS = 64  # 64 rows of 1 MiB on each side

PEER = r"""
import sys, time, numpy as np
from nixl._api import nixl_agent, nixl_agent_config
a = nixl_agent("decode-peer", nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=["UCX"]))
buf = np.zeros(64 << 20, dtype=np.uint8)
a.register_memory([(int(buf.ctypes.data), buf.nbytes, 0, "")], "DRAM")
sys.stdout.write("MD " + a.get_agent_metadata().hex() + " " + str(buf.ctypes.data) + "\n"); sys.stdout.flush()
while True:
    a.get_new_notifs()
    time.sleep(0.0005)
"""


class Counting:
    """A real agent, counting the handles made."""

    def __init__(self, inner: Any) -> None:
        self._inner, self.made = inner, 0

    def make_prepped_xfer(self, *args: Any) -> Any:
        self.made += 1
        return self._inner.make_prepped_xfer(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class Dying(Counting):
    """A real agent whose engine thread dies at its next progress call once ``die`` is set (an engine bug),
    recording the releases made through it."""

    RELEASES = ("release_xfer_handle", "release_dlist_handle", "remove_remote_agent", "deregister_memory")

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.die = False
        self.released: list[str] = []

    def get_new_notifs(self) -> Any:
        if self.die:
            raise SystemExit("engine bug")
        return self._inner.get_new_notifs()

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._inner, name)
        if name not in self.RELEASES:
            return fn

        def released(*args: Any) -> Any:
            self.released.append(name)
            return fn(*args)
        return released


async def dead(lane: NixlDataPlane) -> None:
    """Until the lane's thread has ended (``_running`` is false a little earlier)."""
    thread = lane._thread
    assert thread is not None
    await until(lambda: not thread.is_alive(), "the lane's thread ended")


DIES = pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")


def rows_at(base: int) -> np.ndarray:
    r = np.zeros((ROWS, 3), dtype=np.uint64)
    r[:, 0] = base + MIB * np.arange(ROWS, dtype=np.uint64)
    r[:, 1] = MIB
    return r


def split(handles: int = 4) -> Write:
    per = ROWS // handles
    pieces = tuple(PreppedPiece(np.arange(i * per, (i + 1) * per, dtype=np.int32),
                                np.arange(i * per, (i + 1) * per, dtype=np.int32)) for i in range(handles))
    return Write(pieces, ROWS, ROWS * MIB)


@pytest.fixture
def peer(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("UCX_TLS", "tcp")
    env = dict(os.environ, UCX_TLS="tcp")
    proc = subprocess.Popen([sys.executable, "-c", PEER], stdout=subprocess.PIPE, env=env, text=True)
    try:
        line = [""]
        while line[0] != "MD":
            line = (proc.stdout.readline() or "MD 00 0").split() or [""]  # type: ignore[union-attr]
        yield proc, bytes.fromhex(line[1]), int(line[2])
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
        proc.wait(5)
        proc.stdout.close()  # type: ignore[union-attr]


async def make(peer_md: bytes, peer_base: int) -> tuple[LanedDataPlane, list[Dying], list[Any], np.ndarray]:
    src = np.full(ROWS * MIB, 7, dtype=np.uint8)
    agents: list[Dying] = []

    def factory(name: str, backend: str) -> Dying:
        agents.append(Dying(agent_module.nixl_agent(name, backend, True)))
        return agents[-1]
    plane = LanedDataPlane.make("pf-lanes", 2, lambda n: NixlDataPlane(n, agent_factory=factory), relay=True)
    settled: list[Any] = []
    plane.on_settled = settled.extend
    base = int(src.ctypes.data)
    region = np.array([[base, ROWS * MIB, 0]], dtype=np.uint64)
    await plane.start(MemoryLayout((("DRAM", region),), rows_at(base), "DRAM", (base, 64), keep=(src,)))
    await plane.connect_peer("decode-peer", peer_md, rows_at(peer_base), "DRAM")
    plane.set_lease("decode-peer", time.monotonic() + 60)
    return plane, agents, settled, src


async def stop_mid_write(plane: LanedDataPlane, proc: subprocess.Popen[str], handles: int) -> None:
    """Stop the peer (SIGSTOP), then post write 1 of ``handles`` handles to it: each lane's part in flight."""
    os.kill(proc.pid, signal.SIGSTOP)
    plane.post(1, "decode-peer", split(handles), 30.0)
    await until(lambda: plane.posts_in_flight == 2, "both lanes' parts in flight")


def threads_ended(plane: LanedDataPlane) -> bool:
    return all(lane._thread is None or not lane._thread.is_alive() for lane in plane.lanes)


async def test_stopped_peer_forget_reconnect_then_resume(peer: Any) -> None:
    """forget_peer while both parts' handles are in flight to a stopped peer, then connect the same name
    again before they finish: the old write settles once (forgotten), at most one handle per lane, and a
    write over the new connection lands."""
    proc, md, base = peer
    plane, agents, settled, _src = await make(md, base)
    try:
        await stop_mid_write(plane, proc, 8)
        plane.forget_peer("decode-peer")
        await asyncio.sleep(0.1)
        assert settled == []
        connected = await asyncio.gather(plane.connect_peer("decode-peer", md, rows_at(base), "DRAM"),
                                         return_exceptions=True)
        assert list(connected) == [None]  # (real NIXL takes the same name again while old handles run)
        plane.set_lease("decode-peer", time.monotonic() + 60)
        os.kill(proc.pid, signal.SIGCONT)
        await until(lambda: len(settled) == 1, "the write settled")
        assert settled[0][0] == 1 and settled[0][1] is not None and [a.made for a in agents] == [1, 1]
        if not isinstance(connected[0], BaseException):
            plane.post(2, "decode-peer", split(4), 30.0)
            await until(lambda: len(settled) == 2, "the second write settled")
            assert settled[1] == (2, None), settled
        await asyncio.sleep(0.05)
        assert len(settled) == (1 if isinstance(connected[0], BaseException) else 2)
    finally:
        await asyncio.wait_for(plane.close(), 15)
    assert threads_ended(plane)
    assert all(lane._remote == {} and lane._retired == {} and lane._parked == [] for lane in plane.lanes)


async def test_stopped_peer_cancel_then_resume_settles_once_with_at_most_one_handle_per_lane(peer: Any) -> None:
    proc, md, base = peer
    plane, agents, settled, _src = await make(md, base)
    try:
        await stop_mid_write(plane, proc, 8)  # 8 handles of 8 MiB: 4 per lane
        reason = RuntimeError("cancelled by test")
        plane.cancel([1], reason)
        await asyncio.sleep(0.3)
        assert settled == []  # handles in flight: not settled yet
        os.kill(proc.pid, signal.SIGCONT)
        await until(lambda: len(settled) == 1, "the write settled")
        await asyncio.sleep(0.05)
        assert settled == [(1, reason)]
        assert [a.made for a in agents] == [1, 1]
    finally:
        await asyncio.wait_for(plane.close(), 15)
    assert threads_ended(plane)


async def test_stopped_peer_close_mid_split_write_does_not_hang_and_settles_once(peer: Any) -> None:
    proc, md, base = peer
    plane, _agents, settled, _src = await make(md, base)
    await stop_mid_write(plane, proc, 4)
    kept = len(agent_module._KEPT_UNTIL_EXIT)
    t0 = time.monotonic()
    await asyncio.wait_for(plane.close(), 15)
    took = time.monotonic() - t0
    await asyncio.sleep(0.05)
    assert [p for p, _ in settled] == [1] and settled[0][1] is not None
    assert plane.take_in_flight(1)
    assert threads_ended(plane) and took < 5
    assert len(agent_module._KEPT_UNTIL_EXIT) - kept == 2  # both lanes' agents kept


async def test_killed_peer_mid_split_write_settles_once_with_an_error(peer: Any) -> None:
    proc, md, base = peer
    plane, _agents, settled, _src = await make(md, base)
    try:
        await stop_mid_write(plane, proc, 8)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(5)
        await until(lambda: len(settled) == 1, "the write settled")
        await asyncio.sleep(0.05)
        assert len(settled) == 1 and settled[0][1] is not None, settled
        plane.post(2, "decode-peer", split(4), 30.0)  # into the dead peer: settles with an error, once
        await until(lambda: len(settled) == 2, "the second write settled")
        assert settled[1][1] is not None
    finally:
        await asyncio.wait_for(plane.close(), 15)
    assert threads_ended(plane)
    assert all(lane._posted == {} and lane._cancelled == {} and lane._in_flight == [] for lane in plane.lanes)


@DIES
async def test_a_dead_lane_with_a_handle_in_flight_to_a_stopped_peer_keeps_its_real_agent(peer: Any) -> None:
    """Lane 0's thread dies while its part is in flight to a stopped peer: the write settles once, flagged in
    flight, and the close keeps both real agents (lane 1's part still runs too) until exit, releasing nothing
    under the handles, without hanging."""
    proc, md, base = peer
    plane, agents, settled, _src = await make(md, base)
    await stop_mid_write(plane, proc, 4)
    victim = plane.lanes[0]._agent  # (the lanes' agents are made in whichever order their threads run)
    victim.die = True
    await dead(plane.lanes[0])
    kept = len(agent_module._KEPT_UNTIL_EXIT)
    t0 = time.monotonic()
    await asyncio.wait_for(plane.close(), 15)
    assert time.monotonic() - t0 < 5 and threads_ended(plane)
    await asyncio.sleep(0.05)
    assert [p for p, _ in settled] == [1] and settled[0][1] is not None
    assert plane.take_in_flight(1)
    held = [k[0] for k in agent_module._KEPT_UNTIL_EXIT[kept:] if isinstance(k, tuple)]
    assert {id(a) for a in held} == {id(a) for a in agents}, held
    assert "deregister_memory" not in victim.released and "release_xfer_handle" not in victim.released


@DIES
async def test_a_dead_lane_with_nothing_in_flight_releases_its_real_agent_at_close(peer: Any) -> None:
    """A split write lands on the running peer, then lane 0's thread dies idle: the close releases its real
    agent's dlists, remote agent and registrations from the loop thread, keeps nothing, and a write through
    a fresh plane to the same peer still lands."""
    _proc, md, base = peer
    plane, agents, settled, _src = await make(md, base)
    plane.post(1, "decode-peer", split(4), 30.0)
    await until(lambda: settled == [(1, None)], "the write landed")
    victim = plane.lanes[0]._agent  # (the lanes' agents are made in whichever order their threads run)
    victim.die = True
    await dead(plane.lanes[0])
    kept = len(agent_module._KEPT_UNTIL_EXIT)
    await asyncio.wait_for(plane.close(), 15)
    assert threads_ended(plane) and len(agent_module._KEPT_UNTIL_EXIT) == kept
    for agent in agents:
        assert agent.released.count("release_dlist_handle") == 2, agent.released  # the peer's and our own
        assert agent.released.count("remove_remote_agent") == 1 and agent.released.count("deregister_memory") == 1
    lane = plane.lanes[0]
    assert lane._remote == {} and lane._retired == {} and lane._parked == [] and lane._reg_handles == []
    again, _agents, settled_again, _src2 = await make(md, base)
    try:
        again.post(2, "decode-peer", split(4), 30.0)
        await until(lambda: settled_again == [(2, None)], "a write through a fresh plane landed")
    finally:
        await asyncio.wait_for(again.close(), 15)
