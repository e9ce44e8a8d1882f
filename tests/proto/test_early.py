"""Rooms that end before their destination reached prefill: the sender hears of it at once, and
nothing of the room outlives it in prefill's early table once every decode rank was answered
(scripted runs, simulated milliseconds)."""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from asynckv.errors import Aborted, PeerUnreachable
from asynckv.proto.early import EarlyRoom, EarlyTable, info_bytes
from asynckv.proto.messages import Abort, Status, TransferInfo
from asynckv.proto.receiver import ReceiverRoom
from asynckv.proto.sender import DecodePeer, Destination, PeerPhase
from asynckv.proto.states import ReceiverState, SenderState
from asynckv.testing.simulator import SimNode

from .harness import DEFAULTS, Cluster, register_pair, state_of


def empty_tables(*nodes: object) -> bool:
    return all(all(v == 0 for v in node.core.room_counts().values()) for node in nodes)  # type: ignore[attr-defined]


def test_a_sender_that_failed_before_its_destination_and_answered_it_leaves_no_notice() -> None:
    c = Cluster()
    register_pair(c)
    p, d = c.p[0], c.d[0]
    s = c.sender(p, 9)
    c.w.drive(p, "abort_sender", s, Aborted("prefill gave up"))  # not cleared yet
    r = c.receiver(d, 9, [1, 2])  # the destination reaches prefill at 41 ms: answered at once
    c.run_ms(60)
    assert r.state is ReceiverState.FAILED and c.finished_ms(r) == 42.0
    c.w.drive(p, "clear_sender", s)
    c.w.drive(d, "clear_receiver", r)
    assert empty_tables(p, d), (p.core.room_counts(), d.core.room_counts())  # no notice left for ttl
    c.check()


def test_a_decode_abort_before_its_destination_fails_the_sender_at_once_and_leaves_nothing() -> None:
    c = Cluster()  # a cold pair: the decode is still registering when it aborts
    p, d = c.p[0], c.d[0]
    s = c.sender(p, 5)
    r = c.receiver(d, 5, [0, 1, 2, 3])
    c.run_ms(2)  # topology known, Register on its way
    c.w.drive(d, "abort_receiver", r, Aborted("client went away"))
    c.run_ms(20)
    [(_, abort)] = c.sent(d, Abort)
    assert not abort.destination_sent and abort.required == 1
    assert s.state is SenderState.FAILED and c.finished_ms(s) == 3.0  # not at the bootstrap timeout
    assert r.state is ReceiverState.FAILED
    c.w.drive(p, "clear_sender", s)
    c.w.drive(d, "clear_receiver", r)
    assert empty_tables(p, d), (p.core.room_counts(), d.core.room_counts())
    c.check()


def test_a_receiver_aborted_before_init_fails_its_sender_at_once() -> None:
    c = Cluster()
    register_pair(c)  # the prefill's topology is known
    p, d = c.p[0], c.d[0]
    s = c.sender(p, 7)
    r = c.w.drive(d, "open_receiver", c.w.addr(0), 7)
    c.w.drive(d, "abort_receiver", r, Aborted("request cancelled"))  # init() never called
    c.run_ms(60)
    [(sent_ms, abort)] = c.sent(d, Abort)
    assert sent_ms == 40.0 and not abort.destination_sent
    assert s.reason is not None
    assert s.state is SenderState.FAILED and c.finished_ms(s) == 41.0 and "request cancelled" in s.reason
    c.w.drive(p, "clear_sender", s)
    c.w.drive(d, "clear_receiver", r)
    assert empty_tables(p, d), (p.core.room_counts(), d.core.room_counts())


def test_a_receiver_aborted_before_init_on_a_cold_pair_looks_the_ranks_up_to_abort_them() -> None:
    c = Cluster()  # nothing known of the prefill yet
    p, d = c.p[0], c.d[0]
    s = c.sender(p, 7)
    r = c.w.drive(d, "open_receiver", c.w.addr(0), 7)
    c.w.drive(d, "abort_receiver", r, Aborted("request cancelled"))  # init() never called
    c.run_ms(60)
    [(sent_ms, _)] = c.sent(d, Abort)
    assert sent_ms == 1.0 and s.state is SenderState.FAILED and c.finished_ms(s) == 2.0
    c.w.drive(p, "clear_sender", s)
    c.w.drive(d, "clear_receiver", r)
    assert empty_tables(p, d), (p.core.room_counts(), d.core.room_counts())


