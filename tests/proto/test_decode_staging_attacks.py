"""Adversarial checks of decode staging, driven directly on a ``DecodeCore`` with hand-made messages,
as ``test_decode_staging`` does: every pair of events around slots (fencing, the queue, the copy,
close, timers, dead and restarted peers). The core takes ``now`` explicitly, so nothing here sleeps.
Written by a reviewer briefed only with the feature's promises; the three tests of rooms failing
together (close, one timer tick, peers declared dead in one heartbeat) failed on the first version."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest

from asynckv.config import Config
from asynckv.errors import InvalidArgument, PeerUnreachable
from asynckv.proto import actions as act
from asynckv.proto.messages import Bye, TransferInfo
from asynckv.proto.states import KVPoll, ReceiverState

from .staging_rig import (
    ADDR,
    ADDR_B,
    ENTRIES,
    HEAD_BYTES,
    HEADS,
    ITEM,
    PAGE,
    PAGES,
    Rig,
    assert_nothing_leaks,
    infos,
    instance,
    scatters,
)

# -- 1. fencing: slots are never handed on while a rank may still write them -----------------------------


def test_close_with_rooms_waiting_for_slots_sends_no_new_destination() -> None:
    """close() fails every room; the head waiter's failure must not hand freed capacity to a later waiter
    whose destination then goes out to prefill *after* close began (a fresh write into decode memory)."""
    rig = Rig(slots=8)
    holder = rig.room(1, [0, 1, 2])  # 6 of 8 slots
    assert infos(rig.register_all())
    head = rig.room(2, [3, 4])  # needs 4: waits
    small = rig.room(3, [5])  # needs 2 (2 are free), but queues behind the head (first come, first served)
    assert not infos(rig.take()) and head.state is small.state is ReceiverState.RESOLVING
    rig.core.close(rig.now)
    out = rig.take()
    assert not infos(out), f"close() sent destinations: {sorted(infos(out))}"
    assert small.poll() is KVPoll.Failed
    for agent in rig.agents():
        rig.status(holder, agent, ok=False, reason="aborted")
    assert [a for a in rig.take() if isinstance(a, act.Closed)]
    assert_nothing_leaks(rig)


def test_a_failed_room_keeps_its_slots_until_a_dead_ranks_lease_runs_out() -> None:
    """A staged rank restarts (topology re-fetched with a new incarnation) while its room holds slots: the
    slots stay taken until the old incarnation's lease ran out, and only then go to the waiting room."""
    rig = Rig(slots=4)
    a = rig.room(1, [0, 1])  # all 4 slots
    sent_a = infos(rig.register_all())
    slots_a = {int(s) for agent in rig.agents() for s in sent_a[(1, agent)].dst_pages}
    restarted = instance(2, prefix="reborn")
    rig.now = 1.0
    rig.core.topology_fetched(ADDR, restarted, rig.now)
    rig.take()
    assert a.state is ReceiverState.FENCING and rig.staging.free_slots == 0
    b = rig.room(2, [3, 4])  # new incarnation: registers anew, then waits for slots
    out = rig.register_all()
    assert not infos(out) and b.state is ReceiverState.RESOLVING
    lease_end = rig.core.deadlines.next()
    assert lease_end is not None and lease_end > rig.now
    rig.tick(lease_end - 1e-3)
    assert a.state is ReceiverState.FENCING and rig.staging.free_slots == 0
    out = rig.tick(lease_end)
    assert a.poll() is KVPoll.Failed
    sent_b = infos(out)
    assert set(sent_b) == {(2, "reborn-0"), (2, "reborn-1")}
    assert {int(s) for m in sent_b.values() for s in m.dst_pages} == slots_a  # the slots it waited for
    rig.succeed(b)
    rig.core.scattered(b, None, rig.now)
    rig.take()
    assert b.poll() is KVPoll.Success
    assert_nothing_leaks(rig)


