"""Attacks on the data plane's promises around closing, dead lanes and connecting (nothing is left behind
by a close, whatever raced it or died before it; a close waits for one under way; a post made before its
peer's connection copies nothing into it; each post settles once), scripted against fake agents: engine
threads are held inside a call, a progress call or their last command, never ordered by sleeping. Written
by a review of the lanes' data plane; the tests of a connect racing close, of a dead lane's close, of a
second close, of leases left and of a post made before its peer's connection failed before their fixes."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import numpy as np
import pytest

from asynckv.errors import ClosedError, PeerUnreachable, RemoteProtocolError
from asynckv.proto.topology import metadata_agent_name, stub_agent_metadata
from asynckv.transport import agent as agent_module
from asynckv.transport.base import PreppedPiece, Write
from asynckv.transport.lanes import SMALL_POST_BYTES
from asynckv.transport.nixl import NixlDataPlane

from .test_lane_relay import Held, HeldInProgress, split_write
from .test_lanes import ended, laned, transfers
from .test_nixl_plane import FakeAgent, prepped, rows, started, until
from .test_relay_attacks import clean, killable, once

DIES = pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")


def all_released(agent: FakeAgent) -> None:
    """Every handle, dlist and registration released, every remote agent added removed."""
    assert agent.live == agent.released, sorted(agent.live - agent.released)
    added = {a for c, a in agent.calls if c == "add_remote_agent"}  # (NIXL keeps one remote agent per name)
    removed = {a for c, a in agent.calls if c == "remove_remote_agent"}
    assert {metadata_agent_name(m).decode() for m in added} == removed, (added, removed)  # type: ignore[union-attr]


# -- nothing left behind by a close, whatever raced it or died before it ---------------------------


async def queued(plane: NixlDataPlane) -> None:
    """Until a command waits in the (held) engine's queue."""
    await until(lambda: not plane._commands.empty())


async def test_a_connect_racing_close_is_refused_and_leaves_nothing_behind() -> None:
    """close() queues its shutdown; a connect_peer made before the shutdown returned was queued behind
    it, ran after it, and its remote agent and dlist outlived the close. It is refused now."""
    agent = FakeAgent()
    plane, _settled = await started(agent)
    hold = await Held(plane).held()  # (the engine takes nothing more until let go)
    closing = asyncio.ensure_future(plane.close())
    await queued(plane)  # the shutdown
    connecting = asyncio.ensure_future(plane.connect_peer("other", stub_agent_metadata("other"), rows(4), "DRAM"))
    await hold.let_go()
    await asyncio.wait_for(closing, 5)
    outcome = await asyncio.gather(connecting, return_exceptions=True)
    assert not plane._thread.is_alive()  # type: ignore[union-attr]
    assert isinstance(outcome[0], ClosedError), outcome
    all_released(agent)


async def test_a_laned_connect_racing_close_is_refused_and_leaves_nothing_behind() -> None:
    a, b = FakeAgent(), FakeAgent()
    plane, _settled = await laned([a, b], relay=True)
    holds = [await Held(lane).held() for lane in plane.lanes]
    closing = asyncio.ensure_future(plane.close())
    for lane in plane.lanes:
        await queued(lane)
    connecting = asyncio.ensure_future(plane.connect_peer("other", stub_agent_metadata("other"), rows(4), "DRAM"))
    for hold in holds:
        await hold.let_go()
    await asyncio.wait_for(closing, 5)
    outcome = await asyncio.gather(connecting, return_exceptions=True)
    assert isinstance(outcome[0], ClosedError), outcome
    all_released(a)
    all_released(b)


async def test_a_post_made_while_the_plane_closes_settles_closed() -> None:
    agent = FakeAgent()
    agent.finish = True
    plane, settled = await started(agent)
    hold = await Held(plane).held()
    closing = asyncio.ensure_future(plane.close())
    await queued(plane)
    plane.post(1, "peer", prepped(), 30.0)
    await hold.let_go()
    await asyncio.wait_for(closing, 5)
    await once(settled, [1])
    assert isinstance(settled[0][1], ClosedError) and transfers(agent) == 0
    all_released(agent)


