"""The twelve failures seen from the outside, replayed deterministically on the real cores.

Each test scripts the interleaving that broke the old code (simulated time, 1 ms per
message and per write) and pins when things happen, in simulated milliseconds. The
simulator's byte model fails a test if any byte lands in a page its room no longer owns.
"""

from __future__ import annotations

import dataclasses
import json

from asynckv.errors import Aborted
from asynckv.proto import actions as act
from asynckv.proto.messages import Abort, Bye, Ping, Pong, Register, Status
from asynckv.proto.states import KVPoll, ReceiverState, SenderState

from .harness import DEFAULTS, Cluster, ready_room, register_pair, slow_posts, state_of


def test_1_aux_row_is_not_written_after_decode_reported_failed() -> None:
    c, p, d, r, s = ready_room([3, 4], aux=2)
    slow_posts(c, 50)  # the last chunk's write (its pages, then the aux row) is in flight for a while
    c.send(p, s, [0, 1], aux=1)
    [(_, post)] = [(t, a) for t, a in c.actions(act.Post, p) if a.room == 1]
    assert post.kind == "kv" and post.aux == (1, 2)  # one post: the aux row rides after the pages
    c.run_ms(110)
    c.w.drive(d, "abort_receiver", r, Aborted("client went away"))
    c.run_ms(111)
    assert s.poll() == KVPoll.Failed and s.state is SenderState.DRAINING  # prefill may drop the request now
    assert r.poll() == KVPoll.Transferring  # decode may not reuse the pages yet
    c.run_ms(300)
    # The handle in flight at the abort (page 3) finishes at 125 ms; the rest (page 4, the aux row) never
    # starts: decode hears of it at 125.05 ms, not at 111.
    [(status_ms, status)] = c.sent(p, Status, lambda m: m.room == 1)
    assert not status.ok and status_ms == 125.050008
    assert c.finished_ms(r) == 126.050008 and r.poll() == KVPoll.Failed
    assert 2 not in d.aux_content and (4, 0) not in d.content
    c.check()


def test_2_a_chunk_waiting_for_the_byte_budget_is_never_posted_after_the_fence() -> None:
    c = Cluster(dataclasses.replace(DEFAULTS, max_inflight_bytes=32))  # one page in flight at a time
    register_pair(c)
    p, d = c.p[0], c.d[0]
    r = c.receiver(d, 1, [3, 4, 5, 6])
    s = c.sender(p, 1)
    c.run_ms(100)
    slow_posts(c, 50)
    c.send(p, s, [0], num_pages=4)
    c.send(p, s, [1])  # waits for the budget
    c.run_ms(110)
    c.w.drive(d, "abort_receiver", r, Aborted("client went away"))
    c.run_ms(400)
    posted = [a.dst.tolist() for t, a in c.actions(act.Post, p) if t >= 100]
    assert posted == [[3]]  # page 4's write was dropped from the queue, never posted
    assert c.finished_ms(r) == 151.050006 and p.core.inflight_bytes == 0
    c.check()


def test_3_close_says_goodbye_only_after_its_writes_settled() -> None:
    c, p, _d, r, s = ready_room([3, 4], aux=2)
    slow_posts(c, 50)
    c.send(p, s, [0, 1], aux=1)
    c.run_ms(105)
    c.w.drive(p, "close")
    c.run_ms(300)
    [(bye_ms, _)] = c.sent(p, Bye)
    [(closed_ms, _)] = c.actions(act.Closed, p)
    # The write's handle in flight at the close (page 3) finished at 125 ms; its next one never started.
    assert bye_ms == closed_ms == 125.050008
    assert c.finished_ms(r) == 126.050008 and "closed: manager closed" in (r.reason or "")
    c.check()


