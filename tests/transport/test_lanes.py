"""A prefill's write lanes (``transport.lanes``): several NIXL engines behind one data plane, each
its own agent on its own thread, against recording fake agents (no NIXL needed)."""

from __future__ import annotations

import asyncio
import time

import pytest

from asynckv.errors import RemoteProtocolError, TransportError
from asynckv.proto.topology import stub_agent_metadata
from asynckv.transport.base import MemoryLayout, Write
from asynckv.transport.lanes import SMALL_POST_BYTES, SMALL_POST_DESCRIPTORS, LanedDataPlane
from asynckv.transport.nixl import NixlDataPlane

from .test_nixl_plane import FakeAgent, prepped, rows, until


async def laned(agents: list[FakeAgent], relay: bool | None = None) -> tuple[
        LanedDataPlane, list[tuple[int, BaseException | None]]]:
    made = iter(agents)
    plane = LanedDataPlane.make("me", len(agents), lambda name: NixlDataPlane(
        name, agent_factory=lambda n, b: next(made)), relay)
    settled: list[tuple[int, BaseException | None]] = []
    plane.on_settled = settled.extend
    await plane.start(MemoryLayout((("DRAM", rows(2)),), rows(4), "DRAM", (0x9000, 64)))
    await plane.connect_peer("peer", stub_agent_metadata("peer"), rows(4), "DRAM")
    plane.set_lease("peer", time.monotonic() + 60)
    return plane, settled


def transfers(agent: FakeAgent) -> int:
    return sum(1 for call, _ in agent.calls if call == "make_prepped_xfer")


async def test_lanes_are_named_after_the_manager_and_each_registers_and_connects() -> None:
    a, b = FakeAgent(), FakeAgent()
    plane, _ = await laned([a, b])
    assert [lane.name for lane in plane.lanes] == ["me", "me.1"] and plane.name == "me"
    for agent in (a, b):
        kinds = [call for call, _ in agent.calls]
        assert kinds.count("register_memory") == 1 and kinds.count("prep_xfer_dlist peer") == 1
        assert ("add_remote_agent", stub_agent_metadata("peer")) in agent.calls
    await plane.close()


def big(n: int = 2) -> Write:
    """A one-handle write of ``SMALL_POST_BYTES`` (as the plane counts bytes: the fake copies nothing)."""
    return Write(prepped(n).pieces, n, SMALL_POST_BYTES)


async def test_posts_go_to_the_lane_with_fewest_in_flight_and_settle_through_one_callback() -> None:
    a, b = FakeAgent(), FakeAgent()  # handles stay PROC: every post stays in flight
    plane, settled = await laned([a, b])
    for post_id in (1, 2, 3):
        plane.post(post_id, "peer", big(), 30.0)
    await until(lambda: transfers(a) + transfers(b) == 3)
    assert (transfers(a), transfers(b)) == (2, 1)  # 1 -> lane 0, 2 -> lane 1, 3 -> lane 0 (a tie: in turn)
    b.finish = True
    await until(lambda: settled == [(2, None)])
    plane.post(4, "peer", big(), 30.0)  # lane 1 now has none in flight, lane 0 has two
    await until(lambda: transfers(b) == 2)
    a.finish = True
    await until(lambda: sorted(p for p, _ in settled) == [1, 2, 3, 4])
    assert all(err is None for _, err in settled) and plane.posts_in_flight == 0
    assert plane._big == [0, 0] and plane._bigs == set()
    await plane.close()