def test_a_receiver_aborted_while_its_topology_look_up_is_in_flight_fails_its_sender() -> None:
    c = Cluster()  # cold: init() starts the look-up
    p, d = c.p[0], c.d[0]
    s = c.sender(p, 7)
    r = c.receiver(d, 7, [1, 2])
    c.w.drive(d, "abort_receiver", r, Aborted("request cancelled"))  # the look-up answers at 1 ms
    c.run_ms(60)
    [(sent_ms, _)] = c.sent(d, Abort)
    assert sent_ms == 1.0 and s.state is SenderState.FAILED and c.finished_ms(s) == 2.0
    c.check()


def test_a_notice_waits_for_the_other_decode_rank_and_answers_it_at_once() -> None:
    c = Cluster(prefill_tp=1, decode_tp=2)  # two decode ranks send prefill rank 0 a destination
    register_pair(c)
    p, (d0, d1) = c.p[0], c.d
    s = c.sender(p, 9)
    c.w.drive(p, "abort_sender", s, Aborted("prefill gave up"))
    r0 = c.receiver(d0, 9, [1])
    c.run_ms(60)
    c.w.drive(p, "clear_sender", s)
    assert p.core.room_counts()["early_rooms"] == 1  # rank 1 of decode has not been answered yet
    r1 = c.receiver(d1, 9, [2])
    c.run_ms(100)
    assert r0.state is r1.state is ReceiverState.FAILED and c.finished_ms(r1) == 62.0
    assert [m.ok for _, m in c.sent(p, Status, lambda m: m.room == 9)] == [False, False]
    assert p.core.room_counts()["early_rooms"] == 0
    c.check()


def destination(room: int, peer: DecodePeer) -> Destination:
    empty = np.empty(0, dtype=np.int32)
    return Destination(TransferInfo(room, 1, "d", "p", -1, 1, False, False, 0, empty, empty), peer)


def test_a_full_table_gives_up_notices_and_aborts_before_destinations() -> None:
    stats: collections.Counter[str] = collections.Counter()
    table = EarlyTable(max_rooms=3, ttl_s=60, stats=stats)
    peer, ended = object.__new__(DecodePeer), object.__new__(DecodePeer)
    peer.phase, ended.phase = PeerPhase.CONNECTED, PeerPhase.DRAINING

    def add(room: int, now: float) -> EarlyRoom:
        early = table.get_or_add(room, now)
        assert early is not None
        return early

    assert table.leave_notice(add(1, 0), "notice", {}, 1)
    assert table.park(add(2, 0), destination(2, peer)) is None
    assert table.keep_abort(add(3, 0), Abort(3, 1, "d", False, 1, "abort"))
    assert table.park(add(4, 1), destination(4, peer)) is None  # room 1 goes
    assert table.get(1) is None and table.get(2) is not None and stats["early_evicted"] == 1
    assert table.park(add(5, 1), destination(5, peer)) is None  # room 3 goes
    assert table.get(3) is None and len(table) == 3
    assert table.get_or_add(6, 2) is None  # only destinations left: the newcomer is refused
    assert table.nbytes == 3 * info_bytes(destination(2, peer).info)  # what is kept is charged, and no more
    table.expire(61)
    assert len(table) == 0 and stats["early_expired"] == 3 and table.nbytes == 0
    # A destination whose session ended only makes its sender fail sooner, as a notice does: it goes first.
    assert table.park(add(7, 62), destination(7, peer)) is None
    assert table.park(add(8, 62), destination(8, ended)) is None
    assert table.park(add(9, 62), destination(9, peer)) is None
    assert table.park(add(10, 63), destination(10, peer)) is None  # room 8 goes, not the older room 7
    assert table.get(8) is None and table.get(7) is not None and stats["early_evicted"] == 3