def test_4_a_pair_works_again_after_one_false_death() -> None:
    c = Cluster()
    register_pair(c)
    p, d = c.p[0], c.d[0]
    c.w.stop(d, 4.5)  # decode's loop stalls longer than the heartbeat bound (3.5 s)
    c.run_ms(4640)
    [(dead_ms, down)] = c.actions(act.PeerDown, p)
    assert dead_ms == 4007.0 and "unheard for 4.0s" in str(down.error)
    [(_, decode_down)] = c.actions(act.PeerDown, d)  # resumed, it reads prefill's goodbye first
    assert "closed: declared dead" in str(decode_down.error)
    r = c.receiver(d, 2, [5, 6])
    s = c.sender(p, 2)
    c.run_ms(4670)
    c.send(p, s, [0, 1])
    c.run_ms(4700)
    assert r.state is ReceiverState.SUCCEEDED and c.finished_ms(r) == 4672.050013
    assert len(c.sent(d, Register, lambda m: m.session == 2)) == 1  # a new registration session
    c.check()


def test_4b_a_pair_works_again_after_decode_declared_the_prefill_dead() -> None:
    c = Cluster()
    register_pair(c)
    p, d = c.p[0], c.d[0]
    c.w.drive(d, "declare_dead", p.name, Aborted("operator said so"))
    c.run_ms(100)
    assert [str(a.error) for _, a in c.actions(act.PeerDown, p)] == [
        "peer D0.0.0 closed: declared dead: operator said so"]
    r = c.receiver(d, 2, [5, 6])
    s = c.sender(p, 2)
    c.run_ms(130)
    c.send(p, s, [0, 1])
    c.run_ms(160)
    assert r.state is ReceiverState.SUCCEEDED
    c.check()


def test_5_a_reused_room_id_is_not_completed_by_the_old_rooms_status() -> None:
    c = Cluster()
    register_pair(c)
    p, d = c.p[0], c.d[0]
    r1 = c.receiver(d, 7, [3, 4])
    s1 = c.sender(p, 7)
    c.run_ms(100)
    held = [True]
    c.hold(lambda node, ep, m: 0.2 if isinstance(m, Status) and m.ok and held[0] else 0.0)
    c.send(p, s1, [0, 1])  # succeeds at 101 ms; its Status(ok) is held in the network until 302 ms
    c.run_ms(110)
    c.w.drive(p, "clear_sender", s1)
    c.w.drive(d, "clear_receiver", r1)  # decode gives up on it
    held[0] = False
    r2 = c.receiver(d, 7, [5, 6])  # the same room id, a new request
    c.run_ms(305)
    assert c.finished_ms(r1) == 302.050013  # the old status reached the old room only
    assert r2.state is ReceiverState.WAITING and r2.epoch != r1.epoch
    s2 = c.sender(p, 7)
    c.run_ms(310)
    c.send(p, s2, [2, 8])
    c.run_ms(400)
    assert state_of(r2) is ReceiverState.SUCCEEDED and c.finished_ms(r2) == 312.050013  # with its own bytes (I3)
    c.check()


def test_6_a_prefill_abort_before_the_destination_arrives_fails_decode_at_once() -> None:
    c = Cluster()
    register_pair(c)
    p, d = c.p[0], c.d[0]
    s = c.sender(p, 9)
    c.w.drive(p, "abort_sender", s, Aborted("prefill OOM"))
    c.w.drive(p, "clear_sender", s)
    c.run_ms(50)
    r = c.receiver(d, 9, [1])  # destination sent at 50 ms, reaches prefill at 51 ms
    c.run_ms(60)
    assert r.state is ReceiverState.FAILED and c.finished_ms(r) == 52.0
    assert r.reason == "prefill rank 0: prefill OOM"
    assert all(v == 0 for v in p.core.room_counts().values()), p.core.room_counts()
    c.check()


def test_7_in_flight_writes_are_cancelled_when_the_peer_goes_and_free_their_bytes() -> None:
    c, p, d, _, s = ready_room([3, 4])
    c.w.mix = dataclasses.replace(c.w.mix, post_stall=1.0)  # the write never completes by itself
    c.send(p, s, [0, 1])
    c.run_ms(105)
    assert p.core.inflight_bytes == 64
    c.w.drive(d, "close")  # decode says goodbye: its room fails, prefill must stop writing now
    c.run_ms(300)
    [(cancel_ms, cancel)] = c.actions(act.CancelPosts, p)
    assert cancel_ms == 106.0 and "closed" in str(cancel.reason)
    assert s.poll() == KVPoll.Failed and p.core.inflight_bytes == 0 and not p.posts
    c.check()


