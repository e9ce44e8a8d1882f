"""Adversarial checks of a decode staging area shared by two prefill TPs: the first larger prefill TP a
decode rank registers with shapes the slots (half the decode rank's heads where that TP's ranks' heads
divide the half, else theirs); a TP whose ranks hold ``r`` times fewer heads than a slot (``r`` >= 1)
registers the area as pages of its own size, ``r`` to a slot, and ``r`` of its ranks share each slot.

Written by a reviewer briefed only with the feature's promises. Two harnesses:

- ``MixRig``/``World``: a real ``DecodeCore`` with a real ``DecodeStaging`` (any head count, decode TP and
  rank), driven with hand-made messages; the prefill ranks are played by ``World.write``, which writes what
  a rank would from its Register and TransferInfo (whole pages of its size into the area, or its heads of
  every token row in place), optionally lying. ``World`` keeps the bytes decode must end with (the
  per-token outcome) and ``check_slots`` the allocator's invariants after every event: no staging byte
  claimed by two live ranks, no slot free and held, nothing given back twice.
- ``mixed_rooms``: rooms from two prefill instances run through REAL prefill cores and the wire codec, each
  post turned into descriptors with the data plane's kernels and copied (``test_state_rank_attacks``), so
  the prefill's own checks of the Register (bounds, sizes, whole pages, run merging) see the shared area.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from asynckv.config import Config
from asynckv.errors import InvalidArgument
from asynckv.layout import KVArgs
from asynckv.proto import actions as act
from asynckv.proto.bootstrap import PrefillRank
from asynckv.proto.decode import DecodeCore
from asynckv.proto.messages import Register, TransferInfo
from asynckv.proto.prefill import PrefillCore
from asynckv.proto.receiver import ReceiverRoom
from asynckv.proto.states import KVPoll, ReceiverState
from asynckv.proto.topology import PrefillInstance, plan_targets, stub_agent_metadata
from asynckv.service.decode_staging import DecodeStaging
from asynckv.service.manager import _register_template

from . import test_state_rank_attacks as real
from .staging_rig import (
    ADDR,
    ADDR_B,
    ENTRIES,
    HEAD_BYTES,
    PAGE,
    PAGES,
    Rig,
    assert_nothing_leaks,
    instance,
)
from .test_state_rank_attacks import Buffers, Geo, Memory, Model, build

HB = HEAD_BYTES
U8 = npt.NDArray[np.uint8]


class MixRig(Rig):
    """``Rig`` with any head count: a decode rank (TP ``tp``, rank ``engine_rank``) of ``heads`` KV heads in all,
    its KV random (so a page left alone shows), a staging area of ``slots`` slots of a TP ``first`` prefill
    rank's pages (the instance at ``ADDR``; nothing shapes the area before a registration)."""

    def __init__(self, heads: int = 8, first: int = 2, slots: int = 8, tp: int = 1, engine_rank: int = 0,
                 config: Config | None = None, pp_first: int = 1, seed: int = 0) -> None:
        self.heads, self.hd = heads, heads // tp
        item = PAGE * self.hd * HB
        self.kv = np.random.default_rng(seed).integers(0, 256, (ENTRIES, PAGES * item), dtype=np.uint8)
        self.nsa = None
        args = KVArgs(kv_data_ptrs=[int(self.kv[e].ctypes.data) for e in range(ENTRIES)],
                      kv_data_lens=[self.kv[0].nbytes] * ENTRIES, kv_item_lens=[item] * ENTRIES, aux_data_ptrs=[],
                      aux_data_lens=[], aux_item_lens=[], page_size=PAGE, tp_size=tp, engine_rank=engine_rank,
                      kv_head_num=self.hd, total_kv_head_num=heads)
        self._start(args, slots * ENTRIES * PAGE * max(1, heads // first) * HB, config, first, pp_first)

    def add(self, tp: int, addr: str = ADDR_B, prefix: str = "late", pp: int = 1) -> None:
        """A second prefill instance (TP ``tp``) at ``addr``."""
        host = addr.split(":")[0]
        self.core.topology_fetched(addr, instance(tp, prefix=prefix, host=host, pp_size=pp), self.now)

    def rows(self, kv: U8 | None = None) -> U8:
        """KV as (entries, pages, tokens, heads, head bytes)."""
        return (self.kv if kv is None else kv).reshape(ENTRIES, PAGES, PAGE, self.hd, HB)


def heads_of(rank: PrefillRank, total: int) -> range:
    """The KV heads a prefill rank holds (ranks past the head count replicate)."""
    per = max(1, total // rank.tp_size)
    group = rank.tp_rank // max(1, rank.tp_size // total)
    return range(group * per, (group + 1) * per)


class World:
    """The prefill ranks of a ``MixRig`` played by hand, and what decode's KV must end as."""

    def __init__(self, rig: MixRig) -> None:
        self.rig = rig
        self.expect = rig.kv.copy()
        self.sent: dict[tuple[int, int, str], TransferInfo] = {}
        """By (room, epoch, agent)."""
        self.scatters: dict[int, act.Scatter] = {}
        """By room epoch: Scatter actions not yet run."""
        self.staged_writes: dict[int, list[tuple[str, int, int]]] = {}
        """By room epoch: (agent, entry, page position) written into the area."""
        self.d_heads = range(rig.core.kv_args.engine_rank * rig.hd, (rig.core.kv_args.engine_rank + 1) * rig.hd)

    def absorb(self, out: list[act.Action]) -> list[act.Action]:
        for a in out:
            if isinstance(a, act.Send) and isinstance(a.msg, TransferInfo):
                key = (a.msg.room, a.msg.epoch, a.msg.prefill_id)
                assert key not in self.sent, f"a second destination for {key}"
                self.sent[key] = a.msg
            elif isinstance(a, act.Scatter):
                assert a.room.epoch not in self.scatters
                self.scatters[a.room.epoch] = a
        return out

    def take(self) -> list[act.Action]:
        return self.absorb(self.rig.take())

    def model(self, room: ReceiverRoom) -> U8:
        """The room's full rows: (entries, pages, tokens, all heads, head bytes), fixed per epoch."""
        rng = np.random.default_rng(1000 + room.epoch)
        return rng.integers(0, 256, (ENTRIES, len(room.pages), PAGE, self.rig.heads, HB), dtype=np.uint8)

    def write(self, room: ReceiverRoom, agent: str, entries: Any = None, positions: Any = None) -> None:
        """What prefill rank ``agent`` writes for ``room``: every entry and page (or the entries and page
        positions given: a liar) of its destination, as its Register describes decode's pool."""
        rig, info = self.rig, self.sent[(room.room, room.epoch, agent)]
        reg, rank = rig.registers[agent], room.ranks[agent].rank
        heads, model = heads_of(rank, rig.heads), self.model(room)
        told = info.dst_pages.tolist()
        staged = rig.staging.addr <= reg.kv_ptrs[0] < rig.staging.addr + rig.staging.capacity
        for e in range(ENTRIES) if entries is None else entries:
            for pos, k in enumerate(told):
                if positions is not None and pos not in positions:
                    continue
                block = model[e, pos, :, heads.start:heads.stop]
                if staged:
                    assert reg.kv_item_lens[e] == block.nbytes, "the Register's page is not this rank's page"
                    off = reg.kv_ptrs[e] - rig.staging.addr + k * reg.kv_item_lens[e]
                    assert off + block.nbytes <= reg.kv_ptrs[e] - rig.staging.addr + reg.kv_lens[e]
                    rig.staging.buffer[off:off + block.nbytes] = block.reshape(-1)
                    self.staged_writes.setdefault(room.epoch, []).append((agent, e, pos))
                else:  # per token: its heads of every token row, in place
                    lo = heads.start - self.d_heads.start
                    assert 0 <= lo and lo + len(heads) <= rig.hd
                    rig.rows()[e, k, :, lo:lo + len(heads)] = block
                    self.rows_expect()[e, k, :, lo:lo + len(heads)] = block

    def rows_expect(self) -> U8:
        return self.rig.rows(self.expect)

    def write_all(self, room: ReceiverRoom) -> None:
        for agent, prog in room.ranks.items():
            if not prog.dummy:
                self.write(room, agent)

    def scatter(self, room: ReceiverRoom, error: BaseException | None = None) -> list[act.Action]:
        """Run the room's Scatter (as the service does) and answer it; what landed is expected. Returns the
        actions that followed."""
        sc = self.scatters.pop(room.epoch)
        rig = self.rig
        if error is None:
            rig.staging.scatter(room.pages, sc.slices)
            model = self.model(room)
            for agent, e, pos in self.staged_writes.pop(room.epoch, []):
                heads = heads_of(room.ranks[agent].rank, rig.heads)
                lo = heads.start - self.d_heads.start
                self.rows_expect()[e, room.pages[pos], :, lo:lo + len(heads)] = model[e, pos, :, heads.start:heads.stop]
        rig.core.scattered(room, error, rig.now)
        return self.take()

    def finish(self, room: ReceiverRoom) -> None:
        """Every real rank writes honestly and succeeds, and the room's copy runs (if staged): it has succeeded."""
        self.write_all(room)
        self.absorb(self.rig.succeed(room))
        if room.state is ReceiverState.SCATTERING:
            self.scatter(room)
        assert room.poll() is KVPoll.Success, room.exception

    def check(self) -> None:
        bad = np.argwhere(self.rig.rows() != self.rows_expect())
        assert not len(bad), f"decode KV differs from per token at (entry, page, token, head, byte) {bad[:4].tolist()}"


def live_parts(rig: MixRig, rooms: list[ReceiverRoom]) -> list[Any]:
    """The staged parts rooms still hold (given back: ``room.staged`` emptied), each once."""
    parts: dict[int, Any] = {}
    for room in rooms:
        for part in room.staged.values():
            parts[id(part)] = part
    return list(parts.values())


def check_slots(rig: MixRig, rooms: list[ReceiverRoom]) -> None:
    """The allocator's invariants with ``rooms`` (every room opened): free runs sorted and apart, no slot both
    free and held, held slots those of live rooms' parts; no staging byte claimed by two live ranks' pages,
    each rank's pages inside the slots its group holds."""
    st = rig.staging
    free: set[int] = set()
    last = -2
    for start, length in st._free:
        assert length > 0 and start > last + 1, f"free runs overlap or touch: {st._free}"
        free |= set(range(start, start + length))
        last = start + length - 1
    assert st.free_slots == len(free) and (not free or max(free) < st.slots)
    held: dict[int, int] = {}
    claimed: list[tuple[int, int, str]] = []
    groups: dict[int, npt.NDArray[np.int32]] = {}
    for part in live_parts(rig, rooms):
        groups[id(part.slots)] = part.slots
        r = int(st.slot_items[0]) // (PAGE * int(part.nbytes[0]))
        inside = set(part.slots.tolist())
        assert {int(k) // r for k in part.indices} <= inside, f"{part.agent_id}'s pages outside its slots"
        for e in range(ENTRIES):
            page = PAGE * int(part.nbytes[e])
            for k in part.indices.tolist():
                claimed.append((int(st._bases[e]) + k * page, page, part.agent_id))
    for slots in groups.values():
        for s in slots.tolist():
            assert s not in free, f"slot {s} free and held"
            assert s not in held, f"slot {s} held by two groups"
            held[s] = 1
    assert len(held) + len(free) == st.slots, (len(held), len(free), st.slots)
    claimed.sort()
    for (a, n, who), (b, _, other) in itertools.pairwise(claimed):
        assert a + n <= b, f"staging bytes at {b} claimed by {who} and {other}"


# -- 1. every order of two prefill TPs: the bytes are per token's --------------------------------------------------

ORDERS = [  # (heads, decode TP, decode rank, first TP, later TP, pages a slot holds of the first's ranks and
    # of the later's (0: per token)). Slots hold half the decode rank's heads where the first's divide that.
    (8, 1, 0, 2, 4, 1, 2), (8, 1, 0, 2, 8, 1, 4), (8, 1, 0, 4, 8, 2, 4), (8, 1, 0, 2, 16, 1, 4),
    (8, 1, 0, 8, 16, 4, 4), (8, 1, 0, 4, 2, 2, 1), (8, 1, 0, 8, 2, 4, 1), (8, 1, 0, 16, 2, 4, 1),
    (8, 1, 0, 4, 4, 2, 2), (8, 2, 1, 4, 8, 1, 2), (8, 2, 0, 4, 16, 1, 2), (8, 2, 1, 8, 4, 2, 1),
    (6, 1, 0, 2, 3, 1, 0), (6, 1, 0, 2, 6, 1, 3), (6, 1, 0, 3, 6, 1, 2), (6, 1, 0, 2, 12, 1, 3),
    (6, 1, 0, 6, 2, 3, 1), (6, 1, 0, 3, 2, 1, 0), (6, 2, 1, 6, 12, 1, 1), (12, 1, 0, 4, 6, 2, 3),
    (12, 1, 0, 2, 4, 1, 2), (12, 1, 0, 4, 12, 2, 6), (12, 2, 1, 4, 12, 1, 3), (12, 3, 2, 6, 12, 1, 2),
]


@pytest.mark.parametrize("heads, tp, rank, first, later, r_first, r", ORDERS,
                         ids=[f"h{h}-d{t}r{k}-tp{a}then{b}" for h, t, k, a, b, *_ in ORDERS])
def test_two_prefill_tps_in_flight_land_per_token_bytes(heads: int, tp: int, rank: int, first: int, later: int,
                                                         r_first: int, r: int) -> None:
    """A TP ``first`` room registers first (shaping the area), then a TP ``later`` room; both in flight at once.
    The later one shares the slots ``r`` to a slot or (0) registers per token; every rank's heads land in its
    slice of each token row, nothing else changes, slots come and go as promised."""
    rig = MixRig(heads, first, slots=100, tp=tp, engine_rank=rank)
    w = World(rig)
    a = rig.room(1, [0, 1, 2])
    w.absorb(rig.register_all())
    rig.add(later)
    b = rig.room(2, [30, 3, 9, 4, 17], addr=ADDR_B)
    w.absorb(rig.register_all())
    real_b = [agent for agent, p in b.ranks.items() if not p.dummy]
    staged_b = [agent for agent in real_b if rig.core.registrations[agent].staged]
    if r:
        assert staged_b == real_b and rig.staging.per_slot(later) == r
        for agent in real_b:
            reg = rig.registers[agent]
            assert (reg.tp_size, reg.engine_rank) == (later, b.ranks[agent].rank.tp_rank)
            assert list(reg.kv_item_lens) == [int(x) // r for x in rig.staging.slot_items]
    else:
        assert not staged_b
        assert all(rig.registers[agent].kv_ptrs == tuple(rig.core.kv_args.kv_data_ptrs) for agent in real_b)
    real_a = [agent for agent, p in a.ranks.items() if not p.dummy]
    assert rig.staging.per_slot(first) == r_first
    held = 3 * -(-len(real_a) // r_first) + (5 * -(-len(real_b) // r) if r else 0)
    assert rig.staging.slots - rig.staging.free_slots == held
    check_slots(rig, [a, b])
    w.write_all(b)
    w.write_all(a)
    for room in (b, a):  # (the later one's copy first: neither may depend on the other)
        w.absorb(rig.succeed(room))
        if room.state is ReceiverState.SCATTERING:
            w.scatter(room)
        assert room.poll() is KVPoll.Success
    w.check()
    assert_nothing_leaks(rig)


# -- 2. random interleavings of two TPs' rooms: the allocator's invariants after every event ----------------------


class Fuzz:
    """Rooms of two prefill instances (TP ``first`` at ``ADDR``, TP ``later`` at ``ADDR_B``) opened, written
    (honestly or not), answered, aborted, cleared, timed out and restarted at random; ``step`` checks every
    invariant after each event."""

    def __init__(self, seed: int, heads: int, tp: int, rank: int, first: int, later: int, slots: int,
                 pp: int = 1) -> None:
        self.rng = np.random.default_rng(seed)
        self.rig = MixRig(heads, first, slots=slots, tp=tp, engine_rank=rank,
                          config=Config(waiting_timeout_s=20.0), seed=seed)
        self.w = World(self.rig)
        self.rig.add(later, pp=pp)
        self.insts = {ADDR: self.rig.core.instances[ADDR], ADDR_B: self.rig.core.instances[ADDR_B]}
        self.rooms: list[ReceiverRoom] = []
        self.ids = itertools.count(1)
        self.had_slots: set[int] = set()
        """Epochs of rooms that took slots."""
        self.seen = {"success": 0, "failed": 0, "shared": 0, "waited": 0}
        """Rooms that succeeded, failed, shared slots (``sub`` > 0), and events seeing a room wait for slots."""

    def feed(self, out: list[act.Action]) -> None:
        """Actions the core emitted: a topology look-up (after a peer was declared dead) is answered at once."""
        for a in self.w.absorb(out):
            if isinstance(a, act.Scatter):
                assert a.room.state is ReceiverState.SCATTERING
            elif isinstance(a, act.FetchTopology):
                self.rig.core.topology_fetched(a.addr, self.insts[a.addr], self.rig.now)

    def pump(self) -> None:
        for _ in range(3):
            self.feed(self.rig.register_all())
        for room in self.rooms:
            if room.staged and room.epoch not in self.had_slots:
                self.had_slots.add(room.epoch)
                self.seen["shared"] += any(part.sub for part in room.staged.values())

    def busy_pages(self) -> set[int]:
        return {int(p) for room in self.rooms if room.state not in (ReceiverState.SUCCEEDED, ReceiverState.FAILED)
                for p in room.pages}

    def open(self) -> None:
        free = sorted(set(range(PAGES)) - self.busy_pages())
        n = int(self.rng.integers(0, 5))
        if len(free) < n or len([r for r in self.rooms if r.active]) > 8:
            return
        pages = self.rng.permutation(free)[:n].tolist()
        addr = ADDR if self.rng.random() < 0.5 else ADDR_B
        room = self.rig.room(next(self.ids), pages, addr=addr)
        self.rooms.append(room)

    def act_rank(self, whole_room: bool = False) -> None:
        """One prefill rank (or every one of a room) that may write does: writes all, some or nothing of its
        destination, then reports success (only while the room waits for it) or failure."""
        states = [ReceiverState.WAITING, ReceiverState.FENCING]
        if self.rng.random() < 0.4:  # (aborts are answered now and then first)
            states = [ReceiverState.FENCING]
        cands = [(room, agent) for room in self.rooms if room.state in states
                 for agent, p in room.ranks.items() if p.may_write and p.fenced_at is None]
        if not cands:
            return
        room, agent = cands[int(self.rng.integers(len(cands)))]
        agents = [a for r, a in cands if r is room] if whole_room else [agent]
        for agent in agents:
            if not room.ranks[agent].may_write:
                continue
            how = self.rng.random()
            if how < 0.6:
                self.w.write(room, agent)
            elif how < 0.85:  # a liar: some entries of some pages
                entries = [e for e in range(ENTRIES) if self.rng.random() < 0.6]
                positions = {pos for pos in range(len(room.pages)) if self.rng.random() < 0.6}
                self.w.write(room, agent, entries, positions)
            ok = room.state is ReceiverState.WAITING and self.rng.random() < 0.97
            self.rig.status(room, agent, ok=ok, reason="" if ok else "broke")

    def step(self) -> None:
        rig, rng = self.rig, self.rng
        x = rng.random()
        if x < 0.25:
            self.open()
        elif x < 0.55:
            self.act_rank()
        elif x < 0.7:
            self.act_rank(whole_room=True)
        elif x < 0.8:
            scattering = [r for r in self.rooms if r.state is ReceiverState.SCATTERING]
            if scattering:
                room = scattering[int(rng.integers(len(scattering)))]
                self.w.scatter(room, RuntimeError("copy raised") if rng.random() < 0.05 else None)
        elif x < 0.84:
            active = [r for r in self.rooms if r.active]
            if active:
                rig.core.abort_receiver(active[int(rng.integers(len(active)))], InvalidArgument("abort"), rig.now)
        elif x < 0.88:
            live = [r for r in self.rooms if not r.cleared]
            if live:
                rig.core.clear_receiver(live[int(rng.integers(len(live)))], rig.now)
        elif x < 0.89:  # a prefill instance restarts: new agents; its rooms fence until the old leases ran out
            addr = ADDR if rng.random() < 0.5 else ADDR_B
            old = self.insts[addr]
            self.insts[addr] = instance(old.tp_size, prefix=f"re{int(rng.integers(1 << 30))}", host=addr.split(":")[0],
                                        pp_size=old.pp_size)
            rig.core.topology_fetched(addr, self.insts[addr], rig.now)
        else:  # time passes: everyone alive pings (now and then nobody does)
            rig.now += float(rng.choice([0.1, 0.3, 1.0]))
            if rng.random() < 0.98:
                rig.ping_all()
            self.feed(rig.tick(rig.now))
        self.pump()
        self.check()

    def check(self) -> None:
        rig = self.rig
        check_slots(rig, self.rooms)
        for room in self.rooms:
            if room.epoch in self.had_slots and not room.staged:  # given back: no rank may still write
                assert all(not p.may_write or (p.fenced_at is not None and p.fenced_at <= rig.now)
                           for p in room.ranks.values()), f"room {room.room} gave its slots back while written"
            if room.state is ReceiverState.RESOLVING and room in rig.core._slot_waiters:
                self.seen["waited"] += 1
        assert set(rig.core._slot_waiters) <= {r for r in self.rooms if r.state is ReceiverState.RESOLVING}

    def drain(self) -> None:
        rig = self.rig
        for room in self.rooms:
            rig.core.abort_receiver(room, InvalidArgument("drain"), rig.now)
        self.pump()
        for _ in range(200):
            for room in [r for r in self.rooms if r.state is ReceiverState.SCATTERING]:
                self.w.scatter(room)
            for room in [r for r in self.rooms if r.state is ReceiverState.FENCING]:
                for agent, p in room.ranks.items():
                    if p.may_write and p.fenced_at is None:
                        rig.status(room, agent, ok=False, reason="aborted")
            rig.now += 1.0
            rig.ping_all()
            self.feed(rig.tick(rig.now))
            self.pump()
            self.check()
            if all(r.state in (ReceiverState.SUCCEEDED, ReceiverState.FAILED) for r in self.rooms):
                break
        for room in self.rooms:
            assert room.poll() in (KVPoll.Success, KVPoll.Failed), room.state
            rig.core.clear_receiver(room, rig.now)
            self.seen["success" if room.poll() is KVPoll.Success else "failed"] += 1
        self.w.check()
        assert_nothing_leaks(rig)
        assert rig.core.room_counts() == {"receivers": 0, "fencing_rooms": 0, "registrations_pending": 0,
                                          "topology_lookups": 0, "waiting_for_staging": 0}


FUZZ = [  # (heads, decode TP, decode rank, first TP, later TP, slots, later PP)
    (8, 1, 0, 2, 4, 12, 1), (8, 1, 0, 2, 8, 16, 1), (8, 2, 1, 4, 8, 10, 1), (6, 1, 0, 2, 6, 9, 1),
    (8, 1, 0, 4, 2, 12, 1), (8, 1, 0, 4, 16, 14, 1), (8, 1, 0, 2, 4, 12, 2),
]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("heads, tp, rank, first, later, slots, pp", FUZZ,
                         ids=[f"h{h}-d{t}r{k}-tp{a}and{b}pp{p}-{s}slots" for h, t, k, a, b, s, p in FUZZ])
def test_random_interleavings_of_two_tps_keep_every_slot_promise(heads: int, tp: int, rank: int, first: int,
                                                                 later: int, slots: int, pp: int, seed: int) -> None:
    """Rooms of both TPs at random: after every event no staging byte is claimed by two live ranks, no slot is
    free and held or given back twice or while a rank may write; when all is done every byte of decode's KV is
    what per token would have left (lying ranks' unwritten pages keep their bytes), nothing is held or waits."""
    f = Fuzz(seed, heads, tp, rank, first, later, slots, pp)
    for _ in range(250):
        f.step()
    f.drain()
    assert f.seen["success"] >= 3 and f.seen["failed"] >= 3 and f.seen["waited"] >= 1, f.seen


# -- 3. through real prefill cores: two TPs' rooms into one decode rank, per token and staged ----------------------

R_DST = [[10, 0, 6], [2, 7, 11], [1, 5, 9], [3, 4, 8]]
"""Decode pages of the rooms from each prefill instance (in ``mixed_rooms``)."""
R_STATE = {"mamba": [[1], [2], [0], [3]], "swa": [[8, 3], [9, 4], [10, 5], [11, 6]], "nsa": [[8, 3], [9, 4], [10, 5],
                                                                                             [11, 6]]}


def mixed_rooms(heads: int, tp_d: int, d_rank: int, prefills: list[tuple[int, int]], state: str = "none",
                staged: bool = True, src: tuple[int, ...] = (7, 2, 9), concurrent: bool = True,
                slots: int = 64, holes: bool = False
                ) -> tuple[list[str], DecodeStaging | None, dict[str, Register], list[ReceiverRoom]]:
    """One room from each prefill instance ``prefills[i]`` = (TP, PP) into decode rank ``d_rank`` (TP ``tp_d``,
    PP 1), through real cores, the codec and the kernels: instance ``i`` registers (and, ``concurrent`` False,
    finishes its room) before ``i + 1``, so the first shapes the area. Returns what is wrong, the area, the
    Registers each prefill rank got and the rooms. ``holes``: once the area is shaped, every other free slot is
    held (white-box) so that rooms get runs of one slot."""
    assert len(src) == 3
    now, mem, bad = 0.0, Memory(), []
    geos = [Geo(tp, tp_d, heads, pp_p=pp, state=state) for tp, pp in prefills]
    models = [Model(g, seed=11 + i) for i, g in enumerate(geos)]
    dec: Buffers = build(geos[0], tp_d, d_rank, 1, 0)
    for e, arr in enumerate(dec.kv):
        mem.add(arr, ("decode-kv", e))
    for e, arr in enumerate(dec.state):
        mem.add(arr, ("decode-state", e))
    area = DecodeStaging(slots * int(sum(dec.args.kv_item_lens)), dec.args) if staged else None
    if area is not None:
        mem.add(area.buffer, ("staging",))
    me, ep = "decode-mixed", "tcp://10.0.0.9:5000"
    template = _register_template(me, ep, dec.args, (0, 0), stub_agent_metadata(me))
    dcore = DecodeCore(me, ep, dec.args, Config(), template, itertools.count(1), area)
    pcores: dict[str, tuple[PrefillCore, Buffers]] = {}
    instance_of: dict[str, int] = {}
    by_endpoint: dict[str, str] = {}
    registers: dict[str, Register] = {}
    senders: dict[str, Any] = {}
    rooms: list[ReceiverRoom] = []
    pinned: list[npt.NDArray[np.int32]] = []

    def sent(agent: str, msg: Any) -> None:
        if isinstance(msg, Register):
            registers[agent] = msg

    def pump() -> None:
        real.pump(dcore, pcores, by_endpoint, mem, area, now, sent)

    def send(i: int) -> None:
        for agent, (core, _) in pcores.items():
            if instance_of[agent] == i:
                core.send_chunk(senders[agent], list(src[:2]), None, now)
                core.send_chunk(senders[agent], list(src[2:]), STATE_SRC_OF[state] or None, now)
        pump()

    for i, (geo, model) in enumerate(zip(geos, models, strict=True)):
        host = f"10.0.{i}.1"
        ranks = {(0, t, p): PrefillRank(tp_size=geo.tp_p, tp_rank=t, pp_size=geo.pp_p, pp_rank=p, dp_size=1, dp_rank=0,
                                        endpoint=f"tcp://{host}:{17000 + 100 * p + t}", agent_id=f"p{i}-{p}-{t}",
                                        page_size=real.PAGE, kv_dtype="bfloat16", is_mla=False)
                 for t in range(geo.tp_p) for p in range(geo.pp_p)}
        inst = PrefillInstance(tp_size=geo.tp_p, pp_size=geo.pp_p, dp_size=1, page_size=real.PAGE, kv_dtype="bfloat16",
                               is_mla=False, protocol_version=ranks[(0, 0, 0)].protocol_version, ranks=ranks)
        plan = plan_targets(inst, room=100 + i, tp_size=tp_d, engine_rank=d_rank, total_kv_heads=heads)
        for t in plan.targets:
            r = t.rank
            b = build(geo, geo.tp_p, r.tp_rank, geo.pp_p, r.pp_rank)
            for arr, (kind, layer) in zip(b.kv, b.kv_keys, strict=True):
                arr[list(src)] = model.kv(kind, layer)[:, :, b.heads.start:b.heads.stop]
            for arr, key in zip(b.state, b.state_keys, strict=True):
                arr[STATE_SRC_OF[state]] = model.state(key, b.heads, b.args.tp_size, b.args.engine_rank)
            for e, arr in enumerate(b.kv):
                mem.add(arr, (r.agent_id, "kv", e))
            for e, arr in enumerate(b.state):
                mem.add(arr, (r.agent_id, "state", e))
            pcores[r.agent_id] = (PrefillCore(r.agent_id, r.endpoint, b.args, Config()), b)
            instance_of[r.agent_id] = i
            by_endpoint[r.endpoint] = r.agent_id
        addr = f"{host}:8998"
        dcore.topology_fetched(addr, inst, now)
        room = dcore.open_receiver(addr, 100 + i, now)
        dcore.receiver_init(room, R_DST[i], -1, R_STATE[state][i] if state != "none" else None, 0, now)
        rooms.append(room)
        for agent, (core, _) in pcores.items():
            if instance_of[agent] == i:
                senders[agent] = core.open_sender(100 + i, now)
                core.sender_init(senders[agent], 3, -1, now)
        pump()
        if holes and i == 0 and area is not None and area.tp_prefill is not None:
            ones = [area.take(1) for _ in range(area.free_slots)]
            for k, one in enumerate(ones):
                if one is not None and k % 2:
                    area.give(one)
                elif one is not None:
                    pinned.append(one)
        if not concurrent:
            send(i)
    if concurrent:
        for i in reversed(range(len(prefills))):
            send(i)
    bad += mem.outside
    for i, room in enumerate(rooms):
        if room.state is not ReceiverState.SUCCEEDED:
            bad.append(f"room {i} (TP {prefills[i][0]}) {room.state.name}: {room.exception}")
    used = [p for i in range(len(prefills)) for p in R_DST[i]]
    for arr, (kind, layer) in zip(dec.kv, dec.kv_keys, strict=True):
        for i, model in enumerate(models):
            if not np.array_equal(arr[R_DST[i]], model.kv(kind, layer)[:, :, dec.heads.start:dec.heads.stop]):
                bad.append(f"room {i} (TP {prefills[i][0]}): KV {(kind, layer)} wrong")
        if np.delete(arr, used, axis=0).any():
            bad.append(f"KV {(kind, layer)}: a page outside the rooms written")
    for arr, key in zip(dec.state, dec.state_keys, strict=True):
        for i, model in enumerate(models):
            want = model.state(key, dec.heads, dec.args.tp_size, dec.args.engine_rank)
            if not np.array_equal(arr[R_STATE[state][i]], want):
                bad.append(f"room {i} (TP {prefills[i][0]}): state {key} wrong")
    if area is not None:
        for one in pinned:
            area.give(one)
        if area.free_slots != area.slots or dcore.room_counts()["waiting_for_staging"]:
            bad.append(f"slots held after every room: {area.slots - area.free_slots}")
    return bad, area, registers, rooms


STATE_SRC_OF = {"none": [], "mamba": [3], "swa": [5, 1], "nsa": [5, 1]}

MIXED = [  # (heads, decode TP, decode rank, [(prefill TP, PP) in registration order], state)
    (8, 1, 0, [(2, 1), (4, 1)], "none"), (8, 1, 0, [(2, 1), (8, 1)], "none"), (8, 1, 0, [(4, 1), (8, 1)], "none"),
    (8, 1, 0, [(2, 1), (16, 1)], "none"), (8, 1, 0, [(4, 1), (2, 1)], "none"), (8, 1, 0, [(8, 1), (16, 1)], "none"),
    (8, 2, 1, [(4, 1), (8, 1)], "none"), (8, 2, 0, [(4, 1), (16, 1)], "none"), (8, 2, 1, [(8, 1), (4, 1)], "none"),
    (8, 1, 0, [(2, 1), (4, 2)], "none"), (8, 1, 0, [(2, 2), (8, 3)], "none"),
    (8, 1, 0, [(2, 1), (4, 1), (8, 1)], "none"), (8, 1, 0, [(4, 1), (2, 1), (8, 2)], "none"),
    (8, 1, 0, [(2, 1), (4, 1)], "swa"), (8, 2, 1, [(4, 1), (8, 2)], "swa"), (8, 1, 0, [(2, 1), (8, 1)], "nsa"),
    (8, 1, 0, [(2, 1), (4, 1)], "mamba"), (4, 1, 0, [(2, 1), (8, 1)], "mamba"), (4, 2, 1, [(4, 1), (8, 1)], "mamba"),
    (2, 1, 0, [(2, 1), (4, 1)], "mamba"),
]


@pytest.mark.parametrize("concurrent", [True, False], ids=["together", "one-after-the-other"])
@pytest.mark.parametrize("heads, tp_d, d_rank, prefills, state", MIXED,
                         ids=[f"h{h}-d{t}r{k}-" + "then".join(f"tp{a}pp{b}" for a, b in p) + f"-{s}"
                              for h, t, k, p, s in MIXED])
def test_rooms_of_two_prefill_tps_through_real_prefill_cores_land_as_per_token(
        heads: int, tp_d: int, d_rank: int, prefills: list[tuple[int, int]], state: str, concurrent: bool) -> None:
    """Real prefill cores read the Registers of an area another TP shaped: each room's KV and state end byte for
    byte as the per-token run's, no descriptor leaves a registered buffer, every slot comes back; a later TP
    whose ranks hold a divisor of the slot's heads registers pages of its size (``r`` to a slot)."""
    staged_bad, area, registers, _ = mixed_rooms(heads, tp_d, d_rank, prefills, state, concurrent=concurrent)
    per_token_bad = mixed_rooms(heads, tp_d, d_rank, prefills, state, staged=False, concurrent=concurrent)[0]
    assert not per_token_bad, per_token_bad[:6]
    assert not staged_bad, staged_bad[:6]
    assert area is not None and area.tp_prefill == prefills[0][0]
    ours, first = heads // tp_d, max(1, heads // prefills[0][0])
    shaped = ours // 2 if ours % 2 == 0 and ours // 2 % first == 0 else first  # (half ours where it can)
    assert area.slot_heads == shaped
    for agent, reg in registers.items():
        tp = prefills[int(agent[1])][0]
        theirs = max(1, heads // tp)
        if theirs <= shaped and shaped % theirs == 0:  # it fits the slots: pages of its size, r to a slot
            assert reg.tp_size == tp and list(reg.kv_item_lens) == [int(x) * theirs // shaped for x in area.slot_items]
        else:
            assert reg.tp_size == tp_d and reg.state_tp_size == 0, agent


@pytest.mark.parametrize("holes", [False, True], ids=["one-run", "every-other-slot"])
def test_run_merging_on_consecutive_pages_of_a_shared_slot_run(holes: bool) -> None:
    """Consecutive prefill pages into a run of slots: each sharing rank's pages are one run (merged into one
    descriptor on the prefill) and still land as per token; with every other slot held, runs of one slot."""
    for prefills in ([(2, 1), (4, 1)], [(2, 1), (8, 1)], [(4, 1), (16, 1)], [(2, 1), (4, 2), (8, 1)]):
        for state in ("none", "swa"):
            bad = mixed_rooms(8, 1, 0, prefills, state, src=(3, 4, 5), holes=holes)[0]
            assert not bad, (prefills, bad[:6])


# -- 4. scripted: the queue, the limit, holes, liars, PP stages, aborts and restarts with two TPs --------------------


def state(room: ReceiverRoom) -> ReceiverState:
    """(Read afresh: a room's state changes under mypy's narrowing.)"""
    return room.state


def sent_to(out: list[act.Action]) -> list[tuple[int, str]]:
    """(room, agent) of each destination sent, in order."""
    return [(a.msg.room, a.msg.prefill_id) for a in out if isinstance(a, act.Send) and isinstance(a.msg, TransferInfo)]


def test_rooms_of_both_tps_wait_for_slots_first_come_first_served() -> None:
    """A TP4 room (2 to a slot) waiting for slots holds back a later TP2 room that would fit the free ones, and
    the other way round; each goes on when the one before it got its slots or failed."""
    rig = MixRig(8, 2, slots=6)
    w = World(rig)
    rig.add(4)
    a = rig.room(1, [0, 1])  # TP2: 4 of 6 slots
    w.absorb(rig.register_all())
    rig.core.preconnect(ADDR_B, rig.now)  # (registered ahead: a room waits for registration before slots)
    w.absorb(rig.register_all())
    b = rig.room(2, [2, 3], addr=ADDR_B)  # TP4: 4 ranks x 2 pages, 2 to a slot: 4 slots, 2 free
    c = rig.room(3, [4])  # TP2: 2 slots, 2 free, but b came first
    out = w.absorb(rig.register_all())
    assert not sent_to(out) and list(rig.core._slot_waiters) == [b, c]
    assert rig.core.room_counts()["waiting_for_staging"] == 2
    w.write_all(a)
    w.absorb(rig.succeed(a))
    out = w.scatter(a)  # 6 free: b, then c
    assert [room for room, _ in sent_to(out)] == [2, 2, 2, 2, 3, 3]
    assert b.state is ReceiverState.WAITING and c.state is ReceiverState.WAITING
    d = rig.room(4, [5, 6], addr=ADDR_B)  # TP4 needs 4, none free
    e = rig.room(5, [7])  # TP2 needs 2
    w.absorb(rig.register_all())
    assert list(rig.core._slot_waiters) == [d, e]
    rig.core.abort_receiver(c, InvalidArgument("x"), rig.now)  # c frees 2 once its ranks answer: e fits, d first
    for agent in ("prefill-0", "prefill-1"):
        rig.status(c, agent, ok=False, reason="aborted")
    w.take()
    assert c.poll() is KVPoll.Failed and list(rig.core._slot_waiters) == [d, e] and rig.staging.free_slots == 2
    rig.core.abort_receiver(d, InvalidArgument("x"), rig.now)  # the head leaves: e goes on
    out = w.take()
    assert sent_to(out) == [(5, "prefill-0"), (5, "prefill-1")] and not rig.core._slot_waiters
    for room in (b, e):
        w.finish(room)
    w.check()
    assert_nothing_leaks(rig)


def test_a_waiting_tp2_room_gets_the_slots_of_a_tp8_room_four_to_a_slot() -> None:
    """The other way: a TP8 room (4 to a slot) holds every slot; a TP2 room waits for exactly those and a TP8
    room behind it waits on; slots go round in order and the bytes are per token's."""
    rig = MixRig(8, 2, slots=4)
    w = World(rig)
    rig.core.preconnect(ADDR, rig.now)  # (TP2 shapes the area: its registration comes first)
    w.absorb(rig.register_all())
    rig.add(8)
    a = rig.room(1, [0, 1], addr=ADDR_B)  # 8 ranks x 2 pages, 4 to a slot: 4 slots
    w.absorb(rig.register_all())
    assert rig.staging.free_slots == 0 and rig.staging.per_slot(8) == 4
    slots_a = sorted({int(s) for part in a.staged.values() for s in part.slots})
    b = rig.room(2, [2, 3])  # TP2: 4 slots
    c = rig.room(3, [4], addr=ADDR_B)  # TP8: 2 slots
    w.absorb(rig.register_all())
    assert list(rig.core._slot_waiters) == [b, c]
    w.write_all(a)
    w.absorb(rig.succeed(a))
    w.scatter(a)
    assert b.state is ReceiverState.WAITING and c.state is ReceiverState.RESOLVING
    assert sorted({int(s) for part in b.staged.values() for s in part.slots}) == slots_a
    w.write_all(b)
    w.absorb(rig.succeed(b))
    w.scatter(b)
    assert state(c) is ReceiverState.WAITING
    w.write_all(c)
    w.absorb(rig.succeed(c))
    w.scatter(c)
    assert all(r.poll() is KVPoll.Success for r in (a, b, c))
    w.check()
    assert_nothing_leaks(rig)


@pytest.mark.parametrize("heads, tp, rank, first, later, want", [
    (6, 1, 0, 2, 6, "needs 6 staging slots (3 pages from each of 6 prefill TP ranks holding fewer heads, 3 to a "
                    "slot), the decode staging area holds 5"),
    (8, 2, 1, 4, 16, "needs 6 staging slots (3 pages from each of 4 prefill TP ranks holding fewer heads, 2 to a "
                     "slot), the decode staging area holds 5"),
])
def test_a_sharing_tps_room_too_large_for_the_area_fails_at_once_even_behind_a_waiting_room(
        heads: int, tp: int, rank: int, first: int, later: int, want: str) -> None:
    """Its need counts the real ranks (replicas are dummies), ``r`` to a slot; it fails at once (it does not
    queue behind the waiting room), naming the setting; the waiting room goes on when slots come back."""
    rig = MixRig(heads, first, slots=5, tp=tp, engine_rank=rank)
    w = World(rig)
    a = rig.room(1, [0, 1])  # the first TP: 2 ranks x 2 pages
    w.absorb(rig.register_all())
    rig.add(later)
    rig.core.preconnect(ADDR_B, rig.now)
    w.absorb(rig.register_all())
    small = rig.room(2, [5], addr=ADDR_B)  # 2 slots, 1 free: waits for a's
    w.absorb(rig.register_all())
    assert list(rig.core._slot_waiters) == [small]
    big = rig.room(3, [2, 3, 4], addr=ADDR_B)  # 2 groups of its ranks x 3 pages: more than the area
    w.absorb(rig.register_all())
    assert big.poll() is KVPoll.Failed and isinstance(big.exception, InvalidArgument)
    assert want in str(big.exception) and "raise decode_staging_bytes" in str(big.exception)
    assert list(rig.core._slot_waiters) == [small]
    w.write_all(a)
    w.absorb(rig.succeed(a))
    w.scatter(a)
    assert small.state is ReceiverState.WAITING
    w.write_all(small)
    w.absorb(rig.succeed(small))
    w.scatter(small)
    w.check()
    assert_nothing_leaks(rig)


def test_a_sharing_room_over_fragmented_slots_gets_a_run_of_its_own_in_each_run_and_lands_as_per_token() -> None:
    """Holes in the free list (TP2 rooms 1, 3, 5 done): a TP8 room (4 to a slot, 2 groups) spans three runs of
    slots; in each run of ``L`` slots starting at ``a`` rank ``sub`` gets pages ``[4a + sub L, 4a + (sub + 1) L)``."""
    rig = MixRig(8, 2, slots=12)
    w = World(rig)
    rooms = [rig.room(i, [i]) for i in range(1, 7)]  # slots 0..11, two each
    w.absorb(rig.register_all())
    rig.add(8)
    for r in rooms[::2]:
        w.write_all(r)
        w.absorb(rig.succeed(r))
        w.scatter(r)
    assert rig.staging._free == [(0, 2), (4, 2), (8, 2)]
    big = rig.room(9, [20, 11, 27], addr=ADDR_B)  # 2 groups x 3 slots
    w.absorb(rig.register_all())
    check_slots(rig, [*rooms, big])
    parts = {agent: big.staged[agent] for agent in big.ranks}
    assert [parts[f"late-{t}"].slots.tolist() for t in (0, 4)] == [[0, 1, 4], [5, 8, 9]]
    want = {0: [0, 1, 16], 1: [2, 3, 17], 2: [4, 5, 18], 3: [6, 7, 19],  # runs [0, 1] and [4]
            4: [20, 32, 33], 5: [21, 34, 35], 6: [22, 36, 37], 7: [23, 38, 39]}  # runs [5] and [8, 9]
    for t, pages in want.items():
        assert w.sent[(9, big.epoch, f"late-{t}")].dst_pages.tolist() == pages, t
        assert parts[f"late-{t}"].sub == t % 4
    w.write_all(big)
    for r in rooms[1::2]:
        w.write_all(r)
    for r in [big, *rooms[1::2]]:
        w.absorb(rig.succeed(r))
        w.scatter(r)
        assert r.poll() is KVPoll.Success
    w.check()
    assert_nothing_leaks(rig)


@pytest.mark.parametrize("order", [(2, 4), (4, 2), (2, 8), (8, 2)], ids=["tp2-rows-then-tp4", "tp4-rows-then-tp2",
                                                                        "tp2-rows-then-tp8", "tp8-rows-then-tp2"])
def test_pages_a_lying_rank_left_unwritten_keep_decodes_bytes_not_the_other_tps_rows(
        order: tuple[int, int], caplog: pytest.LogCaptureFixture) -> None:
    """The area was shaped by TP2, a TP4/TP8 prefill shares it. A room of one TP leaves its rows in slots; a room of
    the other TP takes the same slots and its ranks report success having written all, some or none of their
    pages (a liar): pages not written keep decode's bytes, never the earlier room's rows lying in the slot."""
    rig = MixRig(8, 2, slots=8)
    w = World(rig)
    rig.core.preconnect(ADDR, rig.now)
    w.absorb(rig.register_all())
    rig.add(max(order))
    addr = {2: ADDR, max(order): ADDR_B}
    first = rig.room(1, [0, 1, 2, 3], addr=addr[order[0]])
    w.absorb(rig.register_all())
    w.write_all(first)
    w.absorb(rig.succeed(first))
    w.scatter(first)
    held_before = rig.staging.free_slots
    second = rig.room(2, [10, 11, 12, 13], addr=addr[order[1]])
    w.absorb(rig.register_all())
    assert rig.staging.free_slots == held_before - 8  # the very slots the first room's rows are in
    real = [a for a, p in second.ranks.items() if not p.dummy]
    for i, agent in enumerate(real):
        if i % 3 == 0:
            w.write(second, agent)
        elif i % 3 == 1:
            w.write(second, agent, entries=[0, 3], positions={1, 2})
    with caplog.at_level(logging.WARNING, "asynckv.decode"):
        w.absorb(rig.succeed(second))
        w.scatter(second)
    assert second.poll() is KVPoll.Success
    assert any("left staged pages unwritten" in r.getMessage() for r in caplog.records)
    w.check()
    assert_nothing_leaks(rig)


def test_pp_stages_of_a_sharing_tp_rank_share_its_part_and_each_writes_its_own_layers() -> None:
    """A TP4 prefill with two PP stages into an area TP2 shaped: both stages of a TP rank are told the same pages
    (one part: slots count TP ranks, not stages); stage 0 writes entries 0-1, stage 1 entries 2-3; a stage that
    lies leaves its entries as they were; the slots come back once."""
    rig = MixRig(8, 2, slots=8)
    w = World(rig)
    rig.core.preconnect(ADDR, rig.now)
    w.absorb(rig.register_all())
    rig.add(4, pp=2)
    r = rig.room(1, [5, 9, 6], addr=ADDR_B)
    w.absorb(rig.register_all())
    assert rig.staging.slots - rig.staging.free_slots == 3 * 2  # 4 TP ranks, 2 to a slot, 3 pages
    for t in range(4):
        s0, s1 = f"late-{t}", f"late-s1-{t}"
        assert r.staged[s0] is r.staged[s1]
        assert w.sent[(1, r.epoch, s0)].dst_pages.tolist() == w.sent[(1, r.epoch, s1)].dst_pages.tolist()
        w.write(r, s0, entries=[0, 1])
        if t != 2:  # stage 1 of TP rank 2 lies: it writes nothing
            w.write(r, s1, entries=[2, 3])
    w.absorb(rig.succeed(r))
    w.scatter(r)
    assert r.poll() is KVPoll.Success
    w.check()
    assert_nothing_leaks(rig)


def test_an_aborted_sharing_room_keeps_its_slots_until_every_rank_answered_and_is_never_copied() -> None:
    """A TP4 room sharing slots is aborted while its ranks write: the slots stay held (a TP2 room waits) until the
    last rank that got its destination answered, no Scatter is ever emitted, decode's pages keep their bytes;
    the waiting room then gets exactly those slots."""
    rig = MixRig(8, 2, slots=4)
    w = World(rig)
    rig.core.preconnect(ADDR, rig.now)
    w.absorb(rig.register_all())
    rig.add(4)
    a = rig.room(1, [3, 4], addr=ADDR_B)  # 4 slots: all
    w.absorb(rig.register_all())
    slots_a = sorted({int(s) for part in a.staged.values() for s in part.slots})
    b = rig.room(2, [7, 8])
    w.absorb(rig.register_all())
    assert list(rig.core._slot_waiters) == [b]
    w.write(a, "late-0")
    w.write(a, "late-3", positions={0})
    rig.status(a, "late-0", ok=True)
    rig.core.abort_receiver(a, InvalidArgument("user abort"), rig.now)
    for agent in ("late-1", "late-3", "late-2"):
        assert a.state is ReceiverState.FENCING and rig.staging.free_slots == 0 and not sent_to(w.take())
        w.write(a, agent)  # (still writing as the abort arrives)
        rig.status(a, agent, ok=False, reason="aborted")
    out = w.take()
    assert a.poll() is KVPoll.Failed and not w.scatters
    assert sent_to(out) == [(2, "prefill-0"), (2, "prefill-1")]
    assert sorted({int(s) for part in b.staged.values() for s in part.slots}) == slots_a
    w.write_all(b)
    w.absorb(rig.succeed(b))
    w.scatter(b)
    w.check()  # (a's pages: decode's bytes; its staged rows were never copied)
    assert_nothing_leaks(rig)


def test_a_restarted_sharing_prefill_holds_its_slots_until_the_old_leases_ran_out() -> None:
    """The TP8 instance sharing the area restarts (new agents) mid-room: its room fences and keeps its slots until
    the old incarnation's leases ran out; a TP2 room waiting gets them only then, and the new incarnation's room
    queues behind it."""
    rig = MixRig(8, 2, slots=4)
    w = World(rig)
    rig.core.preconnect(ADDR, rig.now)
    w.absorb(rig.register_all())
    rig.add(8)
    a = rig.room(1, [0, 1], addr=ADDR_B)  # 2 groups x 2 pages: every slot
    w.absorb(rig.register_all())
    w.write(a, "late-5")
    b = rig.room(2, [2, 3])
    w.absorb(rig.register_all())
    rig.now = 1.0
    rig.ping_all()
    rig.add(8, prefix="reborn")
    w.take()
    assert a.state is ReceiverState.FENCING and rig.staging.free_slots == 0
    c = rig.room(3, [4], addr=ADDR_B)
    w.absorb(rig.register_all())
    assert list(rig.core._slot_waiters) == [b, c]
    end = rig.core.deadlines.next()
    assert end is not None and end > rig.now
    rig.ping_all()
    w.absorb(rig.tick(end - 1e-3))
    assert a.state is ReceiverState.FENCING and rig.staging.free_slots == 0 and b.state is ReceiverState.RESOLVING
    w.absorb(rig.tick(end))
    assert a.poll() is KVPoll.Failed and state(b) is ReceiverState.WAITING and list(rig.core._slot_waiters) == [c]
    for room in (b, c):
        w.finish(room)
    w.check()
    assert_nothing_leaks(rig)


def test_a_last_group_with_fewer_ranks_than_a_slot_holds() -> None:
    """White-box (the service never mixes them within one instance): one TP4 rank of four registered per token, so
    three share slots two to a slot: two groups, the last of one rank. It takes 2 x pages slots, its pages the
    first block of each run, the per-token rank writes in place, and every slot comes back once."""
    rig = MixRig(8, 2, slots=8)
    w = World(rig)
    rig.core.preconnect(ADDR, rig.now)
    w.absorb(rig.register_all())
    rig.add(4)
    r = rig.room(1, [6, 2, 3], addr=ADDR_B)
    w.take()
    rig.core.registrations["late-1"].staged = False
    w.absorb(rig.register_all())
    assert set(r.staged) == {"late-0", "late-2", "late-3"} and rig.staging.free_slots == 8 - 6
    assert [r.staged[a].sub for a in ("late-0", "late-2", "late-3")] == [0, 1, 0]
    assert w.sent[(1, r.epoch, "late-1")].dst_pages.tolist() == [6, 2, 3]
    check_slots(rig, [r])
    for agent in ("late-0", "late-2", "late-3"):
        w.write(r, agent)
    rig.registers["late-1"] = dataclasses.replace(rig.registers["late-1"], kv_ptrs=tuple(rig.core.kv_args.kv_data_ptrs),
                                                  kv_item_lens=tuple(rig.core.kv_args.kv_item_lens))
    w.write(r, "late-1")  # (as the per-token Register it would have had says)
    w.absorb(rig.succeed(r))
    [sc] = [w.scatters[r.epoch]]
    assert sorted(s.agent_id for s in sc.slices) == ["late-0", "late-2", "late-3"]
    w.scatter(r)
    assert r.poll() is KVPoll.Success
    w.check()
    assert_nothing_leaks(rig)


def test_a_sharing_tps_room_without_pages_takes_no_slot_and_does_not_queue() -> None:
    rig = MixRig(8, 2, slots=4)
    w = World(rig)
    a = rig.room(1, [0, 1])  # every slot
    w.absorb(rig.register_all())
    rig.add(4)
    b = rig.room(2, [2], addr=ADDR_B)  # waits
    empty = rig.room(3, [], addr=ADDR_B)
    w.absorb(rig.register_all())
    assert list(rig.core._slot_waiters) == [b] and empty.state is ReceiverState.WAITING and not empty.staged
    assert all(len(w.sent[(3, empty.epoch, agent)].dst_pages) == 0 for agent in empty.ranks)
    w.absorb(rig.succeed(empty))
    assert empty.poll() is KVPoll.Success and empty.epoch not in w.scatters
    for room in (a, b):
        w.write_all(room)
        w.absorb(rig.succeed(room))
        w.scatter(room)
    w.check()
    assert_nothing_leaks(rig)


def test_ranks_holding_more_heads_than_a_slot_write_per_token_with_a_warning_and_do_not_queue(
        caplog: pytest.LogCaptureFixture) -> None:
    """6 heads: a TP3 prefill (2 heads a rank, which do not divide half of 6) shapes slots of 2 heads; a TP2
    prefill (3 heads a rank) comes later: its ranks register as what they are, write per token into the
    decode's pages (a warning names it, once), and its room does not wait while the area is full."""
    rig = MixRig(6, 3, slots=3)
    w = World(rig)
    a = rig.room(1, [0])  # (3 ranks, one page each: the whole area)
    w.absorb(rig.register_all())
    assert rig.staging.slot_heads == 2 and rig.staging.free_slots == 0
    rig.add(2)
    b = rig.room(2, [5, 6], addr=ADDR_B)
    with caplog.at_level(logging.WARNING, logger="asynckv.decode"):
        out = rig.register_all()
    w.absorb(out)
    [warning] = [r.getMessage() for r in caplog.records if "per token" in r.getMessage()]  # (once, not per rank)
    assert f"prefill {ADDR_B} (TP 2) writes into this rank per token" in warning
    sent = [(m.room, m.prefill_id, m.dst_pages.tolist()) for a_ in out if isinstance(a_, act.Send)
            and isinstance(m := a_.msg, TransferInfo)]
    assert sorted(sent) == [(2, "late-0", [5, 6]), (2, "late-1", [5, 6])]  # its real pages: no slots
    assert all(rig.registers[f"late-{t}"].tp_size == 1 for t in range(2))
    for room in (b, a):
        w.finish(room)
    w.check()
    assert_nothing_leaks(rig)


def test_smaller_tps_registering_after_the_largest_stage_too_since_slots_hold_half_the_decodes_heads() -> None:
    """8 heads: TP16 (replicated, 1 head a rank) registers first, yet the slots hold 4 heads (half the decode
    rank's), so a TP2 (4 heads a rank: one page a slot) and a TP8 (1 head: four) that come later stage too,
    with three rooms in flight; a TP16 room takes as many bytes of slots as a TP2 one."""
    rig = MixRig(8, 16, slots=160)  # (160 slots of a TP16 page: 40 of 4 heads)
    w = World(rig)
    a = rig.room(1, [0, 1])
    w.absorb(rig.register_all())
    assert rig.staging.slot_heads == 4 and rig.staging.slots == 40
    assert rig.staging.free_slots == 40 - 2 * 2  # (8 real ranks, 4 to a slot)
    rig.add(2)
    b = rig.room(2, [5, 6, 7], addr=ADDR_B)
    rig.add(8, addr="10.0.0.3:8998", prefix="third")
    c = rig.room(3, [9, 10], addr="10.0.0.3:8998")
    w.absorb(rig.register_all())
    assert all(rig.core.registrations[agent].staged for room in (b, c) for agent in room.ranks)
    assert (rig.staging.per_slot(2), rig.staging.per_slot(8), rig.staging.per_slot(16)) == (1, 4, 4)
    assert rig.staging.free_slots == 40 - 2 * 2 - 3 * 2 - 2 * 2
    for room in (c, a, b):
        w.finish(room)
    w.check()
    assert_nothing_leaks(rig)


def test_rooms_of_both_tps_failing_together_hand_no_slots_to_each_other() -> None:
    """One timer tick times out a TP4 room at the head of the queue and a TP8 room behind it that the free slots
    fit once the head leaves: no destination goes out at that tick. Then close() with a TP2 holder and rooms of
    both TPs waiting: none is sent either, and Closed follows once the holder is fenced."""
    rig = MixRig(8, 2, slots=8, config=Config(waiting_timeout_s=10.0))
    w = World(rig)
    rig.core.preconnect(ADDR, rig.now)
    rig.add(4)
    rig.add(8, addr="10.0.0.3:8998", prefix="eight")
    rig.core.preconnect(ADDR_B, rig.now)
    rig.core.preconnect("10.0.0.3:8998", rig.now)
    w.absorb(rig.register_all())
    holder = rig.room(1, [0, 1, 2])  # TP2: 6 of 8 slots; its copy is slow (no deadline while scattering)
    w.absorb(rig.register_all())
    w.write_all(holder)
    w.absorb(rig.succeed(holder))
    head = rig.room(2, [3, 4], addr=ADDR_B)  # TP4: 4 slots
    small = rig.room(3, [5], addr="10.0.0.3:8998")  # TP8, 4 to a slot: 2 slots, 2 free
    w.absorb(rig.register_all())
    assert list(rig.core._slot_waiters) == [head, small]
    rig.now = 10.0
    rig.ping_all()
    out = w.absorb(rig.tick(10.0))
    assert not sent_to(out), f"destinations sent at the tick that timed the rooms out: {sent_to(out)}"
    assert head.poll() is KVPoll.Failed and small.poll() is KVPoll.Failed
    w.scatter(holder)
    holder2 = rig.room(4, [6, 7, 8], addr=ADDR_B)  # TP4: 6 slots
    w.absorb(rig.register_all())
    waiting = [rig.room(5, [9, 10]), rig.room(6, [11], addr="10.0.0.3:8998")]
    w.absorb(rig.register_all())
    assert list(rig.core._slot_waiters) == waiting
    w.write(holder2, "late-2")
    rig.core.close(rig.now)
    out = w.take()
    assert not sent_to(out), f"close() sent destinations: {sent_to(out)}"
    assert all(r.poll() is KVPoll.Failed for r in waiting) and not [a for a in out if isinstance(a, act.Closed)]
    for agent in ("late-0", "late-1", "late-2", "late-3"):
        rig.status(holder2, agent, ok=False, reason="aborted")
    assert [a for a in w.take() if isinstance(a, act.Closed)]
    w.check()
    assert_nothing_leaks(rig)


def test_the_per_token_warning_keeps_only_live_instances_and_names_a_restarted_one_again(
        caplog: pytest.LogCaptureFixture) -> None:
    """6 heads, slots shaped by TP3: TP2 prefills go per token. A prefill that restarts (a new instance at its
    address) is named again; an address whose instance was dropped (as a registration timeout drops it)
    leaves the table of those named at the next warning."""
    rig = MixRig(6, 3, slots=8)
    w = World(rig)
    rig.room(1, [0])
    w.absorb(rig.register_all())
    with caplog.at_level(logging.WARNING, logger="asynckv.decode"):
        for room, addr, prefix in ((2, ADDR_B, "late"), (3, ADDR_B, "again"), (4, "10.0.0.3:8998", "third")):
            if room == 4:
                rig.core.instances.pop(ADDR_B)
            rig.add(2, addr=addr, prefix=prefix)  # (room 3: the prefill at ADDR_B restarted, new agents)
            rig.room(room, [room + 3], addr=addr)
            w.absorb(rig.register_all())
    named = [r.getMessage().split(" (")[0] for r in caplog.records if "per token" in r.getMessage()]
    assert named == [f"prefill {ADDR_B}", f"prefill {ADDR_B}", "prefill 10.0.0.3:8998"]
    assert list(rig.core._told_per_token) == ["10.0.0.3:8998"]