def test_a_room_parks_as_many_destinations_as_its_decode_ranks_and_the_table_bounds_their_bytes() -> None:
    table = EarlyTable(max_rooms=8, ttl_s=60, stats=collections.Counter(), max_bytes=3000)
    peer = object.__new__(DecodePeer)
    pages = np.arange(200, dtype=np.int32)  # 800 bytes

    def dest(room: int, decode_id: str, required: int) -> Destination:
        return Destination(TransferInfo(room, 1, decode_id, "p", -1, required, False, False, 0, pages,
                                        np.empty(0, dtype=np.int32)), peer)

    early = table.get_or_add(1, 0)
    assert early is not None
    assert table.park(early, dest(1, "a", 2)) is None and table.park(early, dest(1, "b", 2)) is None
    refused = table.park(early, dest(1, "c", 2))
    assert refused is not None and refused[0] == "early_room_full" and "required_dst_info_num=2" in refused[1]
    assert table.park(early, dest(1, "a", 2)) is None  # the same decode rank again replaces its own
    other = table.get_or_add(2, 0)
    assert other is not None
    refused = table.park(other, dest(2, "a", 1))  # a third 1 KiB destination does not fit in 3000 bytes
    assert refused is not None and refused[0] == "early_bytes" and "max_early_bytes=3000" in refused[1]
    table.discard_if_empty(2)
    assert table.get(2) is None and table.unpark(early, "a") is not None
    assert table.pop(1) is not None and table.nbytes == 0


def test_an_abort_before_the_sender_fails_it_at_once_and_a_reused_id_then_succeeds() -> None:
    c = Cluster()
    register_pair(c)
    p, d = c.p[0], c.d[0]
    a = c.w.drive(d, "open_receiver", c.w.addr(0), 7)
    c.w.drive(d, "abort_receiver", a, Aborted("request A cancelled"))  # reaches prefill before A's sender
    c.w.drive(d, "clear_receiver", a)
    c.run_ms(50)
    s = c.sender(p, 7)
    assert s.state is SenderState.FAILED and s.reason == "aborted by decode: request A cancelled"
    c.w.drive(p, "clear_sender", s)
    assert empty_tables(p, d), (p.core.room_counts(), d.core.room_counts())  # decode A needs nothing more
    b = c.receiver(d, 7, [3, 4])  # request B reuses the id: its destination waits for B's sender
    c.run_ms(60)
    assert b.state is ReceiverState.WAITING
    s2 = c.sender(p, 7)
    c.send(p, s2, [10, 11])
    c.run_ms(80)
    assert state_of(b) is ReceiverState.SUCCEEDED and s2.state is SenderState.SUCCEEDED  # with B's bytes (I3)
    c.check()


def test_a_notice_goes_when_the_last_decode_rank_answers_with_an_abort() -> None:
    c = Cluster(prefill_tp=1, decode_tp=2)
    register_pair(c)
    p, (d0, d1) = c.p[0], c.d
    s = c.sender(p, 9)
    r0 = c.receiver(d0, 9, [1])
    c.run_ms(45)
    c.w.drive(p, "abort_sender", s, Aborted("prefill gave up"))
    c.w.drive(p, "clear_sender", s)  # rank 1's destination is still to come: a notice waits for it
    assert p.core.room_counts()["early_rooms"] == 1
    r1 = c.w.drive(d1, "open_receiver", c.w.addr(0), 9)
    c.w.drive(d1, "abort_receiver", r1, Aborted("request cancelled"))  # rank 1 answers with an abort
    c.run_ms(60)
    for node, room in ((d0, r0), (d1, r1)):
        c.w.drive(node, "clear_receiver", room)
    assert r0.state is r1.state is ReceiverState.FAILED
    assert empty_tables(p, d0, d1), p.core.room_counts()
    c.check()


def test_a_destination_refused_by_a_full_early_table_fails_its_room_at_once() -> None:
    c = Cluster(dataclasses.replace(DEFAULTS, max_early_infos=1))
    register_pair(c)
    p, d = c.p[0], c.d[0]
    first, second = c.receiver(d, 1, [1]), c.receiver(d, 2, [2])  # no sender for either yet
    c.run_ms(60)
    assert first.state is ReceiverState.WAITING  # parked for its sender
    assert second.state is ReceiverState.FAILED and c.finished_ms(second) == 42.0
    assert second.reason is not None
    assert "max_early_infos" in second.reason
    s = c.sender(p, 1)
    c.send(p, s, [5])
    c.run_ms(80)
    assert state_of(first) is ReceiverState.SUCCEEDED
    c.check()


