"""Destinations from a decode's registration session that ended before they arrived: each acts
once, one for a later request reusing the room id waits for that request's sender, and one that
lies about its geometry is not kept (scripted runs, simulated time; the basic cases are in
test_early.py)."""

from __future__ import annotations

import dataclasses

from asynckv.errors import Aborted, PeerUnreachable
from asynckv.proto.messages import Abort, TransferInfo
from asynckv.proto.states import ReceiverState, SenderState
from asynckv.testing.simulator import SimNode

from .harness import DEFAULTS, Cluster, register_pair, state_of
from .test_bounds import Rank, info, register

DEAD = PeerUnreachable("unheard for 4.0s")


def kill(rank: Rank, name: str) -> None:
    rank.core.declare_dead(name, DEAD, rank.now)
    rank.run()


def empty(rank: Rank) -> bool:
    return all(v == 0 for v in rank.core.room_counts().values())


def notice_waiting_for_rank_1() -> tuple[Cluster, SimNode, SimNode, SimNode]:
    """Decode TP 2, room 9: the sender failed and was cleared once rank 0's destination (now cleared
    on decode) arrived, so a failure notice waits for rank 1's. Returns (cluster, prefill, rank 0, rank 1)."""
    c = Cluster(decode_tp=2)
    register_pair(c)
    p, (d0, d1) = c.p[0], c.d
    s = c.sender(p, 9)
    r0 = c.receiver(d0, 9, [1])
    c.run_ms(45)
    c.w.drive(p, "abort_sender", s, Aborted("prefill gave up"))
    c.w.drive(p, "clear_sender", s)
    c.run_ms(50)
    assert r0.state is ReceiverState.FAILED and p.core.room_counts()["early_rooms"] == 1
    c.w.drive(d0, "clear_receiver", r0)
    return c, p, d0, d1


def test_a_copy_of_an_ended_destination_acts_once_and_never_fails_the_next_sessions_reused_room() -> None:
    rank = Rank()
    assert rank.register("X").ok
    s = rank.core.open_sender(9, rank.now)
    kill(rank, "X")
    rank.feed(info(9, "X", [1, 2]))  # it crossed the goodbye: the waiting sender fails at once
    assert s.reason is not None
    assert s.state is SenderState.FAILED and "ended before it arrived" in s.reason
    rank.core.clear_sender(s, rank.now)
    rank.run()
    assert empty(rank), rank.core.room_counts()
    rank.feed(info(9, "X", [1, 2]))  # the same (room, epoch) again: dropped, no stub
    assert empty(rank), rank.core.room_counts()
    assert rank.core.stats["ended_session_info"] == 1 and rank.core.stats["dropped_duplicate"] == 1
    rank.feed(register("X", 64, session=2))  # the decode's next session; its request reuses room 9
    s2 = rank.core.open_sender(9, rank.now)
    rank.run()
    rank.feed(info(9, "X", [3, 4], epoch=2))
    assert s2.state is SenderState.READY and list(s2.destinations["X"].info.dst_pages) == [3, 4]


def test_a_copy_of_a_destination_taken_before_the_end_is_still_dropped_after_it() -> None:
    rank = Rank()
    assert rank.register("X").ok
    s = rank.core.open_sender(9, rank.now)
    rank.feed(info(9, "X", [1, 2]))
    assert s.state is SenderState.READY
    rank.core.abort_sender(s, Aborted("prefill gave up"), rank.now)
    rank.core.clear_sender(s, rank.now)
    kill(rank, "X")
    rank.feed(info(9, "X", [1, 2]))  # taken before the end: its copy parks nothing for a later sender
    assert rank.core.room_counts()["early_rooms"] == 0 and rank.core.stats["dropped_duplicate"] == 1


