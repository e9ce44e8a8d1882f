"""Attacks on the data plane's promises around relayed parts and cancel marks (each post settles
once; a cancelled post starts no further handle; a forgotten peer's posts copy nothing into a later
connection; nothing stays in the tables), scripted against fake agents: engine threads are held
inside a blocking call or a progress call, never ordered by sleeping. Written by a review of the
relay (commit 0aed06e); the tests of marks left behind, of the forgotten peer and of the busy
carrier failed on that commit."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from asynckv.errors import PeerUnreachable, RemoteProtocolError, TransferTimeout, TransportError
from asynckv.proto.topology import stub_agent_metadata
from asynckv.transport.base import Write
from asynckv.transport.lanes import LanedDataPlane

from .test_lane_relay import Held, HeldInProgress, split_write
from .test_lanes import ended, laned, transfers
from .test_nixl_plane import FakeAgent, prepped, rows, started, until

DIES = pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")


def killable(agent: FakeAgent) -> dict[str, bool]:
    """Set ``["now"]``: the engine thread dies at the end of its current (or next) round."""
    kill = {"now": False}
    real = agent.get_new_notifs

    def notifs() -> dict[str, list[bytes]]:
        if kill["now"]:
            raise SystemExit("engine bug")
        return dict(real())
    agent.get_new_notifs = notifs  # type: ignore[method-assign]
    return kill


def clean(plane: LanedDataPlane) -> None:
    """Promise 4 (``_in_flight`` left out: nothing here leaves a handle in flight)."""
    assert plane._owner == {} and plane._split == {} and plane._parts == {}
    assert plane._load == [0] * len(plane.lanes) and plane._big == [0] * len(plane.lanes) and plane._bigs == set()
    assert [lane._cancelled for lane in plane.lanes] == [{}] * len(plane.lanes)
    assert [lane._in_flight for lane in plane.lanes] == [[]] * len(plane.lanes)


async def dead_pair() -> tuple[LanedDataPlane, list[Any]]:
    """Two lanes with relay on, both engine threads already dead."""
    a, b = FakeAgent(), FakeAgent()
    kills = [killable(a), killable(b)]
    plane, settled = await laned([a, b], relay=True)
    for i, k in enumerate(kills):
        k["now"] = True
        await ended(plane.lanes[i])
    return plane, settled


async def copying_pair() -> tuple[FakeAgent, FakeAgent, LanedDataPlane, list[Any]]:
    """Two lanes with relay on, whose copies complete inside transfer()."""
    a, b = FakeAgent(), FakeAgent()
    a.finish = b.finish = True
    plane, settled = await laned([a, b], relay=True)
    return a, b, plane, settled


async def closed_clean(plane: LanedDataPlane) -> None:
    await plane.close()
    clean(plane)


async def once(settled: list[Any], ids: list[int]) -> None:
    await until(lambda: sorted(p for p, _ in settled) == sorted(ids))
    await asyncio.sleep(0.02)  # (a second settle would show up here)
    assert sorted(p for p, _ in settled) == sorted(ids)


# -- what the review found (each fixed since) ------------------------------------------------------


async def test_a_single_planes_cancel_of_a_settled_or_unknown_post_leaves_no_mark() -> None:
    """write_lanes=1: the manager uses NixlDataPlane itself (manager.py:396), whose cancel() marks
    any id. The engine used to drop marks of posts it did not hold; now nothing does."""
    agent = FakeAgent()
    agent.finish = True
    plane, settled = await started(agent)
    plane.post(1, "peer", prepped(), 30.0)
    await until(lambda: settled == [(1, None)])
    plane.cancel([1, 99], RemoteProtocolError("late"))  # a settled post, an id never posted
    await plane.call(lambda a: None)  # the engine has taken the Cancel
    await plane.close()
    assert plane._cancelled == {}  # (on 0aed06e: {1: ..., 99: ...})


async def test_a_cancel_from_on_settled_of_a_post_settled_in_the_same_batch_leaves_no_mark() -> None:
    """The realistic path: the core fails a room on its first settle and cancels the room's other
    posts, one of which settled in the same batch: its mark used to stay (marks were dropped before
    on_settled ran; now a settled post takes none)."""
    agent = FakeAgent()
    plane, settled = await started(agent)
    reason = RemoteProtocolError("room failed")

    def on_settled(batch: list[tuple[int, BaseException | None]]) -> None:
        for post_id, _ in batch:
            settled.append((post_id, None))
            if post_id == 1:
                plane.cancel([2], reason)  # the core still counts 2 as in flight
    plane.on_settled = on_settled
    plane.post(1, "peer", prepped(), 30.0)
    plane.post(2, "peer", prepped(), 30.0)
    await until(lambda: plane.posts_in_flight == 2)
    agent.finish = True  # both finish in one round: one batch
    await until(lambda: len(settled) == 2)
    await plane.call(lambda a: None)
    await plane.close()
    assert plane._cancelled == {}


@DIES
async def test_a_cancelled_relayed_part_settling_with_a_dead_lanes_orphans_leaves_no_mark() -> None:
    """The part settles through the dead lane's orphans (``_settle_soon``), past ``_on_loop``: the
    mark used to stay there."""
    a, b = FakeAgent(), FakeAgent()
    a.finish = b.finish = True
    kill = killable(b)
    plane, settled = await laned([a, b], relay=True)
    hold = await HeldInProgress(a).held()
    plane.post(1, "peer", split_write(), 30.0)  # lane 0 carries lane 1's part
    kill["now"] = True
    await ended(plane.lanes[1])
    plane.cancel([1], RemoteProtocolError("aborted"))  # lane 1 still owns its part: the mark goes there
    await hold.let_go()  # hands the part on to the dead lane: it settles with its orphans
    await once(settled, [1])
    await plane.close()
    assert transfers(a) == transfers(b) == 0
    clean(plane)


@DIES
async def test_a_cancelled_post_settling_as_an_orphan_leaves_no_mark() -> None:
    """Same hole without relay: a cancelled post in flight, its lane dies before it settles."""
    a, b = FakeAgent(), FakeAgent()
    kill = killable(a)
    plane, settled = await laned([a, b], relay=False)
    plane.post(1, "peer", prepped(), 30.0)  # small: lane 0
    await until(lambda: transfers(a) == 1)
    hold = await Held(plane.lanes[0]).held()
    plane.cancel([1], RemoteProtocolError("aborted"))
    kill["now"] = True
    await hold.let_go()
    await once(settled, [1])
    a.finish = True
    await ended(plane.lanes[0])
    await plane.close()
    clean(plane)  # (a mark stayed: {1: reason})


async def test_a_relayed_part_of_a_forgotten_peer_never_copies_into_its_next_connection() -> None:
    """The part reaches its lane after that lane forgot the peer, connected it anew and got a fresh
    lease. It copied into the new connection (found by review); forget_peer now marks the peer's
    unsettled posts on each lane, so the part is refused when it arrives. Without relay the part was
    queued on lane 1 ahead of the Forget. (The prefill core reconnects a name only once the old
    session's posts settled, ``prefill_peers._peer_progress``: this holds the data plane's own
    promise.) Lane 0 is held in its progress call, lane 1 in a call (a long copy, say)."""
    a, b, plane, settled = await copying_pair()
    hold0 = await HeldInProgress(a).held()
    plane.post(1, "peer", split_write(), 30.0)  # Relay(lane 1's part) + own part wait in lane 0
    plane.forget_peer("peer")
    connecting = asyncio.ensure_future(plane.connect_peer("peer", stub_agent_metadata("peer"), rows(4), "DRAM"))
    await until(lambda: sum(c[0] == "add_remote_agent" for c in b.calls) == 2)  # lane 1 reconnected
    hold1 = await Held(plane.lanes[1]).held()
    await hold0.let_go()  # lane 0: hands the part on (behind hold1), copies its own, forgets, reconnects
    await connecting
    plane.set_lease("peer", time.monotonic() + 60)  # the new session's lease
    await hold1.let_go()
    await once(settled, [1])
    copied_after_reconnect = transfers(b)
    names = [c[0] for c in b.calls]
    await plane.close()
    assert isinstance(settled[0][1], PeerUnreachable)  # (each part refused: forgotten)
    assert copied_after_reconnect == 0, names[names.index("add_remote_agent", names.index("add_remote_agent") + 1):]


# -- attacks that held --------------------------------------------------------------------------


async def test_cancel_after_hand_on_before_the_target_starts_it() -> None:
    a, b, plane, settled = await copying_pair()
    hold1 = await Held(plane.lanes[1]).held()
    plane.post(1, "peer", split_write(), 30.0)
    await until(lambda: transfers(a) == 1)  # lane 0 handed on, then copied its own part
    reason = RemoteProtocolError("aborted")
    plane.cancel([1], reason)
    await hold1.let_go()
    await once(settled, [1])
    assert settled == [(1, reason)] and transfers(b) == 0
    await closed_clean(plane)


async def test_cancel_while_the_relayed_part_is_in_flight_lands_at_most_that_handle() -> None:
    a, b = FakeAgent(), FakeAgent()
    plane, settled = await laned([a, b], relay=True)
    plane.post(1, "peer", split_write(4), 30.0)  # two handles per part
    await until(lambda: transfers(a) == 1 and transfers(b) == 1)
    reason = RemoteProtocolError("aborted")
    plane.cancel([1], reason)
    a.finish = b.finish = True
    await once(settled, [1])
    assert settled == [(1, reason)] and transfers(a) == transfers(b) == 1
    await closed_clean(plane)


async def test_cancel_of_settled_and_never_posted_ids_on_the_laned_plane_leaves_no_mark() -> None:
    _a, _b, plane, settled = await copying_pair()
    plane.post(1, "peer", split_write(), 30.0)
    plane.post(2, "peer", prepped(), 30.0)
    await once(settled, [1, 2])
    plane.cancel([1, 2, 3, 1 << 62], RemoteProtocolError("late"))  # (1 << 62: the first part id)
    for lane in plane.lanes:
        await lane.call(lambda agent: None)
    await closed_clean(plane)


async def test_close_while_the_carrier_holds_the_relay_and_the_target_has_closed() -> None:
    a, b, plane, settled = await copying_pair()
    hold = await HeldInProgress(a).held()
    plane.post(1, "peer", split_write(), 30.0)
    closing = asyncio.ensure_future(plane.close())
    await ended(plane.lanes[1])  # lane 1 closed: its thread ended
    await hold.let_go()  # lane 0 hands the part on to the ended lane
    await asyncio.wait_for(closing, 5)
    assert len(settled) == 1 and settled[0][0] == 1 and settled[0][1] is not None and transfers(b) == 0
    await asyncio.sleep(0.02)
    assert len(settled) == 1
    clean(plane)


@pytest.mark.parametrize("order", ["forget_first", "hand_on_first"])
async def test_forget_peer_against_the_relay_in_both_orders(order: str) -> None:
    a, b, plane, settled = await copying_pair()
    hold0 = await HeldInProgress(a).held()
    hold1 = await Held(plane.lanes[1]).held()
    plane.post(1, "peer", split_write(), 30.0)
    if order == "forget_first":
        plane.forget_peer("peer")
        await hold1.let_go()  # lane 1 forgets before the part comes
        await plane.lanes[1].call(lambda agent: None)
        await hold0.let_go()
    else:
        await hold0.let_go()
        await until(lambda: transfers(a) == 1)  # the part waits in lane 1's queue
        plane.forget_peer("peer")
        await hold1.let_go()
    await once(settled, [1])
    assert isinstance(settled[0][1], (PeerUnreachable, TransferTimeout)) and transfers(b) == 0
    await closed_clean(plane)


async def test_lease_lapsing_while_the_carrier_holds_the_relay() -> None:
    a, b, plane, settled = await copying_pair()
    hold0 = await HeldInProgress(a).held()
    plane.post(1, "peer", split_write(), 30.0)
    plane.set_lease("peer", time.monotonic() - 1)
    await hold0.let_go()
    await once(settled, [1])
    assert isinstance(settled[0][1], TransferTimeout) and transfers(a) == transfers(b) == 0
    await closed_clean(plane)


@DIES
async def test_three_lanes_carrier_dies_holding_two_relays_and_a_cancel() -> None:
    agents = [FakeAgent() for _ in range(3)]
    for agent in agents:
        agent.finish = True
    kill = killable(agents[0])
    plane, settled = await laned(agents, relay=True)
    hold = await HeldInProgress(agents[0]).held()
    plane.post(1, "peer", split_write(3), 30.0)  # 3 parts: lane 0 carries 1's and 2's
    plane.post(2, "peer", split_write(3), 30.0)  # every lane busy: straight to each
    plane.cancel([2], RemoteProtocolError("aborted"))
    kill["now"] = True
    await hold.let_go()
    await once(settled, [1, 2])
    out = dict(settled)
    # (clean() failed: lane 0's own part of post 2, cancelled, settled as an orphan and kept its mark)
    assert "engine thread" in str(out[1]) and isinstance(out[2], RemoteProtocolError)
    assert transfers(agents[1]) == transfers(agents[2]) == 1  # each got post 1's part from the orphans
    await ended(plane.lanes[0])
    await closed_clean(plane)


@DIES
async def test_an_orphan_with_a_cancel_mark_settles_with_the_cancel_reason() -> None:
    """A post cancelled before its engine thread died settles with the cancel's reason, as it would
    have had the thread lived; an unmarked orphan with the death. (The orphans used to settle all with
    the death, so a split write whose other parts the cancel settled took whichever error came first:
    the test above failed about one run in a few hundred.)"""
    agent = FakeAgent()
    kill = killable(agent)
    plane, settled = await started(agent)
    hold = await HeldInProgress(agent).held()
    reason = RemoteProtocolError("aborted")
    plane.post(1, "peer", prepped(), 30.0)
    plane.cancel([1], reason)
    plane.post(2, "peer", prepped(), 30.0)
    kill["now"] = True
    await hold.let_go()  # it dies in this progress call, posts and cancel still queued
    await once(settled, [1, 2])
    out = dict(settled)
    assert out[1] is reason and isinstance(out[2], TransportError) and "engine thread died" in str(out[2])
    assert transfers(agent) == 0 and plane._cancelled == {} and plane._posted == {}
    await plane.close()


async def test_three_lanes_one_dead_at_post_time_relays_among_the_live() -> None:
    agents = [FakeAgent() for _ in range(3)]
    for agent in agents:
        agent.finish = True
    plane, settled = await laned(agents, relay=True)
    await plane.lanes[0].close()  # lane 0 gone (closed: not alive)
    plane.post(1, "peer", split_write(2), 30.0)
    plane.post(2, "peer", split_write(3), 30.0)
    await once(settled, [1, 2])
    assert all(err is None for _, err in settled) and transfers(agents[0]) == 0
    await closed_clean(plane)


@DIES
async def test_every_lane_dead_with_relay_on() -> None:
    plane, settled = await dead_pair()
    plane.post(1, "peer", split_write(), 30.0)
    plane.post(2, "peer", prepped(), 30.0)
    await once(settled, [1, 2])
    assert all(err is not None for _, err in settled)
    await closed_clean(plane)


@pytest.mark.parametrize("cancel", [False, True])
async def test_a_relayed_part_merges_with_small_posts_on_its_lane(cancel: bool) -> None:
    a, b = FakeAgent(), FakeAgent()
    plane, settled = await laned([a, b], relay=True)
    plane.lanes[1].merge_limits = (64 << 20, 1 << 20)
    hold0 = await HeldInProgress(a).held()
    hold1 = await Held(plane.lanes[1]).held()
    plane.post(1, "peer", split_write(), 30.0)  # each part: one piece of 512 KiB (mergeable)
    for post_id in range(2, 8):  # every lane holds a large part: they alternate, 3 on lane 1
        plane.post(post_id, "peer", prepped(), 30.0)
    assert plane._load == [4, 4]
    await hold0.let_go()  # lane 1's queue: 3 small posts, then the relayed part
    await until(lambda: transfers(a) >= 1)
    await hold1.let_go()
    await until(lambda: plane.lanes[1].merged == 4)  # the relayed part rode with the 3 small posts
    assert transfers(b) == 1
    reason = RemoteProtocolError("aborted")
    if cancel:
        plane.cancel([1], reason)
    a.finish = b.finish = True
    await once(settled, list(range(1, 8)))
    out = dict(settled)
    assert out[1] is (reason if cancel else None) and all(out[i] is None for i in range(2, 8))
    await closed_clean(plane)


async def test_several_split_writes_in_a_row_with_relay() -> None:
    a, b = FakeAgent(), FakeAgent()
    plane, settled = await laned([a, b], relay=True)
    for post_id in range(1, 7):
        plane.post(post_id, "peer", split_write(3 + post_id % 2), 30.0)
    plane.cancel([3, 4], RemoteProtocolError("aborted"))
    a.finish = b.finish = True
    await once(settled, list(range(1, 7)))
    out = dict(settled)
    assert all(out[i] is None for i in (1, 2, 5, 6)) and out[3] is not None and out[4] is not None
    await closed_clean(plane)


@DIES
async def test_target_dies_with_the_relayed_part_in_its_queue() -> None:
    a, b = FakeAgent(), FakeAgent()
    a.finish = b.finish = True
    kill = killable(b)
    plane, settled = await laned([a, b], relay=True)
    hold1 = await Held(plane.lanes[1]).held()
    plane.post(1, "peer", split_write(), 30.0)
    await until(lambda: transfers(a) == 1)  # handed on: it waits behind hold1
    kill["now"] = True
    await hold1.let_go()
    await once(settled, [1])
    assert "engine thread" in str(settled[0][1]) and transfers(b) == 0
    await ended(plane.lanes[1])
    await closed_clean(plane)


async def test_a_post_to_a_closed_laned_plane_settles() -> None:
    a, b = FakeAgent(), FakeAgent()
    plane, settled = await laned([a, b], relay=True)
    await plane.close()
    plane.post(1, "peer", split_write(), 30.0)
    plane.post(2, "peer", Write(prepped().pieces, 2, 64), 30.0)
    await once(settled, [1, 2])
    clean(plane)


@DIES
async def test_a_post_and_its_cancel_in_one_tick_on_dead_lanes_leave_no_marks() -> None:
    """post() on a dead (or closed) lane settles with call_soon, past ``_on_loop``: a cancel before it
    ran used to leave the mark (with relay: relay_post's fallback for a target that died after the
    alive list)."""
    plane, settled = await dead_pair()
    plane.post(1, "peer", split_write(), 30.0)
    plane.cancel([1], RemoteProtocolError("aborted"))
    await once(settled, [1])
    await closed_clean(plane)


async def test_a_lane_busy_with_a_call_carries_no_part_and_the_other_lane_copies_at_once() -> None:
    """A lane with no posts may be inside a long call (the connect of another decode: add_remote_agent,
    prep_xfer_dlist, 20 ms and more); relayed through it, the other part waited for that call (found
    by review). A lane with a call pending carries nothing."""
    _a, b, plane, settled = await copying_pair()
    hold0 = await Held(plane.lanes[0]).held()  # (a connect of another peer, say)
    assert plane.lanes[0].calls_pending == 1 and plane.lanes[1].calls_pending == 0
    plane.post(1, "peer", split_write(), 30.0)
    await until(lambda: transfers(b) == 1)  # lane 1 copied its part while lane 0 was busy
    await hold0.let_go()
    await once(settled, [1])
    assert plane.lanes[0].calls_pending == 0
    await closed_clean(plane)