async def test_small_posts_go_whole_to_the_first_lane_with_no_large_post_in_flight() -> None:
    """Small posts (a 1-page room) stay on lane 0, whatever its queue, so lane 1's thread sleeps; one
    queued behind a large post would wait for its copy, so it goes to a lane without one; when
    every lane has one, the least loaded takes it. A small write of several handles is not split."""
    a, b = FakeAgent(), FakeAgent()  # handles stay PROC until finish
    plane, settled = await laned([a, b])
    for post_id in (1, 2, 3):
        plane.post(post_id, "peer", prepped(), 30.0)
    plane.post(4, "peer", Write(prepped().pieces * 2, 4, 256), 30.0)  # two handles, small: not split
    await until(lambda: transfers(a) == 4)  # (each post's first handle)
    assert transfers(b) == 0 and plane._load == [4, 0]
    plane.post(5, "peer", big(), 30.0)  # large: the least loaded lane (1)
    await until(lambda: transfers(b) == 1)
    plane.post(6, "peer", prepped(), 30.0)  # small: lane 0 still holds no large post
    await until(lambda: transfers(a) == 5)
    assert plane._load == [5, 1] and plane._big == [0, 1] and transfers(b) == 1
    plane.post(7, "peer", prepped(), 30.0)  # small: lane 0 again, however long its queue
    plane.post(8, "peer", big(), 30.0)  # large: lane 1 (one in flight) over lane 0 (six)
    await until(lambda: transfers(a) == 6 and transfers(b) == 2)
    b.finish = True
    await until(lambda: sorted(p for p, _ in settled) == [5, 8])
    assert plane._big == [0, 0] and plane._bigs == set()
    b.finish = False
    plane.post(9, "peer", big(), 30.0)  # large: lane 1 (none in flight)
    plane.post(10, "peer", big(), 30.0)  # large: lane 1 (one) over lane 0 (six)
    await until(lambda: transfers(b) == 4)
    assert plane._big == [0, 2]
    a.finish = True  # lane 0 settles its six small posts
    await until(lambda: len(settled) == 8)
    a.finish = False
    plane.post(11, "peer", big(), 30.0)  # large: lane 0 (none in flight)
    await until(lambda: plane._big == [1, 2] and transfers(a) == 8)
    plane.post(12, "peer", Write(prepped().pieces * 2, 4, 256), 30.0)  # small, every lane holds a large
    # post: whole (not split) to the least loaded lane (0)
    await until(lambda: transfers(a) == 9)
    assert plane._load == [2, 2] and plane._split == {}
    a.finish = b.finish = True
    await until(lambda: len(settled) == 12)
    assert plane._big == [0, 0] and plane._bigs == set() and plane._owner == {}
    assert sorted(p for p, _ in settled) == list(range(1, 13)) and all(err is None for _, err in settled)
    await plane.close()


async def test_a_cancel_reaches_the_lane_that_holds_the_post_only() -> None:
    a, b = FakeAgent(), FakeAgent()
    plane, settled = await laned([a, b])
    plane.post(1, "peer", big(), 30.0)
    plane.post(2, "peer", big(), 30.0)
    await until(lambda: transfers(a) == 1 and transfers(b) == 1)
    plane.cancel([1], RemoteProtocolError("aborted"))
    assert 1 not in plane.lanes[1]._cancelled and 1 in plane.lanes[0]._cancelled
    a.finish = b.finish = True
    await until(lambda: len(settled) == 2)
    outcome = dict(settled)
    assert isinstance(outcome[1], RemoteProtocolError) and outcome[2] is None
    await plane.close()


async def test_a_connect_that_fails_on_one_lane_is_undone_on_the_others() -> None:
    a, b = FakeAgent(), FakeAgent()
    plane, _ = await laned([a, b])
    real = b.add_remote_agent

    def refuse(metadata: bytes) -> bytes:
        raise RuntimeError("nixlBackendError")
    b.add_remote_agent = refuse  # type: ignore[method-assign]
    with pytest.raises(Exception, match="nixlBackendError"):
        await plane.connect_peer("other", stub_agent_metadata("other"), rows(4), "DRAM")
    await until(lambda: ("remove_remote_agent", "other") in a.calls)
    b.add_remote_agent = real  # type: ignore[method-assign]
    await plane.connect_peer("other", stub_agent_metadata("other"), rows(4), "DRAM")  # not "connected already"
    await plane.close()


async def test_leases_and_forgetting_a_peer_apply_on_every_lane() -> None:
    a, b = FakeAgent(), FakeAgent()
    plane, settled = await laned([a, b])
    plane.set_lease("peer", time.monotonic() - 1)  # lapsed: no lane may start a handle
    plane.post(1, "peer", prepped(), 30.0)
    plane.post(2, "peer", prepped(), 30.0)
    await until(lambda: len(settled) == 2)
    assert all(err is not None and "lease" in str(err) for _, err in settled)
    assert transfers(a) == transfers(b) == 0
    plane.forget_peer("peer")
    for agent in (a, b):
        await until(lambda agent=agent: ("remove_remote_agent", "peer") in agent.calls)
    await plane.close()
    assert not plane.alive