def test_7b_a_write_stalled_past_its_lease_is_cancelled_at_the_lease() -> None:
    c, p, d, _, s = ready_room([3, 4])
    c.w.mix = dataclasses.replace(c.w.mix, post_stall=1.0)
    c.send(p, s, [0, 1])
    c.w.stop(d, 10.0)  # no more pongs: the lease granted by the last one runs out
    c.run_ms(6000)
    [(_, lease)] = [x for x in c.actions(act.SetLease, p)][-1:]
    assert s.poll() == KVPoll.Failed and "write lease" in (s.reason or "")
    assert c.finished_ms(s) == round(lease.until * 1000 + 1, 6) and p.core.inflight_bytes == 0
    c.check()


def test_8_a_fence_timeout_waits_for_the_silenced_prefills_last_lease() -> None:
    c, _p, d, r, _ = ready_room([3, 4])
    # A slow-but-alive prefill: it never hears this room's Abort, nor decode's goodbye.
    c.hold(lambda node, ep, m: None if isinstance(m, (Abort, Bye)) else 0.0)
    c.w.drive(d, "abort_receiver", r, Aborted("client went away"))
    c.run_ms(12000)
    [(dead_ms, _)] = c.actions(act.PeerDown, d)
    assert dead_ms == 5100.0  # the fence timeout (5 s) after the abort
    last_pong = max(t for t, _ in c.sent(d, Pong))
    assert last_pong == 5008.0  # no pong after it was declared dead: pings get Bye instead
    assert all(t > dead_ms for t, _ in c.sent(d, Bye, lambda m: "no such" in m.reason))
    assert c.finished_ms(r) == last_pong + 3250 + 250  # lease plus one handle after the last grant
    c.check()


def test_9_snapshots_are_plain_json_with_rooms_in_flight() -> None:
    c, p, d, _, s = ready_room([3, 4])
    slow_posts(c, 50)
    c.send(p, s, [0, 1])
    c.run_ms(110)
    for node in (p, d):
        snap = json.loads(json.dumps(node.core.snapshot(c.w.now)))
        assert snap["peers"][0]["rooms"] == 1 and snap["peers"][0]["alive"]
    assert json.loads(json.dumps(p.core.snapshot(c.w.now)))["rooms"] == {"Transferring": 1}


def test_10_a_late_abort_after_both_clears_leaves_nothing_behind() -> None:
    c, p, d, r, s = ready_room([3, 4])
    c.send(p, s, [0, 1])  # lands at 101.05; Status(ok) reaches decode at 102.05
    c.run_ms(101.5)
    c.w.drive(d, "abort_receiver", r, Aborted("client went away"))  # crosses the Status
    c.run_ms(101.6)
    c.w.drive(p, "clear_sender", s)  # the Abort reaches prefill after this (102.5 ms)
    c.run_ms(150)
    c.w.drive(d, "clear_receiver", r)
    assert r.state is ReceiverState.FAILED and c.finished_ms(r) == 102.050013  # fenced by the success
    for node in (p, d):
        assert all(v == 0 for v in node.core.room_counts().values()), node.core.room_counts()
    c.check()


def test_10b_decode_sends_no_abort_to_a_rank_that_reported_the_failure() -> None:
    c, p, d, r, s = ready_room([3, 4])
    c.w.drive(p, "abort_sender", s, Aborted("prefill OOM"))
    c.w.drive(p, "clear_sender", s)
    c.run_ms(150)
    c.w.drive(d, "clear_receiver", r)
    assert r.state is ReceiverState.FAILED and c.sent(d, Abort) == []
    for node in (p, d):
        assert all(v == 0 for v in node.core.room_counts().values()), node.core.room_counts()