async def test_leases_are_dropped_at_close() -> None:
    a, b = FakeAgent(), FakeAgent()
    a.finish = b.finish = True
    plane, settled = await laned([a, b], relay=True)
    plane.post(1, "peer", split_write(), 30.0)
    await once(settled, [1])
    await plane.close()
    clean(plane)
    assert [lane._leases for lane in plane.lanes] == [{}, {}]


@DIES
async def test_a_dead_lanes_agent_with_a_handle_in_flight_is_kept_until_exit() -> None:
    """A lane's thread dies with a handle in flight (UCX over TCP); its post settles, flagged in flight.
    close() of that plane released nothing and did not keep the agent: the agent, its registrations and
    the running handle were left to the garbage collector (the tear-down under a running transfer that
    decision 8 keeps agents for). It is kept until exit now, as a live close keeps it."""
    agent = FakeAgent()
    kill = killable(agent)
    plane, settled = await started(agent)
    plane.post(1, "peer", prepped(), 30.0)
    await until(lambda: plane.posts_in_flight == 1)
    kill["now"] = True
    await until(lambda: len(settled) == 1)
    assert plane.take_in_flight(1)
    await ended(plane)
    kept = len(agent_module._KEPT_UNTIL_EXIT)
    await plane.close()
    assert any(k[0] is agent for k in agent_module._KEPT_UNTIL_EXIT[kept:] if isinstance(k, tuple))
    assert not any(c[0] in ("deregister_memory", "release_xfer_handle") for c in agent.calls)
    assert plane._leases == {}


@DIES
async def test_a_dead_lane_with_nothing_in_flight_releases_everything_at_close() -> None:
    agent = FakeAgent()
    agent.finish = True
    kill = killable(agent)
    plane, settled = await started(agent)
    plane.post(1, "peer", prepped(), 30.0)
    await once(settled, [1])
    kill["now"] = True
    await ended(plane)
    kept = len(agent_module._KEPT_UNTIL_EXIT)
    await plane.close()
    assert len(agent_module._KEPT_UNTIL_EXIT) == kept
    all_released(agent)
    assert plane._leases == {} and plane._remote == {} and plane._retired == {}


class HeldAtTheEnd:
    """A lane's command queue whose engine thread, as it takes close's None (its last command), waits there
    until released: the thread is alive, its close not done."""

    def __init__(self, lane: NixlDataPlane) -> None:
        self.inner, self.held, self.release = lane._commands, threading.Event(), threading.Event()
        lane._commands = self  # type: ignore[assignment]

    def put(self, cmd: Any) -> None:
        self.inner.put(cmd)

    def empty(self) -> bool:
        return self.inner.empty()

    def get_nowait(self) -> Any:
        return self._took(self.inner.get_nowait())

    def get(self, timeout: float | None = None) -> Any:
        return self._took(self.inner.get(timeout=timeout))

    def _took(self, cmd: Any) -> Any:
        if cmd is None:
            self.held.set()
            if not self.release.wait(5):
                raise AssertionError("never released")
        return cmd


async def test_a_second_close_waits_for_the_first() -> None:
    """A close() that came while another close() of the plane joined its threads returned at once: its
    caller saw engine threads alive (and, had a post been taken in the last round, settles not yet
    flushed)."""
    a, b = FakeAgent(), FakeAgent()
    plane, _settled = await laned([a, b], relay=True)
    lane0 = plane.lanes[0]
    hold = HeldAtTheEnd(lane0)
    first = asyncio.ensure_future(plane.close())
    await until(hold.held.is_set)
    second = asyncio.ensure_future(plane.close())
    await asyncio.sleep(0.05)
    returned = second.done()
    hold.release.set()
    await asyncio.wait_for(asyncio.gather(first, second), 5)
    assert not returned, "second close() returned while lane 0's engine thread still runs"
    assert not lane0._thread.is_alive()  # type: ignore[union-attr]
    all_released(a)
    all_released(b)


# -- a relayed part against later commands ---------------------------------------------------------