def test_a_cleared_fencing_room_keeps_its_slots_across_room_id_reuse() -> None:
    rig = Rig(slots=4)
    old = rig.room(1, [0, 1])
    rig.register_all()
    rig.core.clear_receiver(old, rig.now)  # fencing, unseen: its ranks may still write the slots
    new = rig.room(1, [2, 3])  # same id, new epoch: must wait for slots
    assert not infos(rig.take()) and new.state is ReceiverState.RESOLVING
    for agent in rig.agents():  # a status of the *new* epoch from no one yet; the old one's aborts arrive
        rig.status(old, agent, ok=False, reason="aborted")
    out = rig.take()
    assert old.poll() is KVPoll.Failed
    assert set(infos(out)) == {(1, "prefill-0"), (1, "prefill-1")}
    assert all(m.epoch == new.epoch for m in infos(out).values())
    rig.succeed(new)
    rig.core.scattered(new, None, rig.now)
    assert new.poll() is KVPoll.Success
    rig.core.clear_receiver(new, rig.now)
    assert_nothing_leaks(rig)
    assert rig.core.room_counts()["receivers"] == 0


def test_a_room_failing_with_one_rank_done_keeps_slots_until_the_other_answers() -> None:
    rig = Rig(slots=4)
    a = rig.room(1, [0, 1])
    rig.register_all()
    rig.status(a, "prefill-0", ok=True)
    rig.core.abort_receiver(a, InvalidArgument("gone"), rig.now)
    b = rig.room(2, [2, 3])
    assert not infos(rig.take())
    assert a.state is ReceiverState.FENCING and rig.staging.free_slots == 0
    rig.status(a, "prefill-1", ok=False, reason="aborted")
    assert set(infos(rig.take())) == {(2, "prefill-0"), (2, "prefill-1")}
    assert a.poll() is KVPoll.Failed and b.state is ReceiverState.WAITING


def test_a_silent_rank_after_abort_holds_slots_through_the_fence_timeout_and_lease() -> None:
    rig = Rig(slots=4)
    a = rig.room(1, [0, 1])
    rig.register_all()
    rig.core.abort_receiver(a, InvalidArgument("gone"), rig.now)
    rig.status(a, "prefill-0", ok=False, reason="aborted")  # prefill-1 never answers
    rig.room(2, [2, 3])
    rig.take()
    seen_free_while_fencing = False
    t = 0.0
    while a.state is ReceiverState.FENCING and t < 60:
        t += 0.25
        rig.now = t
        rig.ping_all()  # both ranks stay alive; prefill-1 just never answers the abort
        out = rig.tick(t)
        if a.state is ReceiverState.FENCING and (infos(out) or rig.staging.free_slots):
            seen_free_while_fencing = True
    assert not seen_free_while_fencing
    assert a.poll() is KVPoll.Failed


# -- 2/3. leaks and the waiting queue ---------------------------------------------------------------------


def test_declare_dead_of_a_staged_rank_while_rooms_wait_for_slots() -> None:
    rig = Rig(slots=4)
    a = rig.room(1, [0, 1])
    rig.register_all()
    w1 = rig.room(2, [2, 3])
    w2 = rig.room(3, [4])
    rig.take()
    rig.core.receive(Bye("prefill-1", rig.sessions["prefill-1"], "leaving"), rig.now)
    rig.take()
    assert a.poll() is KVPoll.Failed or a.state is ReceiverState.FENCING
    assert w1.poll() is KVPoll.Failed and w2.poll() is KVPoll.Failed
    for agent in ("prefill-0",):
        if a.state is ReceiverState.FENCING:
            rig.status(a, agent, ok=False, reason="aborted")
    rig.take()
    assert a.poll() is KVPoll.Failed
    for r in (a, w1, w2):
        rig.core.clear_receiver(r, rig.now)
    assert_nothing_leaks(rig)


def test_declare_dead_of_a_staged_rank_while_scattering_changes_nothing() -> None:
    rig = Rig(slots=4)
    a = rig.room(1, [0, 1])
    rig.register_all()
    assert scatters(rig.succeed(a))
    rig.core.receive(Bye("prefill-0", rig.sessions["prefill-0"], "leaving"), rig.now)
    rig.core.declare_dead("prefill-1", PeerUnreachable("silent"), rig.now)
    rig.take()
    assert a.state is ReceiverState.SCATTERING and a.poll() is KVPoll.Transferring
    rig.core.scattered(a, None, rig.now)
    assert a.poll() is KVPoll.Success
    rig.core.clear_receiver(a, rig.now)
    assert_nothing_leaks(rig)