def test_11_a_dead_peer_is_forgotten_only_after_its_writes_are_cancelled_and_none_follow() -> None:
    c, p, d, _, s = ready_room([3, 4])
    c.w.mix = dataclasses.replace(c.w.mix, post_stall=1.0)
    c.send(p, s, [0, 1])
    c.run_ms(105)
    c.w.drive(p, "declare_dead", d.name, Aborted("test"))
    c.w.drive(p, "close")
    c.run_ms(300)
    order = [type(a).__name__ for t, a in c.actions(act.Action, p) if t >= 105 and not isinstance(a, act.Send)]
    assert order.index("CancelPosts") < order.index("DisconnectPeer") < order.index("Closed")
    assert not [a for t, a in c.actions(act.Post, p) if t >= 105]
    assert order.count("DisconnectPeer") == 1 and not p.posts


def test_12_a_closing_rank_does_not_fail_a_room_it_already_completed() -> None:
    c = Cluster(prefill_tp=2)
    register_pair(c)
    p0, p1, d = c.p[0], c.p[1], c.d[0]
    r = c.receiver(d, 1, [3, 4])
    s0, s1 = c.sender(p0, 1), c.sender(p1, 1)
    c.run_ms(100)
    c.hold(lambda node, ep, m: 0.05 if node is p1 and isinstance(m, Status) else 0.0)
    c.send(p0, s0, [0, 1])
    c.send(p1, s1, [0, 1])
    c.run_ms(103)
    c.w.drive(p0, "clear_sender", s0)
    c.w.drive(p0, "close")  # rank 0's goodbye overtakes rank 1's status
    c.run_ms(200)
    assert r.state is ReceiverState.SUCCEEDED and c.finished_ms(r) == 152.050006
    c.check()


def test_pings_of_an_unknown_session_get_a_goodbye_not_a_lease() -> None:
    c = Cluster()
    register_pair(c)
    p, d = c.p[0], c.d[0]
    c.w.drive(d, "receive", Ping(p.name, p.endpoint, 99, 1))
    c.run_ms(100)
    assert [m.session for _, m in c.sent(d, Bye)] == [99]
    assert not [m for _, m in c.sent(d, Pong) if m.session == 99]


def test_13_a_session_waits_for_every_older_connect_of_its_name_not_just_the_first_to_drain() -> None:
    """Found by the simulator (seed 19523 of 100,000): a decode registered twice more while the
    prefill was stopped. Session 1 drains with a write in flight, session 2 is dropped while it
    connects, session 3 waits for it. Session 1 draining let session 3 connect beside session 2;
    session 2's connect answered last, and undoing it (by name) took the data plane's connection
    from session 3: every later write to that decode failed, and the pair never recovered."""
    c = Cluster()
    register_pair(c)
    p, d = c.p[0], c.d[0]
    [(_, reg)] = c.sent(d, Register)
    slow_posts(c, 3.0)
    r = c.receiver(d, 7, [1])
    s = c.sender(p, 7)
    c.run_ms(c.now_ms + 5)
    c.send(p, s, [3])  # in flight for 3 ms
    c.run_ms(c.now_ms + 1)
    start = c.now_ms
    c.w.mix = dataclasses.replace(c.w.mix, connect_ms=(20.0, 20.0))
    c.w.drive(p, "receive", dataclasses.replace(reg, session=2))  # 1 drains (its write in flight); 2 connects
    c.w.mix = dataclasses.replace(c.w.mix, connect_ms=(5.0, 5.0))
    c.w.drive(p, "receive", dataclasses.replace(reg, session=3))  # 2 is dropped while connecting; 3 waits
    c.run_ms(start + 40)
    connects = [(ms, a.peer.session) for ms, a in c.actions(act.ConnectPeer, p) if ms >= start]
    undone = [ms for ms, _ in c.actions(act.DisconnectPeer, p) if ms >= start]
    assert connects == [(start, 2), (start + 20, 3)]  # 3 only once 2 answered ...
    assert undone == [start, start + 20]  # ... and was undone (1 at once: it was not connecting)
    peer = p.core.peers[d.name]
    assert peer.session == 3 and peer.phase.name == "CONNECTED" and d.name in p.connected  # connected for real
    assert r.state is ReceiverState.WAITING  # (the decode itself never re-registered: its rooms wait on)
