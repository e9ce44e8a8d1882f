"""Decode staging with PP prefills, the unwritten-slot markers, and who writes replicated hybrid
state: scripted interleavings from an adversarial review (every order of a room's statuses, events
while waiting for slots and while scattering, restarts of one stage, random differential checks of
the copy against a per-slot reference). Deterministic: the core takes ``now`` explicitly.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, cast

import numpy as np
import pytest

from asynckv.config import Config
from asynckv.errors import InvalidArgument, PeerUnreachable
from asynckv.layout import KVArgs
from asynckv.proto import actions as act
from asynckv.proto.decode_staging import StagedSlice
from asynckv.proto.messages import Bye, Status
from asynckv.proto.registration import state_rank
from asynckv.proto.states import KVPoll, ReceiverState
from asynckv.proto.topology import PrefillInstance, first_writer, plan_peer, plan_targets, stub_agent_metadata
from asynckv.service.decode_staging import MARK, DecodeStaging

from .harness import state_of
from .staging_rig import (
    ADDR,
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
    prank,
    scatters,
)

PP_AGENTS = ("prefill-0", "prefill-1", "prefill-s1-0", "prefill-s1-1")


def finished(out: list[act.Action]) -> list[act.Finished]:
    return [a for a in out if isinstance(a, act.Finished)]


class GiveCounter:
    """Wraps ``staging.give``/``take`` to count and check that a slot is never given twice or while free."""

    def __init__(self, rig: Rig) -> None:
        self.rig, self.given = rig, 0
        self.taken: set[int] = set()
        staging = rig.staging
        real_take, real_give = staging.take, staging.give

        def take(n: int) -> Any:
            got = real_take(n)
            if got is not None:
                s = {int(x) for x in got}
                assert not (s & self.taken), f"slots {sorted(s & self.taken)} taken twice"
                self.taken |= s
            return got

        def give(slots: Any) -> None:
            s = {int(x) for x in slots}
            assert s <= self.taken, f"slots {sorted(s - self.taken)} given back while free"
            self.taken -= s
            self.given += 1
            real_give(slots)
            assert staging.free_slots + len(self.taken) == staging.slots

        staging.take, staging.give = take, give  # type: ignore[method-assign]


# ------------------------------------------------------------------------------------------------------
# Promise 1: PP stages share their TP rank's slots
# ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pp", [1, 2, 3])
def test_pp_room_takes_pages_times_tp_slots_whatever_the_pp(pp: int) -> None:
    """Slots needed = pages x staged TP ranks, never x PP: 2 pages from TP2 fit an area of exactly 4
    slots; 3 pages (6 slots) fail at once naming the setting."""
    rig = Rig(slots=4, pp_prefill=pp)
    r = rig.room(1, [0, 1])
    sent = infos(rig.register_all())
    assert len(sent) == 2 * pp and r.state is ReceiverState.WAITING
    assert rig.staging.free_slots == 0
    for t in (0, 1):  # every stage of TP rank t is told the same slots
        per_stage = {tuple(m.dst_pages.tolist()) for (_, agent), m in sent.items()
                     if agent.rsplit("-", 1)[1] == str(t)}
        assert len(per_stage) == 1
    [sc] = scatters(rig.succeed(r))
    assert len(sc.slices) == 2  # one per TP rank
    rig.core.scattered(r, None, rig.now)
    assert r.poll() is KVPoll.Success
    too_big = rig.room(2, [0, 1, 2])
    rig.take()
    assert too_big.poll() is KVPoll.Failed and "decode_staging_bytes" in (too_big.reason or "")
    assert_nothing_leaks(rig)


def _pp_holder_and_waiter(slots: int = 4, config: Config | None = None) -> tuple[Rig, Any, Any, GiveCounter]:
    rig = Rig(slots=slots, pp_prefill=2, config=config)
    counter = GiveCounter(rig)
    a = rig.room(1, [0, 1])  # 4 slots: all of them
    assert set(infos(rig.register_all())) == {(1, x) for x in PP_AGENTS}
    b = rig.room(2, [2, 3])
    assert not infos(rig.take()) and list(rig.core._slot_waiters) == [b]
    return rig, a, b, counter


@pytest.mark.parametrize("failing", PP_AGENTS)
def test_pp_every_order_of_statuses_with_one_failure_keeps_slots_until_the_last_answer(failing: str) -> None:
    """Every order of the four PP ranks' statuses, one of them a failure (so a stage fails before or
    after its TP twin / the other stage succeeded): the room never scatters, the slots stay taken
    until every rank that got the destination answered, are given back once, and go to the waiter."""
    for order in itertools.permutations(PP_AGENTS):
        rig, a, b, counter = _pp_holder_and_waiter()
        for i, agent in enumerate(order):
            rig.status(a, agent, ok=agent != failing, reason="boom")
            out = rig.take()
            assert not scatters(out), order
            if i < len(order) - 1:
                assert not infos(out) and rig.staging.free_slots == 0, (order, i)
                assert a.poll() is not KVPoll.Success
            else:
                assert a.poll() is KVPoll.Failed, order
                assert set(infos(out)) == {(2, x) for x in PP_AGENTS}, order
        assert counter.given == 2  # one give per TP rank's slots, once
        assert b.state is ReceiverState.WAITING


def test_pp_duplicate_statuses_from_one_stage_do_not_stand_in_for_the_other_stage() -> None:
    rig, a, _, counter = _pp_holder_and_waiter()
    for _ in range(3):
        rig.status(a, "prefill-0")
        rig.status(a, "prefill-1")
    rig.status(a, "prefill-s1-0")
    assert a.state is ReceiverState.WAITING and not scatters(rig.take())
    [sc] = scatters(rig.succeed(a, ["prefill-s1-1", "prefill-s1-1"]))
    assert len(sc.slices) == 2
    rig.status(a, "prefill-s1-1")
    rig.status(a, "prefill-0", ok=False, reason="late")  # late failure while SCATTERING: nothing
    assert state_of(a) is ReceiverState.SCATTERING and not scatters(rig.take()) and counter.given == 0
    rig.core.scattered(a, None, rig.now)
    assert a.poll() is KVPoll.Success and counter.given == 2
    assert set(infos(rig.take())) == {(2, x) for x in PP_AGENTS}


def test_pp_a_forged_sender_rank_cannot_count_for_another_stage() -> None:
    """prefill-0 reports success under stage 1's sender rank: it still counts once, as itself (each
    agent's first status ends it); the room does not succeed before prefill-s1-0 itself reported."""
    rig, a, _, _ = _pp_holder_and_waiter()
    # stage 1 TP 0 numbers itself 0 * 2 + 1 = 1
    rig.core.receive(Status(1, a.epoch, "prefill-0", rig.sessions["prefill-0"], 1, True, ""), rig.now)
    rig.core.receive(Status(1, a.epoch, "prefill-0", rig.sessions["prefill-0"], 0, True, ""), rig.now)
    rig.succeed(a, ["prefill-1", "prefill-s1-1"])
    assert a.state is ReceiverState.WAITING, "succeeded with prefill-s1-0 silent"