async def test_a_lane_that_cannot_start_closes_the_others_and_the_error_is_raised() -> None:
    agents = iter([FakeAgent()])

    def make(n: str, b: str) -> FakeAgent:
        return next(agents)  # the second lane's agent cannot be made
    plane = LanedDataPlane.make("me", 2, lambda name: NixlDataPlane(name, agent_factory=make))
    with pytest.raises(Exception, match="cannot create NIXL agent"):
        await plane.start(MemoryLayout((("DRAM", rows(2)),), rows(4), "DRAM", (0x9000, 64)))
    assert not any(lane.alive for lane in plane.lanes)


async def test_a_post_of_many_descriptors_counts_as_large_whatever_its_bytes() -> None:
    """At some 4 us per descriptor, a head slice sent per token is a long copy under 1 MiB."""
    a, b = FakeAgent(), FakeAgent()
    plane, settled = await laned([a, b])
    plane.post(1, "peer", Write(prepped().pieces * 2, SMALL_POST_DESCRIPTORS, 512), 30.0)  # split, as large
    await until(lambda: transfers(a) == 1 and transfers(b) == 1)
    assert plane._big == [1, 1]
    plane.post(2, "peer", Write(prepped().pieces, SMALL_POST_DESCRIPTORS - 1, 512), 30.0)  # small
    a.finish = b.finish = True
    await until(lambda: len(settled) == 2)
    assert plane._big == [0, 0] and plane._bigs == set() and plane._split == {}
    await plane.close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # (the point)
async def test_a_post_that_finished_in_the_round_its_thread_died_in_settles_once_as_it_finished() -> None:
    """The round's results were a local list of the dying thread: the post never settled (found by
    review). Now the loop takes what that round finished and never handed over."""
    a, b = FakeAgent(), FakeAgent()
    b.finish = True  # lane 1's copy completes inside transfer()...
    real_transfer, real_notifs = b.transfer, b.get_new_notifs
    kill = {"now": False}

    def transfer(h: int) -> str:
        kill["now"] = True  # ...and its thread dies later in that same round
        return real_transfer(h)

    def notifs() -> dict[str, list[bytes]]:
        if kill["now"]:
            raise SystemExit("engine bug")
        return real_notifs()
    b.transfer, b.get_new_notifs = transfer, notifs  # type: ignore[method-assign]
    plane, settled = await laned([a, b])
    plane.post(1, "peer", big(), 30.0)  # lane 0 (stays in flight)
    plane.post(2, "peer", big(), 30.0)  # lane 1: copied, then the thread dies
    await until(lambda: [p for p, _ in settled] == [2])
    assert dict(settled)[2] is None  # (its bytes landed: it settles as it finished)
    a.finish = True
    await until(lambda: len(settled) == 2)
    await ended(plane.lanes[1])
    await plane.close()
    assert sorted(p for p, _ in settled) == [1, 2] and plane._owner == {} and plane._big == [0, 0]


async def ended(lane: NixlDataPlane) -> None:
    """Until the lane's killed thread has ended, its exception reported (``alive`` is false a little
    earlier): a report after the test returns fails whichever test runs next."""
    thread = lane._thread
    assert thread is not None
    await until(lambda: not thread.is_alive())


class _SlowToEnd(NixlDataPlane):
    """A lane whose thread, its start failed, is still ending when the close comes (descheduled)."""

    def _run(self, ready: asyncio.Future[None]) -> None:
        super()._run(ready)
        time.sleep(0.5)