def test_a_reused_id_does_not_reach_the_old_sender_its_decode_aborted_before_any_destination() -> None:
    c = Cluster()
    register_pair(c)
    p, d = c.p[0], c.d[0]
    old = c.sender(p, 4)
    a = c.w.drive(d, "open_receiver", c.w.addr(0), 4)
    c.w.drive(d, "abort_receiver", a, Aborted("request A cancelled"))  # fails the old sender at 41 ms
    c.w.drive(d, "clear_receiver", a)
    c.run_ms(45)
    b = c.receiver(d, 4, [3, 4])  # request B: not a late destination of A's sender
    c.run_ms(60)
    assert old.state is SenderState.FAILED and b.state is ReceiverState.WAITING
    c.w.drive(p, "clear_sender", old)
    new = c.sender(p, 4)
    c.send(p, new, [10, 11])
    c.run_ms(80)
    assert state_of(b) is ReceiverState.SUCCEEDED and new.state is SenderState.SUCCEEDED
    c.w.drive(p, "clear_sender", new)
    c.w.drive(d, "clear_receiver", b)
    assert empty_tables(p, d), (p.core.room_counts(), d.core.room_counts())
    c.check()


def test_a_destination_whose_session_ended_before_its_sender_fails_that_sender_at_once_and_leaves_nothing() -> None:
    """Found by the simulator (seed 19217 of 100,000): the destination waited for its sender, the
    decode's session ended (a false death), then the sender opened. It dropped the destination
    and waited for another until its bootstrap timeout, then left a failure notice for a decode
    rank that had already failed the request with its session: nobody would read it, and it
    stayed for its TTL (600 s)."""
    c = Cluster()
    register_pair(c)
    p, d = c.p[0], c.d[0]
    r = c.receiver(d, 9, [1, 2])  # its destination reaches prefill before any sender: kept
    c.run_ms(50)
    assert p.core.room_counts()["early_rooms"] == 1
    c.w.drive(p, "declare_dead", d.name, PeerUnreachable("unheard for 4.0s"))
    c.run_ms(60)
    assert r.state is ReceiverState.FAILED  # (the decode heard prefill's goodbye)
    s = c.sender(p, 9)
    assert s.state is SenderState.FAILED and c.finished_ms(s) == 60.0  # at once, not at the bootstrap timeout
    assert s.reason is not None
    assert "came in a registration session that ended before this sender opened" in s.reason
    assert "declared dead: unheard for 4.0s" in s.reason
    c.w.drive(p, "clear_sender", s)
    c.w.drive(d, "clear_receiver", r)
    c.run_ms(70)
    assert empty_tables(p, d), (p.core.room_counts(), d.core.room_counts())  # no notice left for its ttl
    c.check()


def _ti_crosses_the_goodbye(c: Cluster, room: int, pages: list[int]) -> tuple[SimNode, ReceiverRoom]:
    """A registered pair; the decode's destination for ``room`` leaves at 40 ms and takes 11 ms; at 45 ms
    prefill declares that decode dead (a false death): its goodbye reaches decode at 46 ms, before the
    destination reaches prefill at 51 ms."""
    register_pair(c)
    p, d = c.p[0], c.d[0]
    c.hold(lambda node, ep, m: 0.010 if isinstance(m, TransferInfo) and m.room == room else 0.0)
    r = c.receiver(d, room, pages)
    c.run_ms(45)
    c.w.drive(p, "declare_dead", d.name, PeerUnreachable("unheard for 4.0s"))
    c.run_ms(47)
    assert r.state is ReceiverState.FAILED  # (decode failed the request with its session)
    return p, r


def test_a_destination_that_crosses_the_goodbye_of_its_session_fails_the_waiting_sender_at_once() -> None:
    """Found by an adversarial run: the destination arrived after its session ended and was dropped
    as from an unknown peer, so the sender waited for its bootstrap timeout (300 s) and then left a
    failure notice for a decode that had failed the request already, for the early table's TTL."""
    c = Cluster()
    s = c.sender(c.p[0], 9)
    p, r = _ti_crosses_the_goodbye(c, 9, [1, 2])
    c.run_ms(60)
    assert s.state is SenderState.FAILED and c.finished_ms(s) == 51.0  # when it arrived
    assert s.reason is not None
    assert "came in a registration session that ended before it arrived" in s.reason
    assert "declared dead: unheard for 4.0s" in s.reason
    assert p.core.stats["ended_session_info"] == 1 and p.core.stats["dropped_unknown_peer"] == 0
    c.w.drive(p, "clear_sender", s)
    c.w.drive(c.d[0], "clear_receiver", r)
    c.run_ms(70)
    assert empty_tables(p, c.d[0]), (p.core.room_counts(), c.d[0].core.room_counts())  # no notice left
    c.check()