def test_pp_a_forged_sender_rank_does_not_stall_the_room_when_everyone_reported() -> None:
    """A rank naming another's ``sender_rank`` in its status: successes count by agent (the session the
    status carries), so the other's own success still counts and the room does not wait for a timeout
    (it did while they counted by sender_rank)."""
    rig, a, _, _ = _pp_holder_and_waiter()
    rig.core.receive(Status(1, a.epoch, "prefill-0", rig.sessions["prefill-0"], 1, True, ""), rig.now)
    rig.succeed(a, ["prefill-1", "prefill-s1-0", "prefill-s1-1"])
    assert a.state is ReceiverState.SCATTERING


def _stage1_restarted() -> PrefillInstance:
    """Stage 0 as before; stage 1's ranks restarted (new agent ids)."""
    ranks = {(0, t, 0): prank(2, t, pp_size=2, pp=0) for t in (0, 1)}
    ranks |= {(0, t, 1): prank(2, t, prefix="reborn", pp_size=2, pp=1) for t in (0, 1)}
    base = instance(2, pp_size=2)
    return dataclasses.replace(base, ranks=ranks)


@pytest.mark.parametrize("stage0_first", [True, False])
def test_pp_only_stage1_restarts_slots_wait_for_stage0_answers_and_stage1_leases(stage0_first: bool) -> None:
    rig, a, b, counter = _pp_holder_and_waiter()
    rig.now = 0.5
    rig.core.topology_fetched(ADDR, _stage1_restarted(), rig.now)
    rig.take()
    assert a.state is ReceiverState.FENCING and b.poll() is KVPoll.Failed  # (b planned on the old stage 1)
    lease_end = max(a.ranks[x].fenced_at or 0.0 for x in ("prefill-s1-0", "prefill-s1-1"))
    assert lease_end > rig.now and all(a.ranks[x].fenced_at is None for x in ("prefill-0", "prefill-1"))
    assert lease_end < rig.now + rig.config.fence_timeout_s
    c = rig.room(3, [4, 5])
    rig.register_all()
    assert c.state is ReceiverState.RESOLVING and rig.staging.free_slots == 0
    if stage0_first:
        rig.status(a, "prefill-0", ok=False, reason="aborted")
        rig.status(a, "prefill-1", ok=False, reason="aborted")
        assert not infos(rig.take()) and rig.staging.free_slots == 0  # stage 1's lease still runs
        rig.now = lease_end - 1e-3
        rig.ping_all()
        assert not infos(rig.tick(lease_end - 1e-3)) and rig.staging.free_slots == 0
        rig.now = lease_end
        rig.ping_all()
        out = rig.tick(lease_end)
    else:
        rig.now = lease_end + 0.1
        rig.ping_all()
        out = rig.tick(lease_end + 0.1)
        assert a.state is ReceiverState.FENCING and not infos(out) and rig.staging.free_slots == 0
        rig.status(a, "prefill-0", ok=False, reason="aborted")
        assert not infos(rig.take()) and rig.staging.free_slots == 0
        rig.status(a, "prefill-1", ok=False, reason="aborted")
        out = rig.take()
    assert a.poll() is KVPoll.Failed and counter.given == 2
    assert set(infos(out)) == {(3, x) for x in ("prefill-0", "prefill-1", "reborn-s1-0", "reborn-s1-1")}


