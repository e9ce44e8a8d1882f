"""A failure notice (a sender that failed and was cleared before every decode rank's destination
came) and later requests reusing its room id: what each rank sends next goes to the right request,
the notice leaves what a later request parked with it, and the table's bytes and records go with
what they hold (scripted runs, simulated time)."""

from __future__ import annotations

import dataclasses

from asynckv.errors import Aborted
from asynckv.proto.early import info_bytes
from asynckv.proto.messages import Abort
from asynckv.proto.states import ReceiverState, SenderState

from .harness import DEFAULTS, state_of
from .test_bounds import Rank, info
from .test_ended import notice_waiting_for_rank_1


def notice(rank: Rank) -> None:
    """Decode TP 2 (X0, X1), room 9: the sender failed after X0's destination; a notice waits for X1."""
    assert rank.register("X0", tp=2).ok and rank.register("X1", tp=2).ok
    old = rank.core.open_sender(9, rank.now)
    rank.feed(info(9, "X0", [1], required=2))
    rank.core.abort_sender(old, Aborted("prefill gave up"), rank.now)
    rank.core.clear_sender(old, rank.now)
    rank.run()
    early = rank.core.early.get(9)
    assert early is not None and early.failed == "prefill gave up" and early.answered == {"X0": 1}


def test_a_later_sender_never_takes_the_old_requests_late_destination_for_its_own() -> None:
    rank = Rank()
    notice(rank)
    rank.feed(info(9, "X0", [2], epoch=2, required=2))  # X0's request 2 parks with the notice
    s = rank.core.open_sender(9, rank.now)  # request 2's sender opens before X1's request-1 destination
    rank.run()
    rank.feed(info(9, "X1", [1], required=2))  # X1's request 1, late: it hears the old failure
    assert s.state is SenderState.BOOTSTRAPPING and "X1" not in s.destinations
    assert [(m.epoch, m.ok, m.reason) for m in rank.statuses(9)][-1] == (1, False, "prefill gave up")
    rank.feed(info(9, "X1", [2], epoch=2, required=2))  # X1's request 2: this sender's
    assert state_of(s) is SenderState.READY and {d: x.epoch for d, x in s.destinations.items()} == {"X0": 2, "X1": 2}
    assert rank.core.room_counts()["early_rooms"] == 0  # the notice went once X1 answered


def test_end_to_end_the_old_requests_rank_fails_and_the_later_request_gets_its_own_pages() -> None:
    c, p, d0, d1 = notice_waiting_for_rank_1()
    r0b = c.receiver(d0, 9, [2])  # rank 0's request 2 parks with the notice
    c.run_ms(55)
    s2 = c.sender(p, 9)  # request 2's sender opens before rank 1's request-1 destination came
    c.run_ms(56)
    r1 = c.receiver(d1, 9, [1])  # rank 1's request 1 (late)
    c.run_ms(60)
    assert r1.state is ReceiverState.FAILED and s2.state is SenderState.BOOTSTRAPPING
    c.w.drive(d1, "clear_receiver", r1)
    r1b = c.receiver(d1, 9, [3])
    c.run_ms(70)
    assert state_of(s2) is SenderState.READY
    c.send(p, s2, [5])
    c.run_ms(120)
    assert state_of(s2) is SenderState.SUCCEEDED and r0b.state is ReceiverState.SUCCEEDED
    assert r1b.state is ReceiverState.SUCCEEDED
    c.check()


def test_a_later_request_left_on_a_spent_notice_lives_its_own_ttl() -> None:
    rank = Rank()
    notice(rank)  # the record was made at t=0: the notice expires at 600 s
    rank.now = 590.0
    rank.feed(info(9, "X0", [2], epoch=2, required=2))
    rank.now = 595.0
    rank.feed(info(9, "X1", [1], required=2))  # the notice is spent; request 2's destinations stay
    rank.feed(info(9, "X1", [2], epoch=2, required=2))
    rank.now = 601.0
    rank.core.handle_timer(rank.now)
    rank.run()
    s = rank.core.open_sender(9, rank.now)
    rank.run()
    assert s.state is SenderState.READY and rank.core.stats["early_expired"] == 0


def test_an_answer_the_byte_bound_cannot_record_ends_the_notice_instead_of_failing_the_ranks_next_request() -> None:
    probe = Rank()
    notice(probe)
    other = info(5, "Y", [1, 2, 3])
    rank = Rank(dataclasses.replace(DEFAULTS, max_early_bytes=probe.core.early.nbytes + info_bytes(other)))
    notice(rank)
    assert rank.register("Y").ok
    rank.feed(other)  # the byte budget is full
    rank.feed(info(9, "X1", [1], required=2))  # told the failure, but its answer cannot be recorded
    assert [(m.epoch, m.ok) for m in rank.statuses(9)][-1] == (1, False)
    assert rank.core.stats["dropped_early_notice"] == 1 and rank.core.early.get(9) is None
    rank.core.open_sender(5, rank.now)  # frees the budget
    rank.run()
    rank.feed(info(9, "X0", [2], epoch=2, required=2))
    rank.feed(info(9, "X1", [2], epoch=2, required=2))
    assert not [m for m in rank.statuses(9) if m.epoch == 2] and rank.parked() == 2


def test_an_abort_the_byte_bound_refuses_after_its_destination_was_unparked_leaves_no_record() -> None:
    rank = Rank(dataclasses.replace(DEFAULTS, max_early_bytes=info_bytes(info(9, "X", [1])) + 10))
    assert rank.register("X").ok
    rank.feed(info(9, "X", [1]))
    rank.feed(Abort(9, 1, "X", True, 1, "r" * 200))  # the destination goes; the abort does not fit
    assert rank.core.room_counts()["early_rooms"] == 0 and rank.core.early.nbytes == 0
    assert rank.core.stats["dropped_early_abort"] == 1