async def test_closing_a_lane_whose_thread_is_still_ending_does_not_wait_for_it() -> None:
    """The failed start closes every lane; the failed lane's thread is alive but past its loop.
    Close used to queue a shutdown call nothing would answer, and start() hung (2 runs in 9 of
    the test above)."""
    agents = iter([FakeAgent()])
    lanes = [NixlDataPlane("me", agent_factory=lambda n, b: next(agents)),
             _SlowToEnd("me.1", agent_factory=lambda n, b: next(agents))]
    plane = LanedDataPlane(lanes)
    with pytest.raises(Exception, match="cannot create NIXL agent"):
        await asyncio.wait_for(plane.start(MemoryLayout((("DRAM", rows(2)),), rows(4), "DRAM", (0x9000, 64))), 5)
    assert not any(lane.alive for lane in plane.lanes)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # (the point)
async def test_a_dead_lane_takes_no_more_posts_and_what_it_held_settles_as_its_thread_ends() -> None:
    """An engine thread that died must not swallow posts: new ones go to the live lane, and every
    post the dead one held settles (with the error) as its thread ends, each once."""
    a, b = FakeAgent(), FakeAgent()
    kill = {"now": False}
    real = b.get_new_notifs

    def notifs() -> dict[str, list[bytes]]:
        if kill["now"]:  # what no handler in the engine catches: its thread ends
            raise SystemExit("engine bug")
        return real()
    b.get_new_notifs = notifs  # type: ignore[method-assign]
    made = iter([a, b])
    plane = LanedDataPlane.make("me", 2, lambda name: NixlDataPlane(name, agent_factory=lambda n, bk: next(made)))
    settled: list[tuple[int, BaseException | None]] = []
    plane.on_settled = settled.extend
    await plane.start(MemoryLayout((("DRAM", rows(2)),), rows(4), "DRAM", (0x9000, 64)))
    await plane.connect_peer("peer", stub_agent_metadata("peer"), rows(4), "DRAM")
    plane.set_lease("peer", time.monotonic() + 60)
    plane.post(1, "peer", big(), 30.0)  # lane 0 (stays in flight)
    plane.post(2, "peer", big(), 30.0)  # lane 1 (stays in flight, then its thread dies)
    await until(lambda: transfers(a) == 1 and transfers(b) == 1)
    kill["now"] = True
    lane1 = plane.lanes[1]
    assert lane1._thread is not None
    await until(lambda: not lane1._thread.is_alive())
    await until(lambda: [p for p, _ in settled] == [2])  # what the dead thread held settles as it ends
    dead = dict(settled)[2]
    assert dead is not None and "engine thread died" in str(dead)
    for post_id in (3, 4):
        plane.post(post_id, "peer", prepped(), 30.0)
    a.finish = True
    await until(lambda: sorted(p for p, _ in settled) == [1, 2, 3, 4])
    assert transfers(a) == 3 and not plane.alive
    await plane.close()
    assert len(settled) == 4 and plane._owner == {} and plane._load == [0, 0] and plane._big == [0, 0]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # (the point)
async def test_a_plane_whose_engine_thread_died_settles_posts_at_once() -> None:
    agent = FakeAgent()
    state = {"die": False}

    def expecting() -> bool:
        if state["die"]:
            raise RuntimeError("engine bug")
        return False
    plane = NixlDataPlane("me", agent_factory=lambda n, b: agent, expecting=expecting)
    settled: list[tuple[int, BaseException | None]] = []
    plane.on_settled = settled.extend
    await plane.start(MemoryLayout((("DRAM", rows(2)),), rows(4), "DRAM", (0x9000, 64)))
    state["die"] = True
    assert plane._thread is not None
    await until(lambda: not plane._thread.is_alive())
    plane.post(7, "peer", prepped(), 30.0)
    await until(lambda: len(settled) == 1)
    assert settled[0][0] == 7 and "engine thread is dead" in str(settled[0][1])
    await plane.close()