async def test_a_relayed_part_of_a_post_made_before_its_peers_connection_copies_nothing_into_it() -> None:
    """post(1) to a peer not connected, then connect_peer: without relay both parts are queued before
    the connect on their lanes and are refused. With relay lane 1's part came after lane 1's connect and
    copied into it; the connect now marks the posts made before it, as forgetting a peer does."""
    a, b, = FakeAgent(), FakeAgent()
    a.finish = b.finish = True
    plane, settled = await laned([a, b], relay=True)
    hold0 = await HeldInProgress(a).held()
    plane.post(1, "other", split_write(), 30.0)  # "other" is not connected
    connecting = asyncio.ensure_future(plane.connect_peer("other", stub_agent_metadata("other"), rows(4), "DRAM"))
    await until(lambda: ("add_remote_agent", stub_agent_metadata("other")) in b.calls)
    plane.set_lease("other", time.monotonic() + 60)
    await hold0.let_go()
    await connecting
    await once(settled, [1])
    out = settled[0][1]
    landed_b = transfers(b)
    await plane.close()
    assert isinstance(out, PeerUnreachable)
    assert landed_b == 0, "a part of a write refused as 'not connected' copied into the later connection"
    clean(plane)


# -- each post settles once ------------------------------------------------------------------------


@pytest.mark.parametrize("relay", [False, True])
async def test_zero_and_one_piece_writes_settle_once(relay: bool) -> None:
    a, b = FakeAgent(), FakeAgent()
    a.finish = b.finish = True
    plane, settled = await laned([a, b], relay=relay)
    plane.post(1, "peer", Write((), 0, 0), 30.0)
    plane.post(2, "peer", Write((), 0, SMALL_POST_BYTES * 4), 30.0)  # large, no pieces
    plane.post(3, "peer", Write(prepped(1).pieces, 1, SMALL_POST_BYTES * 4), 30.0)  # one big piece
    plane.post(4, "peer", Write(prepped(1).pieces * 2, 0, SMALL_POST_BYTES * 4), 30.0)  # 0 descriptors stated
    empty = PreppedPiece(np.array([], dtype=np.int32), np.array([], dtype=np.int32))
    plane.post(5, "peer", Write((empty, empty, empty), 0, SMALL_POST_BYTES), 30.0)  # empty pieces, split
    await once(settled, [1, 2, 3, 4, 5])
    await plane.close()
    clean(plane)


@pytest.mark.parametrize("relay", [False, True])
async def test_more_handles_than_lanes_with_cancel_mid_way(relay: bool) -> None:
    agents = [FakeAgent() for _ in range(3)]
    plane, settled = await laned(agents, relay=relay)
    plane.post(1, "peer", split_write(7), 30.0)  # 7 handles over 3 lanes: 3, 2, 2
    await until(lambda: all(transfers(x) == 1 for x in agents))
    for x in agents:
        x.done.update(h for c, h in x.calls if c == "make_prepped_xfer")
    await until(lambda: all(transfers(x) == 2 for x in agents))
    reason = RemoteProtocolError("aborted")
    plane.cancel([1], reason)
    for x in agents:
        x.finish = True
    await once(settled, [1])
    assert settled == [(1, reason)] and [transfers(x) for x in agents] == [2, 2, 2]
    await plane.close()
    clean(plane)


async def test_a_post_id_not_settled_yet_is_refused_when_posted_again() -> None:
    """Out of the cores' contract (ids come from a counter): the second post took a lane's load that its
    settle never gave back. It is refused, and the first settles as it would have."""
    a, b = FakeAgent(), FakeAgent()
    plane, settled = await laned([a, b], relay=True)
    big = Write(prepped().pieces, 2, SMALL_POST_BYTES)
    plane.post(1, "peer", big, 30.0)
    plane.post(2, "peer", split_write(), 30.0)
    for post_id, write in ((1, big), (2, split_write())):
        with pytest.raises(ValueError, match="not settled yet"):
            plane.post(post_id, "peer", write, 30.0)
    a.finish = b.finish = True
    await once(settled, [1, 2])
    plane.post(1, "peer", big, 30.0)  # (settled: its id may be used again)
    await once(settled, [1, 1, 2])
    await plane.close()
    clean(plane)


# -- more interleavings (each held before the review) ----------------------------------------------


class DyingSteer:
    """A lane's steer whose ``back`` (the first thing of every engine round) raises once armed."""

    def __init__(self) -> None:
        self.armed = False
        self.enabled = False

    def away(self, tid: int | None) -> None:
        pass

    def back(self) -> None:
        if self.armed:
            raise SystemExit("engine bug at the start of a round")