def test_waiting_rooms_that_abort_clear_or_time_out_leave_the_queue_in_order() -> None:
    rig = Rig(slots=4, config=Config(waiting_timeout_s=10.0))
    a = rig.room(1, [0, 1])
    rig.register_all()
    assert scatters(rig.succeed(a))  # its copy is slow: it holds every slot until scattered
    rig.now = 5.0
    rig.ping_all()
    w_first = rig.room(2, [2])  # deadline at 15
    rig.now = 8.0
    rig.ping_all()
    w_abort = rig.room(3, [3])
    w_clear = rig.room(4, [4])
    w_last = rig.room(5, [5])  # deadline at 18
    rig.take()
    assert list(rig.core._slot_waiters) == [w_first, w_abort, w_clear, w_last]
    rig.core.abort_receiver(w_abort, InvalidArgument("x"), rig.now)
    rig.core.clear_receiver(w_clear, rig.now)
    assert w_abort.poll() is KVPoll.Failed and w_clear.poll() is KVPoll.Failed
    assert list(rig.core._slot_waiters) == [w_first, w_last]
    rig.now = 15.0
    rig.ping_all()
    rig.tick(15.0)  # the head times out while waiting for slots
    assert w_first.poll() is KVPoll.Failed and list(rig.core._slot_waiters) == [w_last]
    rig.now = 16.0
    rig.ping_all()
    rig.core.scattered(a, None, rig.now)
    assert set(infos(rig.take())) == {(5, "prefill-0"), (5, "prefill-1")}
    rig.succeed(w_last)
    rig.core.scattered(w_last, None, rig.now)
    for r in (a, w_first, w_abort, w_clear, w_last):
        rig.core.clear_receiver(r, rig.now)
    assert_nothing_leaks(rig)
    assert rig.core.room_counts()["receivers"] == 0


def test_a_room_timing_out_while_waiting_for_slots_leaves_the_queue() -> None:
    rig = Rig(slots=4, config=Config(waiting_timeout_s=10.0))
    a = rig.room(1, [0, 1])
    rig.register_all()
    w = rig.room(2, [2])
    w2 = rig.room(3, [3])
    rig.take()
    rig.tick(10.0)  # every room times out: the holder starts fencing, the waiters fail and leave the queue
    assert w.poll() is KVPoll.Failed and w2.poll() is KVPoll.Failed and not rig.core._slot_waiters
    assert a.state is ReceiverState.FENCING and rig.staging.free_slots == 0
    for agent in rig.agents():
        rig.status(a, agent, ok=False, reason="timed out")
    assert a.poll() is KVPoll.Failed
    assert_nothing_leaks(rig)


def test_registration_timeout_of_another_instance_with_rooms_queued_for_slots() -> None:
    rig = Rig(slots=4)
    a = rig.room(1, [0, 1])
    rig.register_all()
    w = rig.room(2, [2, 3])
    rig.take()
    rig.core.topology_fetched(ADDR_B, instance(2, prefix="other", host="10.0.0.2"), rig.now)
    b = rig.room(3, [4], addr=ADDR_B)  # registers with other-0/1, which never answer
    rig.take()
    rig.tick(rig.config.handshake_timeout_s + 0.01)
    assert b.poll() is KVPoll.Failed
    assert w.state is ReceiverState.RESOLVING and list(rig.core._slot_waiters) == [w]
    rig.succeed(a)
    rig.core.scattered(a, None, rig.now)
    assert set(infos(rig.take())) == {(2, "prefill-0"), (2, "prefill-1")}


