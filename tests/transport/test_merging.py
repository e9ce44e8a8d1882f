"""Posts queued together to one peer move as one handle (``asynckv.transport.merging``), against the
recording fake agent: each member settles once, with the handle's outcome or its own cancel; a
cancelled post never joins a run; a parked handle flags every member; a dead thread settles each."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import numpy as np
import pytest

from asynckv.errors import RemoteProtocolError, TransferTimeout
from asynckv.proto.topology import stub_agent_metadata
from asynckv.transport.base import MemoryLayout, PreppedPiece, Write
from asynckv.transport.lanes import LanedDataPlane
from asynckv.transport.merging import MERGE_MEMBER_MAX_BYTES, MERGE_MIN_POSTS
from asynckv.transport.nixl import NixlDataPlane

from .test_nixl_plane import FakeAgent, rows, started, until


def one(k: int, notif: bytes = b"", nbytes: int = 64) -> Write:
    """A post of descriptor ``k`` to descriptor ``100 + k`` (so a handle shows whose posts it moves)."""
    return Write((PreppedPiece(np.array([k], dtype=np.int32), np.array([100 + k], dtype=np.int32)),), 1, nbytes,
                 notif)


class Handles:
    """Records the source descriptors of every handle the engine makes."""

    def __init__(self, agent: FakeAgent) -> None:
        self.srcs: list[list[int]] = []
        make = agent.make_prepped_xfer

        def recorded(op: str, local: int, src: Any, remote: int, dst: Any) -> int:
            assert list(dst) == [100 + int(k) for k in src]  # (each member's pages go where it asked)
            self.srcs.append([int(k) for k in src])
            return make(op, local, src, remote, dst)
        agent.make_prepped_xfer = recorded  # type: ignore[method-assign]


async def copying() -> tuple[FakeAgent, NixlDataPlane, list[tuple[int, BaseException | None]], Handles]:
    """A started plane whose fake agent copies inside ``transfer()`` (CMA), its handles recorded."""
    agent = FakeAgent()
    agent.finish = True
    plane, settled = await started(agent)
    return agent, plane, settled, Handles(agent)


async def queued_together(plane: NixlDataPlane, posts: list[tuple[int, Write]], timeout_s: float = 30.0,
                          before: Any = None) -> None:
    """Post ``posts`` while a call holds the engine, so that it takes them in one round."""
    await holding(plane)
    for post_id, write in posts:
        plane.post(post_id, "peer", write, timeout_s)
    if before is not None:
        before()
    await release(plane)


_HELD: dict[int, tuple[threading.Event, asyncio.Future[Any]]] = {}


async def holding(plane: NixlDataPlane) -> None:
    """Until the engine thread is inside a call that holds it (``release`` lets it go)."""
    entered, gate = threading.Event(), threading.Event()

    def hold(agent: Any) -> bool:
        entered.set()
        return gate.wait(5)
    _HELD[id(plane)] = (gate, asyncio.ensure_future(plane.call(hold)))
    await until(entered.is_set)


async def release(plane: NixlDataPlane) -> None:
    gate, busy = _HELD.pop(id(plane))
    gate.set()
    await busy


async def test_posts_queued_together_to_one_peer_move_as_one_handle_and_each_settles_once() -> None:
    _agent, plane, settled, handles = await copying()
    await queued_together(plane, [(k, one(k)) for k in range(1, 7)])
    await until(lambda: len(settled) == 6)
    assert sorted(settled) == [(k, None) for k in range(1, 7)]
    assert handles.srcs == [[1, 2, 3, 4, 5, 6]] and plane.merged == 6
    await asyncio.sleep(0.02)
    assert len(settled) == 6
    await plane.close()


async def test_fewer_posts_than_a_run_or_a_notification_each_go_alone() -> None:
    agent, plane, settled, handles = await copying()
    short = MERGE_MIN_POSTS - 1  # a run one post short on each side of a post with a notification (SGLang's wire)
    posts = [(k, one(k)) for k in range(short)] + [(50, one(50, notif=b"done"))]
    posts += [(60 + k, one(60 + k)) for k in range(short)]
    await queued_together(plane, posts)
    await until(lambda: len(settled) == len(posts))
    assert all(error is None for _, error in settled) and plane.merged == 0
    assert handles.srcs == [[k] for k, _ in posts] and agent.sent_notifs == [("peer", b"done")]
    await plane.close()


async def test_a_post_cancelled_before_its_round_never_joins_a_run_and_never_starts() -> None:
    _agent, plane, settled, handles = await copying()
    reason = RemoteProtocolError("aborted")
    await queued_together(plane, [(k, one(k)) for k in range(1, 11)], before=lambda: plane.cancel([5], reason))
    await until(lambda: len(settled) == 10)
    assert dict(settled)[5] is reason and all(e is None for k, e in settled if k != 5)
    assert handles.srcs == [[1, 2, 3, 4], [6, 7, 8, 9, 10]]
    await plane.close()


async def test_a_member_cancelled_while_the_handle_flies_settles_cancelled_the_others_landed() -> None:
    agent = FakeAgent()  # (handles stay in flight until finish: UCX over TCP)
    plane, settled = await started(agent)
    handles = Handles(agent)
    await queued_together(plane, [(k, one(k)) for k in range(1, 6)])
    await until(lambda: plane.posts_in_flight == 5)
    reason = RemoteProtocolError("aborted")
    plane.cancel([3], reason)
    await asyncio.sleep(0.02)  # (the cancel reached the engine; nothing settles before the handle is done)
    assert settled == []
    agent.finish = True
    await until(lambda: len(settled) == 5)
    assert dict(settled)[3] is reason and all(e is None for k, e in settled if k != 3)
    assert handles.srcs == [[1, 2, 3, 4, 5]] and not any(plane.take_in_flight(k) for k in range(1, 6))
    await plane.close()


async def test_a_merged_handle_past_its_deadline_is_parked_once_and_flags_every_member() -> None:
    agent = FakeAgent()
    plane, settled = await started(agent)
    await queued_together(plane, [(k, one(k)) for k in range(1, 6)], timeout_s=0.2)
    await until(lambda: len(settled) == 5)
    assert all(isinstance(e, TransferTimeout) for _, e in settled)
    assert all(str(e).startswith("posts 1..5 (5 merged): not done after 0.2s") for _, e in settled), settled
    assert len(plane._parked) == 1 and all(plane.take_in_flight(k) for k in range(1, 6))
    agent.finish = True
    await until(lambda: not plane._parked)
    await plane.close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # (the point)
async def test_a_thread_that_dies_with_a_merged_handle_in_flight_settles_each_member_once() -> None:
    agent = FakeAgent()
    plane, settled = await started(agent)
    await queued_together(plane, [(k, one(k)) for k in range(1, 6)])
    await until(lambda: plane.posts_in_flight == 5)

    def dies() -> dict[str, list[bytes]]:
        raise SystemExit("engine bug")
    agent.get_new_notifs = dies  # type: ignore[method-assign]
    thread = plane._thread
    assert thread is not None
    await until(lambda: not thread.is_alive())
    await plane.close()
    await until(lambda: len(settled) == 5)
    assert sorted(k for k, _ in settled) == [1, 2, 3, 4, 5]
    assert all("engine thread died" in str(e) for _, e in settled)
    assert all(plane.take_in_flight(k) for k in range(1, 6))  # (UCX may still read their sources)
    await asyncio.sleep(0.02)
    assert len(settled) == 5


async def test_a_run_stops_at_the_bounds_a_manager_set_for_one_handle() -> None:
    """``Config.xfer_handle_bytes`` bounds what one handle may land after its lease was checked (the
    fence); ``max_descs_per_xfer`` its descriptors: merged handles keep both."""
    _agent, plane, settled, handles = await copying()
    plane.merge_limits = (4 * 64, 1000)  # (bytes: four of these posts)
    await queued_together(plane, [(k, one(k)) for k in range(1, 10)])
    await until(lambda: len(settled) == 9)
    plane.merge_limits = (10**9, 5)  # (descriptors: five)
    await queued_together(plane, [(k, one(k)) for k in range(11, 20)])
    await until(lambda: len(settled) == 18)
    assert all(e is None for _, e in settled)
    assert handles.srcs == [[1, 2, 3, 4], [5, 6, 7, 8], [9], [11, 12, 13, 14, 15], [16, 17, 18, 19]]
    await plane.close()


async def test_a_post_of_member_size_or_more_goes_alone_and_splits_the_runs_beside_it() -> None:
    """A post this large copies long enough that its own handle costs little, and merged it would
    wait for its neighbours' copies (a split write's shares, merged on each lane, made rooms started
    together finish together)."""
    _agent, plane, settled, handles = await copying()
    plane.merge_limits = (10**12, 1000)
    big, small = MERGE_MEMBER_MAX_BYTES, MERGE_MEMBER_MAX_BYTES - 1
    posts = [(k, one(k, nbytes=small)) for k in range(1, 5)] + [(5, one(5, nbytes=big))]
    posts += [(k, one(k, nbytes=big)) for k in range(6, 10)]
    await queued_together(plane, posts)
    await until(lambda: len(settled) == 9)
    assert all(e is None for _, e in settled) and plane.merged == 4
    assert handles.srcs == [[1, 2, 3, 4], [5], [6], [7], [8], [9]]
    await plane.close()


@pytest.mark.parametrize("n", [1, 5], ids=["single", "merged"])
@pytest.mark.parametrize("later", ["forget", "lease", "check_fails"])
async def test_a_member_cancelled_in_flight_keeps_its_reason_through_a_later_stop_as_a_post_does(
        later: str, n: int) -> None:
    """Found by review: the merged post's later stop (the peer forgotten, the lease lapsed, a failed
    check) overwrote a member's cancel, where a single post keeps its first stop."""
    agent = FakeAgent()
    plane, settled = await started(agent)
    await queued_together(plane, [(k, one(k)) for k in range(1, n + 1)])
    await until(lambda: plane.posts_in_flight == n)
    assert plane.merged == (0 if n == 1 else 5)
    reason = RemoteProtocolError("aborted")
    plane.cancel([1], reason)
    await holding(plane)  # (the cancel reached the engine before this call)
    await release(plane)
    if later == "forget":
        plane.forget_peer("peer")
    elif later == "lease":
        plane.set_lease("peer", time.monotonic() - 1)
    else:
        def fails(h: int) -> str:
            raise RuntimeError("nixl check failed")
        agent.check_xfer_state = fails  # type: ignore[method-assign]
    await asyncio.sleep(0.05)
    agent.finish = True
    await until(lambda: len(settled) == n)
    outcome = dict(settled)
    assert outcome[1] is reason
    assert all(e is not None and e is not reason for k, e in outcome.items() if k != 1)  # (the later stop)
    await plane.close()