WAIT_EVENTS = ["abort", "clear", "close", "timeout", "bye_stage1", "dead_stage1"]


@pytest.mark.parametrize("event", WAIT_EVENTS)
def test_pp_events_while_waiting_for_slots(event: str) -> None:
    """A PP room queued for slots fails for every reason without ever sending a destination; the
    holder's slots stay until its own fence, then go to whoever is still queued (nobody after close)."""
    rig, a, b, counter = _pp_holder_and_waiter(config=Config(waiting_timeout_s=10.0))
    c = rig.room(3, [6])  # queued behind b
    assert list(rig.core._slot_waiters) == [b, c]
    if event == "abort":
        rig.core.abort_receiver(b, InvalidArgument("x"), rig.now)
    elif event == "clear":
        rig.core.clear_receiver(b, rig.now)
    elif event == "close":
        rig.core.close(rig.now)
    elif event == "timeout":
        rig.succeed(a)  # a scatters slowly (no deadline); b and c time out
        rig.now = 10.0
        rig.ping_all()
        rig.tick(10.0)
    elif event == "bye_stage1":
        rig.core.receive(Bye("prefill-s1-1", rig.sessions["prefill-s1-1"], "leaving"), rig.now)
    else:
        rig.core.declare_dead("prefill-s1-0", PeerUnreachable("silent"), rig.now)
    out = rig.take()
    assert not infos(out), sorted(infos(out))
    assert b.poll() is KVPoll.Failed
    assert rig.staging.free_slots == 0
    if event in ("abort", "clear"):
        assert list(rig.core._slot_waiters) == [c]
    # let a finish, whatever state it is in
    if a.state is ReceiverState.SCATTERING:
        rig.core.scattered(a, None, rig.now)
    elif a.state is ReceiverState.WAITING:
        rig.succeed(a)
        rig.core.scattered(a, None, rig.now)
    else:
        for agent in PP_AGENTS:
            p = a.ranks[agent]
            if p.may_write and p.fenced_at is None:
                rig.status(a, agent, ok=False, reason="aborted")
        if a.state is ReceiverState.FENCING:
            rig.ping_all()
            rig.tick(rig.core.deadlines.next() or rig.now)
    out = rig.take()
    assert a.terminal and counter.given == 2
    served = {room for (room, _) in infos(out)}
    if event in ("abort", "clear"):
        assert served == {3} and c.state is ReceiverState.WAITING
    else:
        assert not served, served
        assert c.poll() is KVPoll.Failed
    if event == "close":
        assert [x for x in out if isinstance(x, act.Closed)]


SCATTER_EVENTS = ["abort", "clear", "close", "timeout", "bye_stage1", "dead_stage0", "restart", "status_fail"]