def check_rows(rig: Rig, pages: list[int], tp: int, fills: dict[str, int]) -> None:
    """Each rank's heads of every entry of ``pages`` hold what ``fill_slots`` wrote for it."""
    rows = rig.kv.reshape(ENTRIES, PAGES, PAGE, HEADS * HEAD_BYTES)
    per_rank = max(1, HEADS // tp)
    for agent, fill in fills.items():
        lo = int(agent.rsplit("-", 1)[1]) * HEADS // tp * HEAD_BYTES
        for e in range(ENTRIES):
            for pos, p in enumerate(pages):
                assert np.all(rows[e, p, :, lo:lo + per_rank * HEAD_BYTES] == (fill + e + pos) % 256), (agent, e, pos)


@pytest.mark.parametrize("first, later", [(2, 2), (2, 4), (2, 8), (4, 8), (2, 16), (8, 16), (4, 2), (16, 2)])
def test_a_larger_tp_shares_the_slots_the_first_shaped_several_of_its_pages_to_a_slot(first: int, later: int) -> None:
    """A TP ``first`` prefill shaped the area (slots of half our heads); a TP ``later`` prefill's ranks
    hold ``r`` times fewer heads than a slot. They register as their own TP with pages of their size,
    ``r`` to a slot, and share each slot ``r`` ranks at a time: a room takes as many slots as one of
    TP2's. Both rooms in flight at once, every rank's heads land in place, nothing else is touched,
    and every slot comes back."""
    rig = Rig(slots=48, tp_prefill=first)
    a = rig.room(1, [0, 1])
    sent = infos(rig.register_all())
    rig.core.topology_fetched(ADDR_B, instance(later, prefix="late", host="10.0.0.2"), rig.now)
    pages = [30, 3, 4, 17]
    b = rig.room(2, pages, addr=ADDR_B)
    sent |= infos(rig.register_all())
    assert rig.staging.slot_heads == HEADS // 2  # (half ours: the largest slice any larger TP sends)
    per_first, per_slot = (HEADS // 2 // max(1, HEADS // tp) for tp in (first, later))
    real_a = [agent for agent, p in a.ranks.items() if not p.dummy]
    real_b = [agent for agent, p in b.ranks.items() if not p.dummy]
    for agent in real_b:
        reg = rig.registers[agent]
        assert (reg.tp_size, reg.kv_head_num) == (later, max(1, HEADS // later))
        assert list(reg.kv_item_lens) == [int(x) // per_slot for x in rig.staging.slot_items]
    held = 2 * -(-len(real_a) // per_first) + len(pages) * -(-len(real_b) // per_slot)
    assert rig.staging.slots - rig.staging.free_slots == held
    told = [k for agent in real_a + real_b for k in sent[(1 if agent in real_a else 2, agent)].dst_pages.tolist()]
    assert len(set(told[:2 * len(real_a)])) == 2 * len(real_a)
    b_pages = {k for agent in real_b for k in sent[(2, agent)].dst_pages.tolist()}
    assert len(b_pages) == len(pages) * len(real_b) and max(b_pages) < rig.staging.slots * per_slot
    fills_a = {agent: 16 * (i + 1) for i, agent in enumerate(real_a)}
    fills_b = {agent: 7 * (i + 3) for i, agent in enumerate(real_b)}
    fill_slots(rig, sent, 1, fills_a)
    fill_slots(rig, sent, 2, fills_b)
    rig.kv[:] = 0xEE
    for r in (b, a):  # (b first: a's copy must not depend on b's)
        [sc] = scatters(rig.succeed(r))
        rig.staging.scatter(r.pages, sc.slices)
        rig.core.scattered(r, None, rig.now)
        assert r.poll() is KVPoll.Success
    check_rows(rig, [0, 1], first, fills_a)
    check_rows(rig, pages, later, fills_b)
    rows = rig.kv.reshape(ENTRIES, PAGES, PAGE, HEADS * HEAD_BYTES)
    assert np.all(rows[:, [p for p in range(PAGES) if p not in [*pages, 0, 1]]] == 0xEE)
    assert_nothing_leaks(rig)


def test_a_larger_tps_room_queues_behind_the_first_tps_and_one_too_large_fails_naming_the_sharing() -> None:
    rig = Rig(slots=4)  # TP2 shapes it: a 2-page room takes all 4 slots
    a = rig.room(1, [0, 1])
    rig.register_all()
    rig.core.topology_fetched(ADDR_B, instance(4, prefix="four", host="10.0.0.2"), rig.now)
    b = rig.room(2, [5, 6], addr=ADDR_B)  # 4 ranks, 2 to a slot: 4 slots, none free
    c = rig.room(3, [7, 8, 9], addr=ADDR_B)  # 6 slots: never
    sent = infos(rig.register_all())
    assert not [k for k in sent if k[0] == 2] and b.state is ReceiverState.RESOLVING
    assert c.poll() is KVPoll.Failed and "needs 6 staging slots (3 pages from each of 4 prefill TP ranks " \
        "holding fewer heads, 2 to a slot), the decode staging area holds 4" in str(c.exception)
    rig.succeed(a)
    rig.core.scattered(a, None, rig.now)
    sent = infos(rig.take())
    assert sorted(sent[(2, f"four-{t}")].dst_pages.tolist() for t in range(4)) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    [sc] = scatters(rig.succeed(b))
    rig.core.scattered(b, None, rig.now)
    assert b.poll() is KVPoll.Success and len(sc.slices) == 4
    assert_nothing_leaks(rig)


def test_a_status_ok_twice_scatters_once() -> None:
    rig = Rig(slots=4)
    a = rig.room(1, [0, 1])
    rig.register_all()
    rig.status(a, "prefill-0")
    rig.status(a, "prefill-0")
    assert a.state is ReceiverState.WAITING
    out = rig.succeed(a, ["prefill-1", "prefill-1"])
    assert len(scatters(out)) == 1
    rig.status(a, "prefill-0")
    assert not scatters(rig.take())


def test_a_status_after_clear_of_a_scattering_room_is_harmless() -> None:
    rig = Rig(slots=4)
    a = rig.room(1, [0, 1])
    rig.register_all()
    rig.succeed(a)
    rig.core.clear_receiver(a, rig.now)
    rig.status(a, "prefill-0", ok=False, reason="late")
    rig.status(a, "prefill-1", ok=True)
    assert a.state is ReceiverState.SCATTERING
    rig.core.scattered(a, None, rig.now)
    assert a.poll() is KVPoll.Success
    assert_nothing_leaks(rig)


def test_scattered_on_a_room_still_waiting_or_resolving_raises() -> None:
    rig = Rig(slots=4)
    a = rig.room(1, [0, 1])
    w = rig.room(2, [2])
    with pytest.raises(ValueError):
        rig.core.scattered(a, None, rig.now)
    rig.register_all()
    with pytest.raises(ValueError):
        rig.core.scattered(a, None, rig.now)
    with pytest.raises(ValueError):
        rig.core.scattered(w, None, rig.now)


# -- 5. the copy ---------------------------------------------------------------------------------------


def fill_slots(rig: Rig, sent: dict[tuple[int, str], TransferInfo], room: int, fills: dict[str, int],
               entries: range | None = None) -> None:
    """Write what each agent's prefill rank would: its pages (as its Register describes them) told in
    ``room``'s TransferInfo, every byte of entry ``e`` of its ``pos``-th page ``fill + e + pos``."""
    stage = rig.staging.buffer
    for agent, fill in fills.items():
        reg = rig.registers[agent]
        for e in entries if entries is not None else range(ENTRIES):
            base, item = reg.kv_ptrs[e] - rig.staging.addr, reg.kv_item_lens[e]
            for pos, k in enumerate(sent[(room, agent)].dst_pages.tolist()):
                stage[base + k * item:base + (k + 1) * item] = (fill + e + pos) % 256


@pytest.mark.parametrize("tp_prefill", [2, 4, 8, 16])
def test_the_copy_lands_each_ranks_heads_in_its_slice_for_every_prefill_tp(tp_prefill: int) -> None:
    rig = Rig(slots=64, tp_prefill=tp_prefill)
    pages = [30, 3, 4, 5, 17]
    r = rig.room(1, pages)
    sent = infos(rig.register_all())
    real = [a for a, p in r.ranks.items() if not p.dummy]
    fills = {agent: 16 * (i + 1) for i, agent in enumerate(real)}
    fill_slots(rig, sent, 1, fills)
    [sc] = scatters(rig.succeed(r))
    rig.kv[:] = 0xEE
    rig.staging.scatter(r.pages, sc.slices)
    rig.core.scattered(r, None, rig.now)
    rows = rig.kv.reshape(ENTRIES, PAGES, PAGE, HEADS * HEAD_BYTES)
    per_rank = max(1, HEADS // tp_prefill)
    for agent in real:
        t = int(agent.rsplit("-", 1)[1])
        head = t * HEADS // tp_prefill
        lo = head * HEAD_BYTES
        for e in range(ENTRIES):
            for pos, p in enumerate(pages):
                assert np.all(rows[e, p, :, lo:lo + per_rank * HEAD_BYTES] == (fills[agent] + e + pos) % 256), \
                    (agent, e, pos)
    others = [p for p in range(PAGES) if p not in pages]
    assert np.all(rows[:, others] == 0xEE)
    assert_nothing_leaks(rig)


def test_the_copy_with_fragmented_slots_and_scrambled_pages() -> None:
    rig = Rig(slots=12)
    rooms = [rig.room(i, [i]) for i in range(1, 6)]  # 10 slots: 0..9
    rig.register_all()
    for r in rooms[::2]:  # free slots of rooms 1, 3, 5: holes
        rig.core.abort_receiver(r, InvalidArgument("x"), rig.now)
        for agent in rig.agents():
            rig.status(r, agent, ok=False, reason="aborted")
    rig.take()
    free = rig.staging.free_slots
    assert free == 8
    pages = [20, 2, 11, 9]  # 4 pages x 2 ranks = 8 slots over three holes
    big = rig.room(9, pages)
    sent = infos(rig.take())
    assert set(sent) == {(9, "prefill-0"), (9, "prefill-1")}
    fill_slots(rig, sent, 9, {"prefill-0": 0x10, "prefill-1": 0x80})
    [sc] = scatters(rig.succeed(big))
    rig.kv[:] = 0xEE
    rig.staging.scatter(big.pages, sc.slices)
    rows = rig.kv.reshape(ENTRIES, PAGES, PAGE, HEADS * HEAD_BYTES)
    half = HEADS * HEAD_BYTES // 2
    for e in range(ENTRIES):
        for pos, p in enumerate(pages):
            assert np.all(rows[e, p, :, :half] == (0x10 + e + pos) % 256)
            assert np.all(rows[e, p, :, half:] == (0x80 + e + pos) % 256)
    assert np.all(rows[:, [q for q in range(PAGES) if q not in pages]] == 0xEE)


def after_a_room_left_its_rows(rig: Rig) -> tuple[Any, dict[tuple[int, str], TransferInfo]]:
    """Room 1 on pages [0, 1] written whole and copied; then room 2 on pages [5, 6], which takes the same
    four slots (still holding room 1's rows), and what it sent."""
    a = rig.room(1, [0, 1])
    sent = infos(rig.register_all())
    fill_slots(rig, sent, 1, {"prefill-0": 0x10, "prefill-1": 0x80})
    [sc] = scatters(rig.succeed(a))
    rig.staging.scatter(a.pages, sc.slices)
    rig.core.scattered(a, None, rig.now)
    b = rig.room(2, [5, 6])
    sent = infos(rig.take())
    assert {int(s) for m in sent.values() for s in m.dst_pages} == {0, 1, 2, 3}
    return b, sent


def test_an_entry_left_unwritten_by_this_room_is_not_copied_even_if_the_slots_held_an_earlier_rooms_rows() -> None:
    rig = Rig(slots=4)
    b, sent = after_a_room_left_its_rows(rig)  # prefill-0 writes only entry 0, prefill-1 nothing
    fill_slots(rig, sent, 2, {"prefill-0": 0x40}, entries=range(1))
    [sc] = scatters(rig.succeed(b))
    rig.kv[:] = 0xEE
    assert rig.staging.scatter(b.pages, sc.slices) == 1
    rows = rig.kv.reshape(ENTRIES, PAGES, PAGE, HEADS * HEAD_BYTES)
    half = HEADS * HEAD_BYTES // 2
    assert np.all(rows[0, 5, :, :half] == 0x40) and np.all(rows[0, 6, :, :half] == 0x41)
    assert np.all(rows[0, [5, 6], :, half:] == 0xEE) and np.all(rows[1:] == 0xEE)


def test_a_page_a_rank_claims_but_left_unwritten_keeps_its_contents_not_an_earlier_rooms_rows(
        caplog: pytest.LogCaptureFixture) -> None:
    """A lying (or broken) prefill reports success having written only the first of its pages: the
    slot of the second still holds room a's rows, and they must not land in room b's page."""
    rig = Rig(slots=4)
    b, sent = after_a_room_left_its_rows(rig)  # prefill-0 writes its first slot only, prefill-1 both
    stage, half_item = rig.staging.buffer, ITEM // 2
    fill_slots(rig, sent, 2, {"prefill-1": 0xC0})
    k = int(sent[(2, "prefill-0")].dst_pages[0])
    for e in range(ENTRIES):
        base = int(rig.staging._bases[e])
        stage[base + k * half_item:base + (k + 1) * half_item] = 0x40 + e
    [sc] = scatters(rig.succeed(b))
    rig.kv[:] = 0xEE
    with caplog.at_level(logging.WARNING, "asynckv.decode"):
        assert rig.staging.scatter(b.pages, sc.slices) == 2 * ENTRIES
    assert [r.getMessage() for r in caplog.records] == [  # one line per rank, not per entry
        f"prefill prefill- left staged pages unwritten in {ENTRIES} entries ({ENTRIES} pages in all); those pages "
        f"are not copied"]
    rows = rig.kv.reshape(ENTRIES, PAGES, PAGE, HEADS * HEAD_BYTES)
    half = HEADS * HEAD_BYTES // 2
    for e in range(ENTRIES):
        assert np.all(rows[e, 5, :, :half] == 0x40 + e)
        assert np.all(rows[e, 6, :, :half] == 0xEE), "an earlier room's rows were copied into a page never written"
        assert np.all(rows[e, 5, :, half:] == (0xC0 + e) % 256) and np.all(rows[e, 6, :, half:] == (0xC1 + e) % 256)


# -- 6. every real rank counts --------------------------------------------------------------------------------


def test_success_needs_every_real_rank_of_a_replicated_tp16_prefill() -> None:
    rig = Rig(slots=32, tp_prefill=16)
    r = rig.room(1, [0, 1])
    sent = infos(rig.register_all())
    real = [a for a, p in r.ranks.items() if not p.dummy]
    dummies = [a for a, p in r.ranks.items() if p.dummy]
    assert len(real) == 8 and len(dummies) == 8
    assert all(len(sent[(1, d)].dst_pages) == 0 for d in dummies)
    assert rig.staging.free_slots == rig.staging.slots - 2 * 2  # (slots of 4 heads: 4 real ranks a slot)
    for d in dummies:
        rig.status(r, d)
    rig.succeed(r, real[:-1])
    assert r.state is ReceiverState.WAITING
    assert scatters(rig.succeed(r, real[-1:]))


def test_decode_tp2_rank1_with_prefill_tp4_registers_as_engine_ranks_2_and_3() -> None:
    rig = Rig(slots=8, tp_prefill=4, tp=2, engine_rank=1)
    r = rig.room(1, [0, 1])
    sent = infos(rig.register_all())
    assert {agent for (_, agent) in sent} == {"prefill-2", "prefill-3"}
    assert {rig.registers[a].engine_rank for a in ("prefill-2", "prefill-3")} == {2, 3}
    fill_slots(rig, sent, 1, {"prefill-2": 0x10, "prefill-3": 0x80})
    [sc] = scatters(rig.succeed(r))
    rig.staging.scatter(r.pages, sc.slices)
    rows = rig.kv.reshape(ENTRIES, PAGES, PAGE, HEADS * HEAD_BYTES)
    half = HEADS * HEAD_BYTES // 2
    assert np.all(rows[0, 0, :, :half] == 0x10) and np.all(rows[0, 0, :, half:] == 0x80)


def test_close_is_not_held_up_by_a_destination_close_itself_sent() -> None:
    """The consequence of the above: once the only room that was in flight before close() is fenced,
    close should be done; it instead waits for the prefill to answer the abort of a room whose
    destination went out during close()."""
    rig = Rig(slots=8)
    holder = rig.room(1, [0, 1, 2])
    rig.register_all()
    rig.room(2, [3, 4])
    small = rig.room(3, [5])
    rig.take()
    rig.core.close(rig.now)
    rig.take()
    for agent in rig.agents():
        rig.status(holder, agent, ok=False, reason="aborted")
    out = rig.take()
    assert [a for a in out if isinstance(a, act.Closed)], f"close still waits on room 3 ({small.state.name})"


def test_a_restart_fails_rooms_queued_for_slots_and_holders_keep_slots_until_the_lease() -> None:
    rig = Rig(slots=4)
    a = rig.room(1, [0, 1])
    rig.register_all()
    w = rig.room(2, [2, 3])
    rig.take()
    rig.now = 0.5
    rig.core.topology_fetched(ADDR, instance(2, prefix="reborn"), rig.now)
    rig.take()
    assert w.poll() is KVPoll.Failed and not rig.core._slot_waiters
    assert a.state is ReceiverState.FENCING and rig.staging.free_slots == 0
    rig.tick(rig.core.deadlines.next() or 0.0)
    assert a.poll() is KVPoll.Failed
    for r in (a, w):
        rig.core.clear_receiver(r, rig.now)
    assert_nothing_leaks(rig)
    assert rig.core.room_counts()["receivers"] == 0


def test_aborting_the_head_waiter_lets_the_next_one_go_on() -> None:
    rig = Rig(slots=8)
    rig.room(1, [0, 1, 2])  # 6 of 8
    rig.register_all()
    head = rig.room(2, [3, 4])
    nxt = rig.room(3, [5])
    rig.take()
    rig.core.abort_receiver(head, InvalidArgument("x"), rig.now)
    assert head.poll() is KVPoll.Failed
    assert set(infos(rig.take())) == {(3, "prefill-0"), (3, "prefill-1")} and nxt.state is ReceiverState.WAITING


def test_close_during_a_failing_copy() -> None:
    rig = Rig(slots=4)
    a = rig.room(1, [0, 1])
    rig.register_all()
    rig.succeed(a)
    rig.core.close(rig.now)
    assert not [x for x in rig.take() if isinstance(x, act.Closed)]
    rig.core.scattered(a, RuntimeError("copy raised"), rig.now)
    assert a.poll() is KVPoll.Failed and [x for x in rig.take() if isinstance(x, act.Closed)]
    assert_nothing_leaks(rig)


def test_a_room_with_one_staged_and_one_per_token_rank_needs_both_and_copies_only_the_staged_one() -> None:
    """White-box set-up (the service never mixes them within one instance): prefill-1's registration is
    per token, prefill-0's staged."""
    rig = Rig(slots=4)
    r = rig.room(1, [6, 7])
    rig.take()
    rig.core.registrations["prefill-1"].staged = False
    sent = infos(rig.register_all())
    assert sent[(1, "prefill-1")].dst_pages.tolist() == [6, 7]
    assert len(sent[(1, "prefill-0")].dst_pages) == 2 and rig.staging.free_slots == 2
    fill_slots(rig, sent, 1, {"prefill-0": 0x10})
    rows = rig.kv.reshape(ENTRIES, PAGES, PAGE, HEADS * HEAD_BYTES)
    half = HEADS * HEAD_BYTES // 2
    rows[:, [6, 7], :, half:] = 0x99  # what prefill-1 wrote in place
    assert not scatters(rig.succeed(r, ["prefill-0"])) and r.state is ReceiverState.WAITING
    [sc] = scatters(rig.succeed(r, ["prefill-1"]))
    assert [s.agent_id for s in sc.slices] == ["prefill-0"]
    rig.staging.scatter(r.pages, sc.slices)
    rig.core.scattered(r, None, rig.now)
    assert np.all(rows[:, [6, 7], :, half:] == 0x99) and np.all(rows[0, 6, :, :half] == 0x10)
    assert r.poll() is KVPoll.Success
    assert_nothing_leaks(rig)


def test_rooms_timing_out_together_while_waiting_for_slots_send_no_destination() -> None:
    """The same cascade on a timer: two waiters time out at one tick; the head's failure hands the free
    slots to the second one, whose destination goes out, and it is then failed by the same tick (its
    timeout was already due): a transfer started for a room already timed out."""
    rig = Rig(slots=8, config=Config(waiting_timeout_s=10.0))
    holder = rig.room(1, [0, 1, 2])  # 6 of 8 slots; its copy is slow (SCATTERING has no deadline)
    rig.register_all()
    assert scatters(rig.succeed(holder))
    head = rig.room(2, [3, 4])  # needs 4: waits
    small = rig.room(3, [5])  # needs 2: waits behind it
    assert not infos(rig.take()) and list(rig.core._slot_waiters) == [head, small]
    out = rig.tick(10.0)
    assert head.poll() is KVPoll.Failed
    assert not infos(out), f"destinations sent at the tick that timed the rooms out: {sorted(infos(out))}"
    assert small.poll() is KVPoll.Failed, small.state.name


def test_peers_declared_dead_together_hand_no_slots_to_a_room_of_the_next_dead_peer() -> None:
    """One heartbeat tick finds two instances silent: the first one's room fails and frees its slots (its
    leases ran out long ago); a room of the second, queued for slots, must not get its destination sent to
    a peer the same tick declares dead next."""
    rig = Rig(slots=4)
    holder = rig.room(1, [0, 1])  # all 4 slots
    rig.register_all()
    rig.core.topology_fetched(ADDR_B, instance(2, prefix="other", host="10.0.0.2"), rig.now)
    queued = rig.room(2, [2, 3], addr=ADDR_B)
    rig.register_all()
    assert list(rig.core._slot_waiters) == [queued] and holder.state is ReceiverState.WAITING
    out: list[act.Action] = []
    for step in range(1, 40):  # nobody answers: every prefill rank goes silent past the heartbeat bound
        out += rig.tick(step * 0.25)
    assert holder.poll() is KVPoll.Failed and queued.poll() is KVPoll.Failed
    assert not infos(out), f"destinations sent to peers declared dead in the same tick: {sorted(infos(out))}"
    assert_nothing_leaks(rig)