@pytest.mark.parametrize(("max_descs", "handles"), [(800, [300] * 4), (1200, [1200])])  # (lane 1: the 300s)
async def test_shares_of_split_writes_merge_by_their_own_descriptors(max_descs: int, handles: list[int]) -> None:
    """Found by review: a lane's share of a split write stated a proportional estimate of its
    descriptors and bytes (a third of a write of pieces [300, 300, 1] for a share of 300), so four
    shares merged past the bound on one handle. Shares now count their own pieces."""
    agents = [FakeAgent(), FakeAgent()]
    for a in agents:
        a.finish = True
    lanes = [NixlDataPlane(name, agent_factory=lambda n, b, a=a: a)
             for name, a in zip(("me", "me.1"), agents, strict=True)]
    plane = LanedDataPlane(lanes)
    settled: list[Any] = []
    plane.on_settled = settled.extend
    await plane.start(MemoryLayout((("DRAM", rows(2)),), rows(4), "DRAM", (0x9000, 64)))
    await plane.connect_peer("peer", stub_agent_metadata("peer"), rows(4), "DRAM")
    plane.set_lease("peer", time.monotonic() + 60)
    item, per = 4096, 300
    for lane in lanes:
        lane.merge_limits = (10**12, max_descs)
    seen: list[int] = []
    make = agents[1].make_prepped_xfer

    def recorded(op: str, local: int, src: Any, remote: int, dst: Any) -> int:
        seen.append(len(src))
        return make(op, local, src, remote, dst)
    agents[1].make_prepped_xfer = recorded  # type: ignore[method-assign]
    for lane in lanes:
        await holding(lane)
    for k in range(4):
        idx = np.arange(1000 * k, 1000 * k + 2 * per + 1, dtype=np.int32)  # pieces of 300, 300 and 1
        pieces = tuple(PreppedPiece(idx[i:i + per], idx[i:i + per]) for i in range(0, len(idx), per))
        plane.post(k + 1, "peer", Write(pieces, len(idx), len(idx) * item), 30.0)
    for lane in lanes:
        await release(lane)
    await until(lambda: len(settled) == 4)
    assert all(e is None for _, e in settled)
    assert sorted(seen, reverse=True) == handles and max(seen) <= max_descs
    await plane.close()