@DIES
async def test_carrier_dies_at_the_start_of_the_round_its_relay_woke() -> None:
    """The Relay is the command that ended the carrier's idle wait (``_woken``); the thread dies before
    that round takes it. The part still reaches lane 1, the carrier's own part settles with the death."""
    a, b = FakeAgent(), FakeAgent()
    a.finish = b.finish = True
    plane, settled = await laned([a, b], relay=True)
    steer = DyingSteer()
    plane.lanes[0].steer = steer  # type: ignore[assignment]
    await asyncio.sleep(0.05)  # lane 0 deep in an idle wait
    steer.armed = True
    plane.post(1, "peer", split_write(), 30.0)
    await once(settled, [1])
    assert "engine thread" in str(settled[0][1]) and transfers(a) == 0 and transfers(b) == 1
    await ended(plane.lanes[0])
    await plane.close()
    clean(plane)
    all_released(b)


@pytest.mark.parametrize("relay", [False, True])
async def test_posts_made_while_the_laned_plane_closes_settle_once(relay: bool) -> None:
    a, b = FakeAgent(), FakeAgent()
    a.finish = b.finish = True
    plane, settled = await laned([a, b], relay=relay)
    closing = asyncio.ensure_future(plane.close())
    ids = []
    for i in range(1, 30):
        plane.post(i, "peer", split_write(2 + i % 3) if i % 2 else prepped(), 30.0)
        ids.append(i)
        if i % 5 == 0:
            plane.cancel([i - 1], RemoteProtocolError("x"))
        await asyncio.sleep(0)
    await asyncio.wait_for(closing, 5)
    await once(settled, ids)
    clean(plane)
    assert all(lane._posted == {} for lane in plane.lanes)
    all_released(a)
    all_released(b)


async def test_cancel_before_relay_taken_releases_everything() -> None:
    a, b = FakeAgent(), FakeAgent()
    a.finish = b.finish = True
    plane, settled = await laned([a, b], relay=True)
    hold = await HeldInProgress(a).held()
    plane.post(1, "peer", split_write(4), 30.0)
    plane.cancel([1], RemoteProtocolError("aborted"))
    await hold.let_go()
    await once(settled, [1])
    await plane.close()
    clean(plane)
    all_released(a)
    all_released(b)


async def test_forget_and_reconnect_with_parts_in_flight_releases_everything() -> None:
    """Both parts' handles in flight; forget_peer; reconnect the same name before they finish; then they
    finish: the old dlists go, the agent name stays (connected again), and close releases the rest."""
    a, b = FakeAgent(), FakeAgent()
    plane, settled = await laned([a, b], relay=True)
    plane.post(1, "peer", split_write(4), 30.0)
    await until(lambda: transfers(a) == 1 and transfers(b) == 1)
    plane.forget_peer("peer")
    await plane.connect_peer("peer", stub_agent_metadata("peer"), rows(4), "DRAM")
    plane.set_lease("peer", time.monotonic() + 60)
    a.finish = b.finish = True
    await once(settled, [1])
    assert isinstance(settled[0][1], PeerUnreachable) and transfers(a) == transfers(b) == 1
    plane.post(2, "peer", split_write(4), 30.0)
    await once(settled, [1, 2])
    assert settled[1] == (2, None)
    await plane.close()
    clean(plane)
    all_released(a)
    all_released(b)


@DIES
async def test_target_dies_while_its_part_is_in_flight_and_the_carrier_part_is_cancelled() -> None:
    a, b = FakeAgent(), FakeAgent()
    kill = killable(b)
    plane, settled = await laned([a, b], relay=True)
    plane.post(1, "peer", split_write(4), 30.0)
    await until(lambda: transfers(a) == 1 and transfers(b) == 1)
    reason = RemoteProtocolError("aborted")
    plane.cancel([1], reason)
    kill["now"] = True
    await ended(plane.lanes[1])
    await asyncio.sleep(0.02)
    assert settled == []  # lane 0's handle still in flight
    a.finish = True
    await once(settled, [1])
    assert settled[0][1] is reason and plane.take_in_flight(1)  # lane 1's handle was left in flight
    await plane.close()
    clean(plane)
