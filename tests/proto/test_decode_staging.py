"""Decode staging rules, driven directly on a ``DecodeCore`` (TP2 prefill -> TP1 decode, 8 heads,
``staging_rig``): what each prefill rank is told, when slots are taken and given back, the order of
waiting rooms, and what the copy leaves alone. The area is real memory (``DecodeStaging``)."""

from __future__ import annotations

import numpy as np
import pytest

from asynckv.errors import InvalidArgument, LocalProtocolError
from asynckv.proto import actions as act
from asynckv.proto.messages import Register, RegisterResult, Status
from asynckv.proto.states import KVPoll, ReceiverState

from .harness import state_of
from .staging_rig import HEAD_BYTES, HEADS, ITEM, LAYERS, ME, PAGE, PAGES, Rig, infos, prank, scatters


def test_each_prefill_rank_sees_a_decode_of_its_own_tp_whose_pages_are_staging_slots() -> None:
    rig = Rig()
    rig.room(1, [5, 9, 2])
    regs = [a.msg for a in rig.take() if isinstance(a, act.Send) and isinstance(a.msg, Register)]
    assert {r.prefill_id for r in regs} == {"prefill-0", "prefill-1"}
    for reg in regs:  # as a TP2 decode holding that rank's 4 heads would register
        assert (reg.tp_size, reg.engine_rank, reg.kv_head_num) == (2, int(reg.prefill_id[-1]), 4)
        assert reg.kv_item_lens == (ITEM // 2,) * (2 * LAYERS)
        assert reg.kv_ptrs[0] == rig.staging.addr and all(n == rig.staging.slots * ITEM // 2 for n in reg.kv_lens)
        assert reg.kv_layer_ids == tuple(range(2 * LAYERS)) and reg.total_kv_head_num == HEADS
    for agent in ("prefill-0", "prefill-1"):
        rig.core.receive(RegisterResult(agent, ME, rig.sessions[agent], True, ""), rig.now)
    sent = infos(rig.take())
    slots = {agent: sent[(1, agent)].dst_pages.tolist() for agent in ("prefill-0", "prefill-1")}
    assert slots == {"prefill-0": [0, 1, 2], "prefill-1": [3, 4, 5]}  # each its own slots, in page order
    assert rig.staging.free_slots == rig.staging.slots - 6


def test_success_waits_for_the_copy_and_the_copy_lands_each_ranks_heads_in_its_slice() -> None:
    rig = Rig()
    r = rig.room(1, [5, 9, 2])
    sent = infos(rig.register_all())
    stage = rig.staging.buffer
    half = ITEM // 2
    for agent, fill in (("prefill-0", 0x11), ("prefill-1", 0x22)):  # what each rank's write would leave
        for e in range(2 * LAYERS):
            base = int(rig.staging._bases[e])
            for k in sent[(1, agent)].dst_pages.tolist():
                stage[base + k * half:base + (k + 1) * half] = fill + e
    out = rig.succeed(r)
    [scatter] = [a for a in out if isinstance(a, act.Scatter)]
    assert r.state is ReceiverState.SCATTERING and r.poll() is KVPoll.Transferring
    assert not [a for a in out if isinstance(a, act.Finished)]
    assert rig.staging.scatter(r.pages, scatter.slices) == 2 * 2 * LAYERS
    rig.core.scattered(r, None, rig.now)
    assert r.poll() is KVPoll.Success and [a for a in rig.take() if isinstance(a, act.Finished)]
    rows = rig.kv.reshape(2 * LAYERS, PAGES, PAGE, HEADS * HEAD_BYTES)
    row = HEADS * HEAD_BYTES // 2
    for e in range(2 * LAYERS):
        assert np.all(rows[e, [5, 9, 2], :, :row] == 0x11 + e)  # heads 0-3 from rank 0
        assert np.all(rows[e, [5, 9, 2], :, row:] == 0x22 + e)  # heads 4-7 from rank 1
        assert not np.any(rows[e, [0, 1, 3, 4, 6, 7, 8, 10]])  # no other page touched
    assert rig.staging.free_slots == rig.staging.slots


def test_an_entry_a_rank_did_not_write_is_not_copied() -> None:
    rig = Rig()
    r = rig.room(1, [3])
    sent = infos(rig.register_all())
    k = int(sent[(1, "prefill-0")].dst_pages[0])
    base = int(rig.staging._bases[0])
    rig.staging.buffer[base + k * ITEM // 2:base + (k + 1) * ITEM // 2] = 7  # rank 0 wrote entry 0 only
    [scatter] = [a for a in rig.succeed(r) if isinstance(a, act.Scatter)]
    rig.kv[:] = 0xEE
    assert rig.staging.scatter(r.pages, scatter.slices) == 1
    rows = rig.kv.reshape(2 * LAYERS, PAGES, PAGE, HEADS * HEAD_BYTES)
    assert np.all(rows[0, 3, :, :ITEM // PAGE // 2] == 7) and np.all(rows[0, 3, :, ITEM // PAGE // 2:] == 0xEE)
    assert np.all(rows[1:] == 0xEE)


def test_rooms_wait_for_slots_in_arrival_order_and_go_on_as_rooms_finish() -> None:
    rig = Rig(slots=8)  # 4 pages a room take 8 slots: one room at a time
    first = rig.room(1, [0, 1, 2, 3])
    assert infos(rig.register_all())
    second = rig.room(2, [4, 5, 6, 7])
    third = rig.room(3, [8])
    assert not infos(rig.take()) and second.state is third.state is ReceiverState.RESOLVING
    assert rig.core.room_counts()["waiting_for_staging"] == 2
    assert [a for a in rig.succeed(first) if isinstance(a, act.Scatter)]
    assert not infos(rig.take())  # the copy has not given the slots back yet
    rig.core.scattered(first, None, rig.now)
    assert set(infos(rig.take())) == {(2, "prefill-0"), (2, "prefill-1")}  # the second, not the smaller third
    assert third.state is ReceiverState.RESOLVING
    rig.core.abort_receiver(second, InvalidArgument("gone"), rig.now)  # fencing: its slots stay taken
    assert not infos(rig.take()) and state_of(second) is ReceiverState.FENCING
    for agent in ("prefill-0", "prefill-1"):
        rig.core.receive(Status(2, second.epoch, agent, rig.sessions[agent], 0, False, "aborted"), rig.now)
    assert second.poll() is KVPoll.Failed
    assert set(infos(rig.take())) == {(3, "prefill-0"), (3, "prefill-1")}
    rig.succeed(third)
    rig.core.scattered(third, RuntimeError("copy failed"), rig.now)
    assert third.poll() is KVPoll.Failed and third.reason == "copy failed"
    assert rig.staging.free_slots == rig.staging.slots
    assert rig.core.room_counts() == {"receivers": 3, "fencing_rooms": 0, "registrations_pending": 0,
                                      "topology_lookups": 0, "waiting_for_staging": 0}


def test_a_room_larger_than_the_area_fails_at_once_naming_the_setting() -> None:
    rig = Rig(slots=4)
    rig.take()
    r = rig.room(1, [0, 1, 2])  # 2 ranks x 3 pages
    rig.register_all()
    assert r.poll() is KVPoll.Failed and "decode_staging_bytes" in (r.reason or "")
    assert rig.staging.free_slots == rig.staging.slots


def test_a_room_cleared_while_copying_finishes_unseen_and_close_waits_for_it() -> None:
    rig = Rig()
    r = rig.room(1, [0, 1])
    rig.register_all()
    rig.succeed(r)
    rig.core.clear_receiver(r, rig.now)
    rig.core.close(rig.now)
    assert not [a for a in rig.take() if isinstance(a, act.Closed)]  # the copy still writes its pages
    assert rig.core.room_counts()["fencing_rooms"] == 1
    rig.core.scattered(r, None, rig.now)
    assert [a for a in rig.take() if isinstance(a, act.Closed)]
    assert rig.staging.free_slots == rig.staging.slots and rig.core.room_counts()["fencing_rooms"] == 0


def test_abort_of_a_room_being_copied_changes_nothing() -> None:
    rig = Rig()
    r = rig.room(1, [0])
    rig.register_all()
    rig.succeed(r)
    rig.core.abort_receiver(r, InvalidArgument("late"), rig.now)
    assert r.state is ReceiverState.SCATTERING and not [a for a in rig.take() if isinstance(a, act.Send)]
    rig.core.scattered(r, None, rig.now)
    assert r.poll() is KVPoll.Success
    with pytest.raises(ValueError, match="not scattering"):
        rig.core.scattered(r, None, rig.now)


@pytest.mark.parametrize("tp_prefill, usable", [(1, False), (2, True), (4, True), (8, True), (16, True)])
def test_the_area_is_shaped_once_for_half_our_heads_and_every_larger_tp_shares_it(tp_prefill: int,
                                                                                   usable: bool) -> None:
    """Whatever larger TP registers first, slots hold half our heads (the largest slice a larger TP sends);
    every larger TP then shares them, its pages of its own size, ``4 / its heads`` to a slot; TP1 does not."""
    rig = Rig()
    assert rig.staging.usable(tp_prefill) is usable  # (16: one head per rank, each held by two ranks)
    if not usable:
        return
    assert rig.staging.tp_prefill == tp_prefill and rig.staging.slot_heads == HEADS // 2
    assert rig.staging.slot_items.tolist() == [ITEM // 2] * (2 * LAYERS)
    slots = np.array([0, 1, 5], dtype=np.int32)
    for later in (1, 2, 4, 8, 16):
        heads = max(1, HEADS // later)
        assert rig.staging.usable(later) is (later > 1), later
        if later > 1:
            fields = rig.staging.register_fields(prank(later, later - 1))
            assert fields["kv_item_lens"] == (ITEM * heads // HEADS,) * (2 * LAYERS)
            assert fields["kv_lens"] == (ITEM // 2 * rig.staging.slots,) * (2 * LAYERS)  # the same area
            assert (fields["tp_size"], fields["engine_rank"], fields["kv_head_num"]) == (later, later - 1, heads)
            r = 4 // heads
            assert rig.staging.per_slot(later) == r
            # (slots 0-1 and 5: two runs; the last of r ranks gets the last block of each)
            assert rig.staging.part(prank(later, 0), slots, r - 1).indices.tolist() == [2 * r - 2, 2 * r - 1, 6 * r - 1]
            with pytest.raises(LocalProtocolError, match="rank"):
                rig.staging.part(prank(later, 0), slots, r)
        else:
            with pytest.raises(LocalProtocolError, match=f"TP {later}"):
                rig.staging.register_fields(prank(later, 0))


def test_a_pp_prefills_stages_share_their_tp_ranks_slots_and_each_rank_is_copied_once() -> None:
    """Prefill TP2 PP2: the two stages of a TP rank write other entries (their own layers) of the same
    slots, so a room takes pages x 2 slots, not x 4; success needs all four, and each TP rank's slots
    are copied once, every entry of both stages in place."""
    rig = Rig(slots=8, pp_prefill=2)
    r = rig.room(1, [5, 9])
    sent = infos(rig.register_all())
    assert set(sent) == {(1, a) for a in ("prefill-0", "prefill-1", "prefill-s1-0", "prefill-s1-1")}
    for t in (0, 1):
        assert sent[(1, f"prefill-{t}")].dst_pages.tolist() == sent[(1, f"prefill-s1-{t}")].dst_pages.tolist()
    assert rig.staging.free_slots == rig.staging.slots - 4
    half = ITEM // 2
    for (_, agent), info in sent.items():  # stage 0 writes entries 0 and 2 (K and V of layer 0), stage 1 the others
        stage, t = int("-s1-" in agent), int(agent[-1])
        for e in (stage, stage + 2):
            base = int(rig.staging._bases[e])
            for k in info.dst_pages.tolist():
                rig.staging.buffer[base + k * half:base + (k + 1) * half] = 0x10 * (t + 1) + e
    assert not scatters(rig.succeed(r, ["prefill-0", "prefill-1", "prefill-s1-0"]))
    assert r.state is ReceiverState.WAITING
    [scatter] = scatters(rig.succeed(r, ["prefill-s1-1"]))
    assert sorted(s.agent_id[-1] for s in scatter.slices) == ["0", "1"]  # one slice per TP rank
    assert rig.staging.scatter(r.pages, scatter.slices) == 2 * 2 * LAYERS
    rig.core.scattered(r, None, rig.now)
    assert r.poll() is KVPoll.Success and rig.staging.free_slots == rig.staging.slots
    rows = rig.kv.reshape(2 * LAYERS, PAGES, PAGE, HEADS * HEAD_BYTES)
    row = HEADS * HEAD_BYTES // 2
    for e in range(2 * LAYERS):
        assert np.all(rows[e, [5, 9], :, :row] == 0x10 + e) and np.all(rows[e, [5, 9], :, row:] == 0x20 + e)