@pytest.mark.parametrize("event", SCATTER_EVENTS)
@pytest.mark.parametrize("copy_ok", [True, False])
def test_pp_events_while_scattering_change_nothing_and_slots_go_back_once(event: str, copy_ok: bool) -> None:
    rig, a, b, counter = _pp_holder_and_waiter(config=Config(waiting_timeout_s=10.0))
    assert scatters(rig.succeed(a)) and a.state is ReceiverState.SCATTERING
    if event == "abort":
        rig.core.abort_receiver(a, InvalidArgument("x"), rig.now)
    elif event == "clear":
        rig.core.clear_receiver(a, rig.now)
    elif event == "close":
        rig.core.close(rig.now)
    elif event == "timeout":
        rig.now = 50.0
        rig.ping_all()
        rig.tick(50.0)
    elif event == "bye_stage1":
        rig.core.receive(Bye("prefill-s1-0", rig.sessions["prefill-s1-0"], "leaving"), rig.now)
    elif event == "dead_stage0":
        rig.core.declare_dead("prefill-1", PeerUnreachable("silent"), rig.now)
    elif event == "restart":
        rig.core.topology_fetched(ADDR, instance(2, prefix="reborn", pp_size=2), rig.now)
    else:
        rig.status(a, "prefill-s1-0", ok=False, reason="late")
    rig.take()
    assert a.state is ReceiverState.SCATTERING and counter.given == 0 and rig.staging.free_slots == 0
    rig.core.scattered(a, None if copy_ok else RuntimeError("copy"), rig.now)
    out = rig.take()
    assert a.poll() is (KVPoll.Success if copy_ok else KVPoll.Failed)
    assert counter.given == 2 and len(finished(out)) == 1
    if event in ("close", "timeout", "bye_stage1", "dead_stage0", "restart"):
        assert not infos(out) and b.poll() is KVPoll.Failed  # b was failed by the event itself
    else:
        assert set(infos(out)) == {(2, x) for x in PP_AGENTS}
    with pytest.raises(ValueError):
        rig.core.scattered(a, None, rig.now)
    assert counter.given == 2


def test_pp_fcfs_a_small_room_never_overtakes_a_big_head() -> None:
    rig = Rig(slots=8, pp_prefill=2)
    holder = rig.room(1, [0, 1, 2])  # 6 of 8
    rig.register_all()
    big = rig.room(2, [3, 4, 5])  # needs 6
    small = rig.room(3, [6])  # needs 2 (and 2 are free)
    tiny = rig.room(4, [7])
    assert not infos(rig.take()) and list(rig.core._slot_waiters) == [big, small, tiny]
    rig.succeed(holder)
    rig.core.scattered(holder, None, rig.now)
    out = infos(rig.take())
    assert {room for room, _ in out} == {2, 3}  # big takes 6, small the 2 left; tiny waits
    assert list(rig.core._slot_waiters) == [tiny]


# ------------------------------------------------------------------------------------------------------
# Promise 2: markers; the fast and the fancy paths agree with a reference
# ------------------------------------------------------------------------------------------------------


def _reference_scatter(kv_before: np.ndarray, staging: DecodeStaging, pages: np.ndarray,
                       slices: tuple[StagedSlice, ...], kv_rows: Any) -> None:
    """Per (entry, staged page): copied iff its first 16 bytes are not the marker (kv_rows(e) -> (pages,
    page, row)); a part's pages are of its rank's size (nbytes a token row)."""
    for part in slices:
        for e in range(len(staging.slot_items)):
            base = int(staging._bases[e])
            n, lo = int(part.nbytes[e]), int(part.dst_offs[e])
            size = staging.args.page_size * n
            for k, page in enumerate(part.indices.tolist()):
                raw = staging.buffer[base + page * size: base + (page + 1) * size]
                if np.array_equal(raw[:MARK], staging._marker):
                    continue
                kv_rows(e)[int(pages[k]), :, lo:lo + n] = raw.reshape(staging.args.page_size, n)