def test_a_destination_that_crosses_the_goodbye_fails_a_sender_opened_after_it_at_once() -> None:
    c = Cluster()
    p, r = _ti_crosses_the_goodbye(c, 9, [1, 2])
    c.run_ms(60)
    assert p.core.room_counts()["early_rooms"] == 1  # kept (without its pages) for the sender to come
    s = c.sender(p, 9)
    assert s.state is SenderState.FAILED and c.finished_ms(s) == 60.0
    assert s.reason is not None
    assert "came in a registration session that ended before this sender opened" in s.reason
    c.w.drive(p, "clear_sender", s)
    c.w.drive(c.d[0], "clear_receiver", r)
    assert empty_tables(p, c.d[0]), (p.core.room_counts(), c.d[0].core.room_counts())
    c.check()


def test_a_destination_of_an_ended_session_does_not_touch_the_next_session_or_a_reused_room() -> None:
    """After the crossing destination, the decode registers again (its next room) and reuses the room
    id: the new destination replaces the ended one, and the transfer succeeds with every byte."""
    c = Cluster()
    p, r = _ti_crosses_the_goodbye(c, 9, [1, 2])
    c.run_ms(60)
    d = c.d[0]
    c.w.drive(d, "clear_receiver", r)
    c.hold(lambda node, ep, m: 0.0)
    r2 = c.receiver(d, 9, [3, 4])  # a new session: Register, connect, then its destination
    c.run_ms(100)
    assert r2.state is ReceiverState.WAITING, r2.state  # its destination reached prefill
    assert p.core.ended == {}  # (the decode's new session connected: nothing of the old one is consulted)
    s = c.sender(p, 9, src=[7, 8])
    assert s.state is SenderState.READY, (s.state, s.reason)  # with the new destination, not the ended one
    c.send(p, s, [7, 8])
    c.run_ms(120)
    assert state_of(r2) is ReceiverState.SUCCEEDED and state_of(s) is SenderState.SUCCEEDED
    c.w.drive(d, "clear_receiver", r2)
    c.w.drive(p, "clear_sender", s)
    assert empty_tables(p, d), (p.core.room_counts(), d.core.room_counts())
    c.check()


def test_with_two_decode_ranks_a_destination_crossing_the_goodbye_fails_the_room_for_both_at_once() -> None:
    c = Cluster(decode_tp=2)
    register_pair(c)
    p, (d0, d1) = c.p[0], c.d
    s = c.sender(p, 9)
    c.hold(lambda node, ep, m: 0.010 if isinstance(m, TransferInfo) and node is d0 else 0.0)
    r0, r1 = c.receiver(d0, 9, [1, 2]), c.receiver(d1, 9, [1, 2])
    c.run_ms(45)
    c.w.drive(p, "declare_dead", d0.name, PeerUnreachable("unheard for 4.0s"))
    c.run_ms(60)
    assert s.state is SenderState.FAILED and c.finished_ms(s) == 51.0
    assert r0.state is ReceiverState.FAILED and r1.state is ReceiverState.FAILED  # d1 told at once too
    assert c.finished_ms(r1) == 52.0
    for d, r in ((d0, r0), (d1, r1)):
        c.w.drive(d, "clear_receiver", r)
    c.w.drive(p, "clear_sender", s)
    c.run_ms(70)
    assert empty_tables(p, d0, d1), (p.core.room_counts(), d0.core.room_counts(), d1.core.room_counts())
    c.check()


def test_a_destination_from_a_decode_that_never_had_a_session_is_still_dropped_as_unknown() -> None:
    c = Cluster()
    register_pair(c)
    p = c.p[0]
    s = c.sender(p, 9)
    stranger = TransferInfo(9, 1, "f" * 32, p.name, -1, 1, False, False, 0, np.arange(2, dtype=np.int32),
                            np.empty(0, dtype=np.int32))
    c.w.drive(p, "receive", stranger)
    assert s.state is SenderState.BOOTSTRAPPING and p.core.stats["dropped_unknown_peer"] == 1
    assert p.core.room_counts()["early_rooms"] == 0