@pytest.mark.parametrize("relay", [False, True])
async def test_a_write_of_several_handles_is_split_over_the_lanes_and_settles_once(relay: bool) -> None:
    """Its handles go round-robin to both lanes (copying at once); it settles when both parts did,
    with the first error, and a cancel reaches both parts."""
    a, b = FakeAgent(), FakeAgent()
    plane, settled = await laned([a, b], relay)
    four = prepped()
    plane.post(1, "peer", Write(four.pieces * 4, 8, SMALL_POST_BYTES), 30.0)
    await until(lambda: transfers(a) == 1 and transfers(b) == 1)  # one handle in flight per lane
    a.finish = b.finish = True
    await until(lambda: settled == [(1, None)])
    assert transfers(a) == transfers(b) == 2 and plane.posts_in_flight == 0
    a.finish = b.finish = False
    plane.post(2, "peer", Write(four.pieces * 4, 8, SMALL_POST_BYTES), 30.0)
    await until(lambda: transfers(a) == 3 and transfers(b) == 3)
    plane.cancel([2], RemoteProtocolError("aborted"))
    a.finish = b.finish = True
    await until(lambda: len(settled) == 2)
    assert settled[1][0] == 2 and isinstance(settled[1][1], RemoteProtocolError)
    assert transfers(a) == transfers(b) == 3  # each lane's second handle never started
    assert plane._owner == {} and plane._split == {} and plane._parts == {} and plane._load == [0, 0]
    plane.post(3, "peer", Write(four.pieces * 2, 4, SMALL_POST_BYTES, notif=b"3_kv_0_1_0"), 30.0)  # (SGLang's)
    await until(lambda: len(settled) == 3)
    assert {transfers(a), transfers(b)} == {5, 3}  # both handles on one lane: not split
    await plane.close()


@pytest.mark.parametrize("relay", [False, True])
async def test_a_split_write_with_one_part_stuck_past_its_deadline_reports_its_handle_in_flight(relay: bool) -> None:
    """A cancelled split write: one part's handle finishes (it settles with the cancel), the other
    stays in flight past the deadline. The write's one error must still say a handle is in flight
    (the prefill must not reuse a staging run that handle may still read)."""
    a, b = FakeAgent(), FakeAgent()
    plane, settled = await laned([a, b], relay)
    reason = RemoteProtocolError("aborted")  # (the cores cancel a room's posts with one shared reason)
    plane.post(1, "peer", Write(prepped().pieces * 2, 4, SMALL_POST_BYTES), 1.0)  # (0.3 s: lane 1's deadline
    # came first in 1 of 40 runs on a busy 2-core machine, and its timeout was then the write's first error)
    await until(lambda: transfers(a) == 1 and transfers(b) == 1)
    plane.post(2, "peer", prepped(), 30.0)  # lane 0, queued behind post 1's part
    plane.cancel([1, 2], reason)
    a.finish = True  # lane 0's part settles first, with the cancel; post 2 never starts a handle
    await until(lambda: len(settled) == 2, timeout=4.0)
    outcome = dict(settled)
    assert outcome[1] is reason and outcome[2] is reason
    assert plane.take_in_flight(1) and not plane.take_in_flight(2)  # the flag is the post's, not the reason's
    b.finish = True
    await plane.close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # (the point)
async def test_a_peer_connects_over_the_live_lanes_and_a_dead_lane_refuses_calls() -> None:
    """A connect queued to a lane whose thread had died waited for ever (found by review): a new decode
    peer never connected. Now the connect goes to live lanes, and a dead lane refuses a call at once."""
    a, b = FakeAgent(), FakeAgent()
    real_notifs = b.get_new_notifs
    kill = {"now": False}

    def notifs() -> dict[str, list[bytes]]:
        if kill["now"]:
            raise SystemExit("engine bug")
        return real_notifs()
    b.get_new_notifs = notifs  # type: ignore[method-assign]
    plane, settled = await laned([a, b])
    kill["now"] = True
    await until(lambda: not plane.lanes[1].alive)
    await asyncio.wait_for(plane.connect_peer("other", stub_agent_metadata("other"), rows(4), "DRAM"), 2.0)
    def connected(agent: FakeAgent) -> bool:
        return ("add_remote_agent", stub_agent_metadata("other")) in agent.calls
    assert connected(a) and not connected(b)
    with pytest.raises(TransportError, match="engine thread is dead"):
        await asyncio.wait_for(plane.lanes[1].call(lambda agent: None), 2.0)
    plane.set_lease("other", time.monotonic() + 60)
    plane.post(1, "other", big(), 30.0)
    a.finish = True
    await until(lambda: [p for p, _ in settled] == [1])
    assert settled == [(1, None)]
    await ended(plane.lanes[1])
    await plane.close()