@pytest.mark.parametrize("seed", range(12))
def test_pp_scatter_matches_a_reference_with_fragments_scrambles_and_reused_slots(seed: int) -> None:
    """Random rooms on a PP2 x TP2 prefill: fragmented free lists, scrambled page orders, slots reused
    from earlier rooms (left holding their rows), each stage writing a random subset of its own
    entries' slots. Whatever a rank left unwritten keeps decode's previous bytes."""
    rng = np.random.default_rng(seed)
    rig = Rig(slots=16, pp_prefill=2)
    room_id = 0
    live: list[Any] = []
    for step in range(8):
        # free some live rooms (abort + answered) to fragment the free list
        for r in list(live):
            if rng.random() < 0.5:
                rig.core.abort_receiver(r, InvalidArgument("x"), rig.now)
                for agent in PP_AGENTS:
                    rig.status(r, agent, ok=False, reason="aborted")
                live.remove(r)
        rig.take()
        free_pages = rng.permutation(PAGES)
        n = int(rng.integers(1, 1 + min(4, rig.staging.free_slots // 2))) if rig.staging.free_slots >= 2 else 0
        if n == 0:
            continue
        room_id += 1
        pages = [int(p) for p in free_pages[:n]]
        r = rig.room(room_id, pages)
        sent = infos(rig.register_all())
        if r.state is not ReceiverState.WAITING:  # (queued: skip)
            continue
        stage = rig.staging.buffer
        for (_, agent), info in sent.items():  # stage s writes entries s and s + 2 (its layers)
            s = int("-s1-" in agent)
            for e in (s, s + 2):
                item, base = int(rig.staging.slot_items[e]), int(rig.staging._bases[e])
                for k in info.dst_pages.tolist():
                    if rng.random() < 0.75:
                        stage[base + k * item:base + (k + 1) * item] = rng.integers(0, 256, item, dtype=np.uint8)
        [sc] = scatters(rig.succeed(r))
        rig.kv[:] = rng.integers(0, 256, rig.kv.shape, dtype=np.uint8)
        expect = rig.kv.copy()
        views = expect.reshape(ENTRIES, PAGES, PAGE, HEADS * HEAD_BYTES)
        _reference_scatter(expect, rig.staging, r.pages, sc.slices, views.__getitem__)
        rig.staging.scatter(r.pages, sc.slices)
        assert np.array_equal(rig.kv, expect), (seed, step, [s.slots.tolist() for s in sc.slices], pages)
        if rng.random() < 0.5:
            rig.core.scattered(r, None, rig.now)
        else:
            live.append(r)  # keeps its slots; later rooms fragment around it
            rig.core.scattered(r, None, rig.now)
        rig.take()


def _nonuniform_args(kv: list[np.ndarray], heads: int, head_bytes: list[int], tp: int = 1) -> KVArgs:
    return KVArgs(kv_data_ptrs=[int(x.ctypes.data) for x in kv], kv_data_lens=[x.nbytes for x in kv],
                  kv_item_lens=[PAGE * heads * hb for hb in head_bytes], page_size=PAGE, tp_size=tp,
                  engine_rank=0, kv_head_num=heads, total_kv_head_num=heads * tp)


@pytest.mark.parametrize("uniform", [True, False])
@pytest.mark.parametrize("seed", range(6))
def test_fast_and_fancy_paths_give_the_reference_result(uniform: bool, seed: int) -> None:
    """DecodeStaging alone: entries of one size (strided view where a run is contiguous) or of mixed
    sizes (fancy indexing always); a part marks its page of every slot in every entry; scatter agrees
    with the reference, for contiguous and fragmented slots and scrambled pages, reusing dirty slots,
    for ranks of the TP2 that shaped the area and of TP4 and TP8 sharing it (2 and 4 pages to a slot)."""
    rng = np.random.default_rng(100 + seed)
    heads, pages_n = 8, 24
    head_bytes = [8, 8, 8, 8] if uniform else [8, 16, 8, 32]
    kv = [np.zeros(pages_n * PAGE * heads * hb, dtype=np.uint8) for hb in head_bytes]
    args = _nonuniform_args(kv, heads, head_bytes)
    per_slot = sum(PAGE * heads * hb for hb in head_bytes) // 2  # TP2 prefill: half the heads
    st = DecodeStaging(per_slot * 10, args)
    assert st.usable(2) and st.slots == 10
    assert (st._uniform is not None) is uniform
    holes = [st.take(2) for _ in range(5)]
    st.buffer[:] = rng.integers(0, 256, len(st.buffer), dtype=np.uint8)  # dirty: earlier rooms' rows
    for i in (0, 2, 4):
        hole = holes[i]
        assert hole is not None
        st.give(hole)  # free: 0-1, 4-5, 8-9
    for want in (1, 3, 6, 2):
        slots = st.take(want)
        if slots is None:
            continue
        tp = int(rng.choice([2, 4, 8]))
        sub = int(rng.integers(0, tp // 2))
        part = st.part(prank(tp, int(rng.integers(0, tp))), slots, sub)
        r, runs = tp // 2, np.split(slots, np.flatnonzero(np.diff(slots) != 1) + 1)
        assert part.indices.tolist() == [int(run[0]) * r + sub * len(run) + i for run in runs for i in range(len(run))]
        marks = st.buffer[st._marks(part)]
        assert np.all(marks == st._marker), "a part's page is not marked in every entry"
        if st._mark_view(part) is not None:
            assert np.array_equal(cast(np.ndarray, st._mark_view(part)), marks)
        for e in range(len(kv)):
            item, base = int(st.slot_items[e]), int(st._bases[e])
            page = item * 2 // tp
            for k in part.indices.tolist():
                if rng.random() < 0.6:
                    st.buffer[base + k * page:base + (k + 1) * page] = rng.integers(0, 256, page, dtype=np.uint8)
        pages = rng.permutation(pages_n)[:len(slots)].astype(np.int32)
        for e in range(len(kv)):
            kv[e][:] = rng.integers(0, 256, kv[e].shape, dtype=np.uint8)
        expect = [x.copy() for x in kv]
        ev = {e: expect[e].reshape(pages_n, PAGE, -1) for e in range(len(kv))}
        _reference_scatter(np.empty(0), st, pages, (part,), ev.__getitem__)
        st.scatter(pages, (part,))
        for e in range(len(kv)):
            assert np.array_equal(kv[e], expect[e]), (seed, want, e, slots.tolist(), pages.tolist())
        st.give(slots)


def test_pp_stage1_leaves_a_page_unwritten_in_a_reused_slot_and_decode_keeps_its_bytes() -> None:
    rig = Rig(slots=4, pp_prefill=2)
    a = rig.room(1, [0, 1])
    sent = infos(rig.register_all())
    for (_, agent), info in sent.items():  # room 1 writes every entry of every slot
        s = int("-s1-" in agent)
        for e in (s, s + 2):
            item, base = int(rig.staging.slot_items[e]), int(rig.staging._bases[e])
            for k in info.dst_pages.tolist():
                rig.staging.buffer[base + k * item:base + (k + 1) * item] = 0x30
    [sc] = scatters(rig.succeed(a))
    rig.staging.scatter(a.pages, sc.slices)
    rig.core.scattered(a, None, rig.now)
    b = rig.room(2, [7, 8])
    sent = infos(rig.take())
    for (_, agent), info in sent.items():  # stage 0 writes both pages; stage 1 only the first page
        s = int("-s1-" in agent)
        ks = info.dst_pages.tolist() if s == 0 else info.dst_pages.tolist()[:1]
        for e in (s, s + 2):
            item, base = int(rig.staging.slot_items[e]), int(rig.staging._bases[e])
            for k in ks:
                rig.staging.buffer[base + k * item:base + (k + 1) * item] = 0x40 + e
    [sc] = scatters(rig.succeed(b))
    rig.kv[:] = 0xEE
    rig.staging.scatter(b.pages, sc.slices)
    rows = rig.kv.reshape(ENTRIES, PAGES, PAGE, HEADS * HEAD_BYTES)
    for e in (0, 2):
        assert np.all(rows[e, [7, 8]] == 0x40 + e)
    for e in (1, 3):
        assert np.all(rows[e, 7] == 0x40 + e)
        assert np.all(rows[e, 8] == 0xEE), "room 1's rows leaked into a page stage 1 never wrote"


# ------------------------------------------------------------------------------------------------------
# Promise 3: replicated state goes from exactly one non-dummy rank per stage
# ------------------------------------------------------------------------------------------------------


def _pinstance(tp: int, pp: int, is_mla: bool) -> PrefillInstance:
    ranks = {}
    for p in range(pp):
        for t in range(tp):
            r = prank(tp, t, pp_size=pp, pp=p)
            ranks[(0, t, p)] = dataclasses.replace(r, is_mla=is_mla)
    return PrefillInstance(tp_size=tp, pp_size=pp, dp_size=1, page_size=PAGE, kv_dtype="bfloat16", is_mla=is_mla,
                           protocol_version=prank(tp, 0).protocol_version, ranks=ranks)


COMBOS = [(tp_p, tp_d, h, mla, pp) for tp_p in (1, 2, 4, 8) for tp_d in (1, 2, 4, 8) for h in (1, 2, 4, 8)
          for mla in (False, True) for pp in (1, 2, 3)]


def test_replicated_state_has_exactly_one_non_dummy_writer_per_stage_for_every_layout() -> None:
    bad: list[tuple[object, ...]] = []
    for tp_p, tp_d, h, mla, pp in COMBOS:
        inst = _pinstance(tp_p, pp, mla)
        for d in range(tp_d):
            plan = plan_targets(inst, room=0, tp_size=tp_d, engine_rank=d, is_mla=mla,
                                total_kv_heads=1 if mla else h)
            per_stage: dict[int, list[Any]] = {p: [] for p in range(pp)}
            for t in plan.targets:
                if t.is_dummy:
                    continue  # (a dummy writes nothing at all: _chunk_writes skips it)
                if first_writer(t.rank.tp_rank, tp_p, tp_d) or t.write_aux:  # the prefill_writes condition
                    per_stage[t.rank.pp_rank].append(t)
            # and the first writer is never a dummy
            for t in plan.targets:
                if t.is_dummy and first_writer(t.rank.tp_rank, tp_p, tp_d):
                    bad.append(((tp_p, tp_d, h, mla, pp, d), "first writer is a dummy", t.rank.agent_id))
            for p, ws in per_stage.items():
                if len(ws) != 1:
                    bad.append(((tp_p, tp_d, h, mla, pp, d), p, [w.rank.agent_id for w in ws]))
            assert sum(t.write_aux for t in plan.targets) == 1
    assert not bad, bad[:10]


def _nsa_args(tp: int, rank: int, pp: int = 1, pp_rank: int = 0, heads_total: int = 8,
              kv: np.ndarray | None = None, state: np.ndarray | None = None) -> KVArgs:
    heads = max(1, heads_total // tp)
    item = PAGE * heads * HEAD_BYTES
    n = 4
    kv_bufs = kv if kv is not None else np.zeros((n, PAGES * item), dtype=np.uint8)
    st = state if state is not None else np.zeros((1, PAGES * 64), dtype=np.uint8)
    return KVArgs(kv_data_ptrs=[int(kv_bufs[e].ctypes.data) for e in range(n)], kv_data_lens=[kv_bufs[0].nbytes] * n,
                  kv_item_lens=[item] * n, page_size=PAGE, tp_size=tp, engine_rank=rank, pp_size=pp, pp_rank=pp_rank,
                  kv_head_num=heads, total_kv_head_num=heads_total, state_type="nsa",
                  state_data_ptrs=[int(st[0].ctypes.data)], state_data_lens=[st[0].nbytes], state_item_lens=[64],
                  kv_layer_ids=[0, 1, 0, 1], state_layer_ids=[0], owners=(kv_bufs, st))


@pytest.mark.parametrize("tp_p, pp", [(2, 1), (4, 1), (8, 1), (4, 2)])
def test_nsa_state_with_decode_staging_goes_to_one_rank_per_stage(tp_p: int, pp: int) -> None:
    """A staged rank is registered as a decode of its own TP, so on that alone it would take itself for our
    only writer and write the NSA state (the same on every prefill TP rank) along with every other staged
    rank of its stage. Its Register names our real rank for the state (``state_tp_size``): every staged
    rank gets the room's state indices, and exactly one per stage finds itself the first writer.
    (``test_layouts`` counts the state writes end to end.)"""
    rig = Rig(slots=16, tp_prefill=tp_p, pp_prefill=pp, nsa=True)
    rig.room(1, [0, 1], state=[3, 4])
    sent = infos(rig.register_all())
    assert len(sent) == tp_p * pp and all(rig.core.registrations[a].staged for _, a in sent)
    assert all(m.dst_state_indices.tolist() == [3, 4] for m in sent.values())
    writers: dict[int, list[str]] = {}
    for rank in rig.inst.ranks.values():
        reg = rig.registers[rank.agent_id]
        assert (reg.tp_size, reg.engine_rank, reg.kv_head_num) == (tp_p, rank.tp_rank, HEADS // tp_p)
        assert state_rank(reg) == (1, 0, HEADS)
        staged_reg = dataclasses.replace(reg, state_type="nsa", state_ptrs=(0x1000,), state_lens=(PAGES * 64,),
                                         state_item_lens=(64,), state_layer_ids=(0,), kv_layer_ids=(0, 1, 0, 1))
        peer = plan_peer(_nsa_args(tp_p, rank.tp_rank, pp=pp, pp_rank=rank.pp_rank), staged_reg)
        assert peer.whole_pages and peer.state is not None and peer.state.replicated
        if peer.state.first:
            writers.setdefault(rank.pp_rank, []).append(rank.agent_id)
    assert writers == {p: ["prefill-0" if p == 0 else f"prefill-s{p}-0"] for p in range(pp)}


def test_nsa_state_without_staging_has_one_writer_per_stage_pp2() -> None:
    """The same with per-token registration (decode's real TP) and a PP2 prefill: one writer per stage."""
    dec = _nsa_args(1, 0)
    rig = Rig(slots=4, tp_prefill=4)
    base = dataclasses.replace(rig.core._register, state_type="nsa", state_ptrs=tuple(dec.state_data_ptrs),
                               state_lens=tuple(dec.state_data_lens), state_item_lens=(64,), state_layer_ids=(0,),
                               kv_layer_ids=(0, 1, 0, 1), total_kv_head_num=8, kv_item_lens=(ITEM,) * 4,
                               agent_metadata=stub_agent_metadata(rig.core._register.decode_id))
    inst = _pinstance(4, 2, False)
    plan = plan_targets(inst, room=0, tp_size=1, engine_rank=0, total_kv_heads=8)
    per_stage: dict[int, list[str]] = {0: [], 1: []}
    for t in plan.targets:
        peer = plan_peer(_nsa_args(4, t.rank.tp_rank, pp=2, pp_rank=t.rank.pp_rank), base)
        assert peer.state is not None and peer.state.replicated
        if not t.is_dummy and (peer.state.first or t.write_aux):
            per_stage[t.rank.pp_rank].append(t.rank.agent_id)
    assert {p: len(w) for p, w in per_stage.items()} == {0: 1, 1: 1}, per_stage


def test_pp_partial_take_is_given_back_and_the_room_gets_slots_later() -> None:
    """TP rank 0's slots fit, TP rank 1's do not: the first take is given back (no leak, no double give),
    the room waits, and is served in full once the holder finishes."""
    rig = Rig(slots=8, pp_prefill=2)
    counter = GiveCounter(rig)
    holder = rig.room(1, [0, 1, 2])  # 6 of 8
    rig.register_all()
    r = rig.room(2, [3, 4])  # TP0 takes 2, TP1 finds none
    assert not infos(rig.take()) and list(rig.core._slot_waiters) == [r]
    assert rig.staging.free_slots == 2 and counter.given == 1
    rig.succeed(holder)
    rig.core.scattered(holder, None, rig.now)
    sent = infos(rig.take())
    assert set(sent) == {(2, x) for x in PP_AGENTS}
    assert rig.staging.free_slots == 4 and counter.given == 3


def test_pp_tp16_replicated_heads_take_slots_for_real_tp_ranks_only() -> None:
    rig = Rig(slots=16, tp_prefill=16, pp_prefill=2)
    r = rig.room(1, [0, 1])
    sent = infos(rig.register_all())
    real = [a for a, p in r.ranks.items() if not p.dummy]
    assert len(real) == 16 and len(sent) == 32  # 8 real TP ranks x 2 stages
    assert rig.staging.free_slots == 0  # 2 pages x 8 real TP ranks
    rig.succeed(r, real[:-1])
    assert r.state is ReceiverState.WAITING
    [sc] = scatters(rig.succeed(r, real[-1:]))
    assert len(sc.slices) == 8
    rig.core.scattered(r, None, rig.now)
    assert_nothing_leaks(rig)


@pytest.mark.parametrize("first, later, per_slot", [(2, 3, None), (2, 6, 3), (3, 6, 2), (3, 2, None), (6, 12, 3),
                                                    (2, 1, None)])
def test_a_later_tp_shares_the_slots_only_where_its_heads_divide_the_first_tps(first: int, later: int,
                                                                               per_slot: int | None) -> None:
    """6 heads at decode TP1: TP2 ranks hold 3, TP3 ranks 2, TP6 one. Slots hold 3 heads (half ours) where
    the first TP's ranks' heads divide 3, else theirs (TP3 first: 2). A later TP's pages fit a slot only
    where its heads divide the slot's (TP2 then TP3: 3 heads a slot, 2 a page, is refused)."""
    kv = [np.zeros(8 * PAGE * 6 * 16, dtype=np.uint8) for _ in range(2)]
    st = DecodeStaging(1 << 16, _nonuniform_args(kv, 6, [16, 16]))
    assert st.usable(first)
    assert st.usable(later) is (per_slot is not None)
    if per_slot is not None:
        assert st.per_slot(later) == per_slot
        assert st.register_fields(prank(later, 0))["kv_item_lens"] == (int(st.slot_items[0]) // per_slot,) * 2
