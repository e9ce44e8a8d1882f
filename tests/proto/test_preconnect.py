"""``prefill_instance(addr, connect=True)``: a decode rank registers with the prefill ranks its
rooms write from before its first room, so that room does not wait for first contact. Scripted
on the real cores over the simulator (1 ms per message, 5 ms per first contact)."""

from __future__ import annotations

import dataclasses

from asynckv.proto import actions as act
from asynckv.proto.bootstrap import PrefillRank
from asynckv.proto.messages import PROTOCOL_VERSION, Register
from asynckv.proto.states import ReceiverState, SenderState
from asynckv.proto.topology import PrefillInstance

from .harness import DEFAULTS, Cluster, register_pair


def first_room_ms(c: Cluster, start_ms: float) -> float:
    """Finish time, counted from ``start_ms``, of a 1-page room opened then and sent once ready."""
    c.run_ms(start_ms)
    p, d = c.p[0], c.d[0]
    r = c.receiver(d, 7, [3])
    s = c.sender(p, 7)
    for step in range(1, 60):  # prefill sends as soon as the room is ready (its destination arrived)
        if s.state is SenderState.READY:
            break
        c.run_ms(start_ms + step)
    c.send(p, s, [0])
    c.run_ms(start_ms + 60)
    assert r.state is ReceiverState.SUCCEEDED, r
    finished = c.finished_ms(r)
    assert finished is not None
    return finished - start_ms


def test_a_preconnected_first_room_finishes_as_on_a_registered_pair() -> None:
    warm = Cluster()
    register_pair(warm)  # a pair that served a room already
    steady = first_room_ms(warm, 100)
    cold = Cluster()
    cold_ms = first_room_ms(cold, 100)
    c = Cluster()
    c.w.look_up(c.d[0], c.w.addr(0), connect=True)
    [(at, reg)] = c.sent(c.d[0], Register)
    assert at == 0 and reg.session == 1  # at once, before any room
    c.run_ms(50)
    assert c.actions(act.PeerUp, c.p[0]) and c.actions(act.PeerUp, c.d[0])  # both sides connected
    assert first_room_ms(c, 100) == steady < cold_ms  # first contact is off the first room's path
    assert len(c.sent(c.d[0], Register)) == 1  # the room used that registration
    c.check()


def test_preconnect_is_idempotent_and_a_no_op_without_topology_or_after_close() -> None:
    c = Cluster()
    d, addr = c.d[0], c.w.addr(0)
    assert c.w.drive(d, "preconnect", addr) == 0  # the topology is not known yet: nothing to register with
    c.w.look_up(d, addr)
    assert c.w.drive(d, "preconnect", addr) == 1
    assert c.w.drive(d, "preconnect", addr) == 0  # already registering
    c.run_ms(20)
    assert c.w.drive(d, "preconnect", addr) == 0  # registered
    other = Cluster()
    other.w.look_up(other.d[0], addr)
    other.w.drive(other.d[0], "close")
    assert other.w.drive(other.d[0], "preconnect", addr) == 0 and not other.sent(other.d[0], Register)


def test_an_unanswered_preconnect_times_out_failing_nothing_and_a_room_registers_again() -> None:
    config = dataclasses.replace(DEFAULTS, handshake_timeout_s=0.2)
    c = Cluster(config)
    d, addr = c.d[0], c.w.addr(0)
    c.hold(lambda node, endpoint, msg: None if isinstance(msg, Register) else 0.0)  # the Register is lost
    c.w.look_up(d, addr, connect=True)
    c.run_ms(250)
    assert addr not in d.core.instances and not d.core.registrations  # given up: looked up again next time
    assert not c.actions(act.Finished) and not c.actions(act.PeerDown)
    c.hold(lambda node, endpoint, msg: 0.0)
    first_room_ms(c, 260)  # (it succeeds)
    assert [m.session for _, m in c.sent(d, Register)] == [1, 2]  # a new session for the room
    c.check()


def test_preconnect_registers_with_every_dp_groups_ranks() -> None:
    c = Cluster(prefill_tp=1)
    d, addr = c.d[0], c.w.addr(0)
    c.run_ms(1)
    rank: PrefillRank = next(iter(c.w.registry[addr].values()))
    second = dataclasses.replace(rank, agent_id=rank.agent_id[:-1] + "x")
    instance = PrefillInstance(tp_size=1, pp_size=1, dp_size=2, page_size=1, kv_dtype="bfloat16", is_mla=False,
                               protocol_version=PROTOCOL_VERSION, ranks={(0, 0, 0): rank, (1, 0, 0): second})
    c.w.drive(d, "topology_fetched", addr, instance)
    assert c.w.drive(d, "preconnect", addr) == 2
    assert sorted(m.prefill_id for _, m in c.sent(d, Register)) == sorted([rank.agent_id, second.agent_id])



def test_closing_with_a_preconnect_pending_leaves_nothing_in_the_tables() -> None:
    """Found by review: a registration still unanswered at close stayed in the table for good (the
    service stops the timer that would have expired it). Close says goodbye and drops it."""
    c = Cluster()
    d = c.d[0]
    c.w.look_up(d, c.w.addr(0), connect=True)
    c.w.drive(d, "close")
    assert d.core.closed and d.core.room_counts()["registrations_pending"] == 0
    c.run_ms(50)  # the answer arrives after close: dropped as stale
    c.w.check_empty(d)
    c.check()