def test_a_later_request_crossing_the_goodbye_while_the_old_sender_exists_fails_the_next_sender_when_it_opens() -> None:
    rank = Rank()
    assert rank.register("X").ok
    old = rank.core.open_sender(9, rank.now)
    rank.feed(info(9, "X", [1, 2]))
    rank.core.abort_sender(old, Aborted("prefill gave up"), rank.now)  # done, not cleared yet
    rank.run()
    kill(rank, "X")
    rank.feed(info(9, "X", [3, 4], epoch=2))  # the decode's next request on room 9, behind the goodbye
    assert old.reason == "prefill gave up" and rank.core.room_counts()["early_rooms"] == 1
    rank.core.clear_sender(old, rank.now)
    rank.run()
    new = rank.core.open_sender(9, rank.now)
    rank.run()
    assert new.reason is not None
    assert new.state is SenderState.FAILED and "ended before this sender opened" in new.reason
    assert "declared dead: unheard for 4.0s" in new.reason
    rank.core.clear_sender(new, rank.now)
    rank.run()
    assert empty(rank), rank.core.room_counts()


def test_end_to_end_the_next_request_on_a_room_id_whose_destination_crossed_the_goodbye_fails_at_open() -> None:
    c = Cluster()
    register_pair(c)
    p, d = c.p[0], c.d[0]
    r1, s1 = c.receiver(d, 9, [1]), c.sender(p, 9)
    c.run_ms(50)
    c.send(p, s1, [5])
    c.run_ms(60)
    assert r1.state is ReceiverState.SUCCEEDED and s1.state is SenderState.SUCCEEDED  # s1 not cleared yet
    c.w.drive(d, "clear_receiver", r1)
    c.hold(lambda node, ep, m: 0.010 if isinstance(m, TransferInfo) else 0.0)
    r2 = c.receiver(d, 9, [2, 3])  # reaches prefill at 71 ms, after the goodbye
    c.run_ms(65)
    c.w.drive(p, "declare_dead", d.name, DEAD)
    c.run_ms(80)
    assert r2.state is ReceiverState.FAILED and p.core.stats["ended_session_info"] == 1
    c.w.drive(p, "clear_sender", s1)
    s2 = c.sender(p, 9)
    assert s2.state is SenderState.FAILED and "ended before this sender opened" in (s2.reason or "")
    c.w.drive(p, "clear_sender", s2)
    c.w.drive(d, "clear_receiver", r2)
    c.run_ms(90)
    assert all(v == 0 for v in p.core.room_counts().values()), p.core.room_counts()
    c.check()


def test_a_later_request_crossing_the_goodbye_while_a_notice_waits_is_kept_for_the_next_sender() -> None:
    c, p, d0, _ = notice_waiting_for_rank_1()
    c.hold(lambda node, ep, m: 0.010 if isinstance(m, TransferInfo) else 0.0)
    r0b = c.receiver(d0, 9, [2])  # rank 0's next request on room 9: reaches prefill at 61 ms
    c.run_ms(55)
    c.w.drive(p, "declare_dead", d0.name, DEAD)
    c.run_ms(70)
    assert r0b.state is ReceiverState.FAILED and p.core.stats["ended_session_info"] == 1
    s2 = c.sender(p, 9)
    assert s2.state is SenderState.FAILED and "ended before this sender opened" in (s2.reason or "")


def test_a_stub_gives_way_to_a_live_destination_in_a_full_early_table() -> None:
    rank = Rank(dataclasses.replace(DEFAULTS, max_early_infos=1))
    assert rank.register("X").ok and rank.register("Y").ok
    kill(rank, "X")
    rank.feed(info(2, "X", [1]))  # a stub takes the one slot
    rank.feed(info(3, "Y", [1]))  # a live destination: the stub only made a failure faster, it goes
    assert rank.statuses(3) == [] and rank.parked() == 1 and rank.core.stats["early_evicted"] == 1
    s = rank.core.open_sender(3, rank.now)
    rank.run()
    assert s.state is SenderState.READY


def test_an_ended_destination_that_fails_the_checks_is_dropped_and_its_sender_keeps_its_timeout() -> None:
    rank = Rank()
    assert rank.register("X").ok  # TP 1: one decode rank per room
    s = rank.core.open_sender(9, rank.now)
    kill(rank, "X")
    rank.feed(info(9, "X", [1, 2], required=5))
    assert s.state is SenderState.BOOTSTRAPPING and rank.core.stats["dropped_ended_invalid"] == 1
    assert rank.core.stats["ended_session_info"] == 0
    rank.core.clear_sender(s, rank.now)
    rank.run()


def test_a_copy_of_an_ended_destination_the_full_table_refused_still_acts_once_there_is_room() -> None:
    rank = Rank(dataclasses.replace(DEFAULTS, max_early_infos=1))
    assert rank.register("X").ok and rank.register("Y").ok
    rank.feed(info(1, "Y", [1]))  # a live destination takes the one slot
    kill(rank, "X")
    rank.feed(info(2, "X", [1]))  # refused, and nobody can be told: its copy must still count
    assert rank.core.stats["dropped_early_full"] == 1 and rank.core.room_counts()["early_rooms"] == 1
    rank.core.open_sender(1, rank.now)  # frees the slot
    rank.run()
    rank.feed(info(2, "X", [1]))
    s = rank.core.open_sender(2, rank.now)
    rank.run()
    assert s.reason is not None
    assert s.state is SenderState.FAILED and "ended before this sender opened" in s.reason


def test_a_later_request_parked_on_a_notice_outlives_the_notice_when_the_last_rank_is_answered() -> None:
    c, p, d0, d1 = notice_waiting_for_rank_1()
    r0b = c.receiver(d0, 9, [2])  # rank 0's next request on room 9 parks on the notice's record
    c.run_ms(55)
    r1 = c.receiver(d1, 9, [1])  # rank 1's destination of the old request: answered, the notice is spent
    c.run_ms(60)
    assert r1.state is ReceiverState.FAILED and p.core.room_counts()["early_rooms"] == 1
    c.w.drive(d1, "clear_receiver", r1)
    r1b = c.receiver(d1, 9, [2])
    c.run_ms(70)
    s2 = c.sender(p, 9)
    assert s2.state is SenderState.READY  # both ranks' later destinations were kept
    c.send(p, s2, [5])
    c.run_ms(120)
    assert state_of(s2) is SenderState.SUCCEEDED, (s2.state, s2.reason)
    assert r0b.state is ReceiverState.SUCCEEDED and r1b.state is ReceiverState.SUCCEEDED
    for node, room in ((d0, r0b), (d1, r1b)):
        c.w.drive(node, "clear_receiver", room)
    c.w.drive(p, "clear_sender", s2)
    c.run_ms(130)
    assert all(v == 0 for v in p.core.room_counts().values()), p.core.room_counts()
    c.check()


def test_an_abort_and_a_later_requests_destination_on_one_record_fail_the_next_sender_and_tell_both() -> None:
    for live in (True, False):
        rank = Rank()
        assert rank.register("X").ok
        rank.feed(Abort(9, 1, "X", False, 1, "cancelled"))  # request 1 aborted before its sender
        if not live:
            kill(rank, "X")  # and request 2's destination crosses the goodbye
        rank.feed(info(9, "X", [3, 4], epoch=2))
        first = rank.core.open_sender(9, rank.now)  # request 1's, or request 2's: prefill cannot tell
        rank.run()
        assert first.state is SenderState.FAILED and first.reason == "aborted by decode: cancelled"
        if live:  # request 2 hears at once rather than at its waiting timeout
            assert [(m.epoch, m.ok) for m in rank.statuses(9)][-1] == (2, False)
        rank.core.clear_sender(first, rank.now)
        rank.run()
        assert empty(rank), rank.core.room_counts()  # nothing waits for a sender that may never open


def test_an_abort_of_a_later_request_on_a_room_id_with_a_notice_fails_that_requests_sender_at_once() -> None:
    rank = Rank()
    assert rank.register("X0", tp=2).ok and rank.register("X1", tp=2).ok
    old = rank.core.open_sender(9, rank.now)
    rank.feed(info(9, "X0", [1], required=2))
    rank.core.abort_sender(old, Aborted("prefill gave up"), rank.now)
    rank.core.clear_sender(old, rank.now)  # a notice: X0 answered for request 1, X1 not yet
    rank.run()
    rank.feed(Abort(9, 2, "X0", False, 2, "client went away"))  # X0's request 2 on room 9, aborted early
    new = rank.core.open_sender(9, rank.now)
    rank.run()
    assert new.state is SenderState.FAILED and new.reason == "aborted by decode: client went away"
