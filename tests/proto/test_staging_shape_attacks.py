"""Adversarial checks of how a decode staging area is shaped and shared by prefills at several larger TPs.

Written by a reviewer briefed only with the promises of the half-heads slots:

1. the first larger prefill TP that registers (and can stage) shapes the slots: half the decode rank's heads
   where that TP's ranks' heads divide the half, else that TP's own slice;
2. a TP whose ranks hold ``r`` times fewer heads than a slot registers the area as pages of its own size,
   ``r`` to a slot;
3. a room of ``n`` pages takes ``n`` of the decode's pages' worth of the area whatever the prefill TP and
   PP (so an area of exactly ``n`` decode pages serves it), and one needing more than the area fails at once
   naming ``decode_staging_bytes``;
4. ranks holding more heads than a slot, or a share that does not divide it (or a page under the 16-byte
   marker), go per token, and the decode logs ONE warning per such prefill instance;
5. the bytes are per token's.

Harnesses: ``MixRig``/``World`` and ``mixed_rooms`` from ``test_mixed_tp_staging_attacks`` (real decode core
and area; the latter with real prefill cores, the codec and the data plane's kernels), ``AreaRig`` (a
``MixRig`` whose area holds a given number of the decode's pages, with any decode PP stage) and ``TinyRig``
(pages of one token and heads of a few bytes, for the marker's floor).

Three warning tests caught a bug of the first version (fixed): the warning was keyed on the prefill rank
being TP rank 0 of PP stage 0, so a decode rank that never registers with that rank (decode TP rank > 0, a
decode PP stage > 0) never warned, and each DP group's rank 0 warned again. It is now once per instance.
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
from asynckv.errors import InvalidArgument, LayoutMismatch
from asynckv.layout import KVArgs
from asynckv.proto import actions as act
from asynckv.proto.decode import DecodeCore
from asynckv.proto.messages import TransferInfo
from asynckv.proto.receiver import ReceiverRoom
from asynckv.proto.states import KVPoll, ReceiverState
from asynckv.proto.topology import PrefillInstance
from asynckv.service.decode_staging import MARK, DecodeStaging

from .staging_rig import ADDR, ADDR_B, ME, PAGE, Rig, assert_nothing_leaks, decode_register, instance, prank
from .test_mixed_tp_staging_attacks import Fuzz, MixRig, World, check_slots, heads_of, mixed_rooms

U8 = npt.NDArray[np.uint8]
WARNING = "writes into this rank per token"


def slot_heads(ours: int, first: int) -> int:
    """Promise 1: the heads of a slot, ``first`` the heads of a rank of the TP that shaped the area."""
    return ours // 2 if ours % 2 == 0 and (ours // 2) % first == 0 else first


def pages_a_slot(slot: int, theirs: int) -> int:
    """Promise 2 and 4: how many of a rank's pages a slot holds (0: that TP goes per token)."""
    return slot // theirs if theirs <= slot and slot % theirs == 0 else 0


def larger_tps(heads: int, tp: int, top: int = 16) -> list[int]:
    """Prefill TPs above ``tp`` that pair with it and split ``heads`` (or replicate them) evenly."""
    return [t for t in range(tp + 1, top + 1) if t % tp == 0 and (heads % t == 0 or t % heads == 0)]


class AreaRig(MixRig):
    """A ``MixRig`` whose area holds ``pages`` of the decode rank's pages (all entries), of decode PP stage
    ``pp_rank`` of ``pp``; the instance at ``ADDR`` is TP ``first`` (nothing shaped until it registers)."""

    def __init__(self, heads: int, first: int, pages: float, tp: int = 1, engine_rank: int = 0, pp: int = 1,
                 pp_rank: int = 0, config: Config | None = None, seed: int = 0) -> None:
        super().__init__(heads, first, slots=1, tp=tp, engine_rank=engine_rank, config=config, seed=seed)
        args = dataclasses.replace(self.core.kv_args, pp_size=pp, pp_rank=pp_rank)
        self.page_bytes = int(sum(args.kv_item_lens))
        self.staging = DecodeStaging(int(pages * self.page_bytes), args)
        self.core = DecodeCore(ME, "tcp://10.0.0.9:5000", args, self.config, decode_register(args),
                               itertools.count(1), self.staging)
        if pp == 1:
            self.core.topology_fetched(ADDR, self.inst, self.now)


class Warnings(logging.Handler):
    """The per-token warnings of ``asynckv.decode``, by the prefill address they name."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.addrs: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if WARNING in msg:
            self.addrs.append(msg.split()[1])


@pytest.fixture
def warnings() -> Any:
    handler, log = Warnings(), logging.getLogger("asynckv.decode")
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.WARNING)
    try:
        yield handler
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


def shape_of(st: DecodeStaging) -> tuple[int | None, int | None]:
    """(the TP that shaped the area, a slot's heads), read afresh (mypy narrows attributes)."""
    return st.tp_prefill, st.slot_heads


def held(rig: MixRig) -> int:
    return rig.staging.slots - rig.staging.free_slots


def finish_all(w: World, rooms: list[ReceiverRoom]) -> None:
    for room in rooms:
        w.finish(room)
    w.check()
    assert_nothing_leaks(w.rig)


# -- 1. promise 3 over many layouts: n pages take n decode pages of the area, an area of exactly n serves them -----


def _capacity_layouts() -> list[tuple[int, int, int, int, int, int]]:
    out = []
    for heads, tp in itertools.product((2, 3, 4, 6, 8, 10, 12, 16), (1, 2, 4)):
        if heads % tp or heads // tp < 2:
            continue
        tps = larger_tps(heads, tp)
        for rank in sorted({0, tp - 1}):
            for i, (first, later) in enumerate(itertools.product(tps, tps)):
                out.append((heads, tp, rank, first, later, 1 + (i + rank) % 3))
    return out


CAPACITY = _capacity_layouts()


def test_every_layout_a_room_takes_its_pages_worth_and_an_area_of_exactly_that_serves_it() -> None:
    """Heads 2-16 (odd ones too), decode TP 1/2/4 (first and last rank), every pair of larger prefill TPs up to 16
    (replicated heads too) in both orders, the later at PP 1-3; the area holds exactly 3 of the decode's pages.
    A 3-page room of either TP is served at once (never waits, never fails) taking exactly 3 decode pages' worth
    of slots where it stages; a 4-page room of a staged TP fails at once naming the setting (a per-token one goes
    on); which TPs stage follows promises 1, 2 and 4; every byte ends as per token's."""
    bad: list[str] = []
    for heads, tp, rank, first, later, pp in CAPACITY:
        where = f"h{heads} d{tp}r{rank} tp{first} then tp{later}pp{pp}"
        rig = AreaRig(heads, first, 3, tp=tp, engine_rank=rank)
        w = World(rig)
        a = rig.room(1, [0, 1, 2])
        w.absorb(rig.register_all())
        st = rig.staging
        slot = slot_heads(rig.hd, max(1, heads // first))
        if st.slot_heads != slot or st.tp_prefill != first:
            bad.append(f"{where}: shaped {st.tp_prefill}/{st.slot_heads}, expected {first}/{slot}")
            continue
        slot_bytes = int(st.slot_items.sum())
        rooms = [a]
        for room, tp_p in ((a, first), (None, later)):
            if room is None:
                rig.add(later, pp=pp)
                room = rig.room(2, [4, 5, 6], addr=ADDR_B)
                w.absorb(rig.register_all())
                rooms.append(room)
            r = pages_a_slot(slot, max(1, heads // tp_p))
            if room.state is not ReceiverState.WAITING:
                bad.append(f"{where}: the TP {tp_p} room of the area's size is {room.state.name}: {room.exception}")
            elif bool(room.staged) != bool(r):
                bad.append(f"{where}: TP {tp_p} staged {bool(room.staged)}, expected r={r}")
            elif r and (held(rig) * slot_bytes, st.per_slot(tp_p)) != (3 * rig.page_bytes, r):
                bad.append(f"{where}: TP {tp_p} room holds {held(rig)} slots of {slot_bytes} bytes, per slot "
                           f"{st.per_slot(tp_p)}; expected 3 pages of {rig.page_bytes} bytes, {r} to a slot")
            w.finish(room)
        big = rig.room(3, [7, 8, 9, 10], addr=ADDR_B)
        w.absorb(rig.register_all())
        if pages_a_slot(slot, max(1, heads // later)):
            if big.poll() is not KVPoll.Failed or "decode_staging_bytes" not in str(big.exception) \
                    or not isinstance(big.exception, InvalidArgument):
                bad.append(f"{where}: a room one page larger than the area is {big.state.name}: {big.exception}")
        else:
            w.finish(big)
        w.check()
        if st.free_slots != st.slots or rig.core._slot_waiters:
            bad.append(f"{where}: slots held after every room")
    assert not bad, bad[:8]
    assert len(CAPACITY) > 300


FULL = [  # (heads, decode TP, decode rank, [(prefill TP, PP)] in registration order, state)
    (6, 1, 0, [(3, 1), (6, 2), (2, 1)], "none"), (6, 1, 0, [(6, 1), (2, 3), (3, 1)], "none"),
    (6, 1, 0, [(2, 1), (6, 1), (12, 2)], "none"), (10, 1, 0, [(5, 1), (10, 2), (2, 1)], "none"),
    (10, 1, 0, [(10, 1), (2, 1), (5, 3)], "none"), (12, 1, 0, [(3, 1), (12, 1), (4, 2)], "none"),
    (12, 1, 0, [(4, 1), (3, 1), (6, 3)], "none"), (12, 2, 1, [(6, 1), (4, 1), (12, 2)], "none"),
    (12, 3, 2, [(6, 1), (12, 2)], "none"), (9, 3, 1, [(9, 2), (18, 1)], "none"),
    (8, 1, 0, [(16, 1), (2, 3), (8, 1), (4, 2)], "none"), (8, 2, 1, [(16, 2), (4, 1), (8, 3)], "none"),
    (8, 4, 3, [(16, 1), (8, 2)], "none"), (4, 2, 1, [(8, 1), (4, 3)], "none"),
    (2, 1, 0, [(8, 1), (2, 1), (4, 1)], "mamba"), (4, 1, 0, [(16, 1), (2, 1), (8, 1)], "mamba"),
    (4, 2, 1, [(16, 1), (8, 1)], "mamba"), (6, 1, 0, [(3, 1), (6, 1), (2, 1)], "swa"),
    (6, 2, 1, [(6, 1), (12, 1)], "nsa"), (12, 1, 0, [(6, 1), (4, 1), (12, 1)], "swa"),
]


@pytest.mark.parametrize("heads, tp, rank, prefills, state", FULL,
                         ids=[f"h{h}-d{t}r{k}-" + "then".join(f"tp{a}pp{b}" for a, b in p) + f"-{s}"
                              for h, t, k, p, s in FULL])
def test_rooms_filling_the_area_exactly_through_real_prefill_cores_are_served(
        heads: int, tp: int, rank: int, prefills: list[tuple[int, int]], state: str) -> None:
    """Real prefill cores, the codec and the kernels; odd heads, replicated heads (mamba state split by TP: state-
    only ranks), PP stages: an area of exactly 3 decode pages, each instance's 3-page room in turn (the first
    shapes it). Every room succeeds byte for byte, nothing is written outside a registered buffer, nothing is
    held after; the staged Registers name pages of the rank's own size (promise 2)."""
    bad, area, registers, _ = mixed_rooms(heads, tp, rank, prefills, state, concurrent=False, slots=3)
    assert not bad, bad[:6]
    assert area is not None and area.tp_prefill == prefills[0][0]
    ours = heads // tp
    slot = slot_heads(ours, max(1, heads // prefills[0][0]))
    assert area.slot_heads == slot and area.slots * slot == 3 * ours
    for agent, reg in registers.items():
        tp_p = prefills[int(agent[1])][0]
        r = pages_a_slot(slot, max(1, heads // tp_p))
        if r:
            assert reg.tp_size == tp_p and list(reg.kv_item_lens) == [int(x) // r for x in area.slot_items], agent
        else:
            assert reg.tp_size == tp and reg.state_tp_size == 0, agent


# -- 2. odd head counts: every registration order, which TPs stage, the warning once per instance ------------------

ODD = [  # (heads, the prefill TPs registering, in every order), decode TP1 rank 0 (the equal TP1 among them)
    (6, (1, 2, 3, 6)), (10, (2, 5, 10)), (12, (3, 4, 6)), (12, (2, 3, 12)), (9, (3, 9)), (8, (2, 4, 16)),
]
ORDERS = [(heads, order) for heads, tps in ODD for n in (2, 3) for order in itertools.permutations(tps, n)
          if len(order) == n]


@pytest.mark.parametrize("heads, order", ORDERS, ids=[f"h{h}-" + "then".join(f"tp{t}" for t in o) for h, o in ORDERS])
def test_every_registration_order_stages_by_the_first_larger_tp_and_warns_once_per_per_token_instance(
        heads: int, order: tuple[int, ...], warnings: Warnings) -> None:
    """Each instance registers (one room, then a second room from it) in this order: the first larger TP shapes
    the slots (promise 1), each other larger TP stages ``r`` to a slot or goes per token (promises 2, 4); each
    per-token larger TP is named in exactly one warning for its two rooms, a staged or an equal TP in none;
    every room of every instance in flight together ends with per token's bytes."""
    rig = MixRig(heads, order[0], slots=240)
    w = World(rig)
    rooms, shaper = [], None
    for i, tp_p in enumerate(order):
        addr = ADDR if i == 0 else f"10.0.0.{i + 1}:8998"
        if i:
            rig.add(tp_p, addr=addr, prefix=f"i{i}")
        for k in range(2):
            rooms.append(rig.room(10 * i + k, [20 * k + 3 * i, 20 * k + 3 * i + 1], addr=addr))
            w.absorb(rig.register_all())
        shaper = shaper or (tp_p if tp_p > 1 else None)
    assert rig.staging.tp_prefill == shaper
    slot = slot_heads(heads, max(1, heads // shaper)) if shaper else None
    assert rig.staging.slot_heads == slot
    want_warned = []
    for i, tp_p in enumerate(order):
        addr = ADDR if i == 0 else f"10.0.0.{i + 1}:8998"
        r = pages_a_slot(slot, max(1, heads // tp_p)) if slot and tp_p > 1 else 0
        for room in rooms[2 * i:2 * i + 2]:
            assert room.state is ReceiverState.WAITING, (tp_p, room.state, room.exception)
            assert bool(room.staged) == bool(r), (tp_p, r)
            if r:
                assert {part.sub for part in room.staged.values()} == set(range(r))
        if tp_p > 1 and not r:
            want_warned.append(addr)
    assert sorted(warnings.addrs) == sorted(want_warned)
    check_slots(rig, rooms)
    finish_all(w, rooms[::-1])


def test_a_tp_that_does_not_pair_with_the_decode_shapes_nothing_and_a_later_one_does(warnings: Warnings) -> None:
    """Decode TP2 rank 1 over 12 heads: a TP3 room fails (3 and 2 do not divide) without shaping the area or a
    warning; TP6 then shapes it (2 heads: half of 6 is 3, which 2 does not divide, so its own slice); TP12 shares
    it two to a slot, TP4 (3 heads) goes per token; all three rooms land as per token."""
    rig = MixRig(12, 3, slots=60, tp=2, engine_rank=1)
    w = World(rig)
    bad = rig.room(1, [0])
    w.absorb(rig.register_all())
    assert bad.poll() is KVPoll.Failed and isinstance(bad.exception, LayoutMismatch)
    assert rig.staging.tp_prefill is None and rig.staging.slot_heads is None and not warnings.addrs
    rooms = []
    for i, tp_p in enumerate((6, 12, 4)):
        addr = f"10.0.1.{i}:8998"
        rig.add(tp_p, addr=addr, prefix=f"i{i}")
        rooms.append(rig.room(2 + i, [3 * i + 2, 3 * i + 3, 3 * i + 4], addr=addr))
        w.absorb(rig.register_all())
    assert shape_of(rig.staging) == (6, 2)
    assert [bool(r.staged) for r in rooms] == [True, True, False]
    assert rig.staging.per_slot(6) == 1 and rig.staging.per_slot(12) == 2
    assert held(rig) == 3 * 3 + 3 * 3  # (6 heads from 3 TP6 ranks, or 6 TP12 ranks two to a slot, 2 heads a slot)
    rig.core.clear_receiver(bad, rig.now)
    finish_all(w, rooms)


# -- 3. the warning: once per prefill instance on every decode rank -----------------------------------------------


def test_decode_rank_1_warns_once_about_a_per_token_prefill(warnings: Warnings) -> None:
    """Decode TP2 over 12 heads, slots shaped by TP6 (2 heads a rank); a TP4 prefill (3 heads a rank: more than a
    slot) goes per token. Decode rank 1 registers with TP4 ranks 2 and 3 only: it must name the prefill once too
    (the first version logged nothing here). The next test is rank 0's control."""
    rig = MixRig(12, 6, slots=20, tp=2, engine_rank=1)
    w = World(rig)
    a = rig.room(1, [0])
    w.absorb(rig.register_all())
    rig.add(4)
    b = rig.room(2, [3], addr=ADDR_B)
    w.absorb(rig.register_all())
    assert a.staged and not b.staged
    finish_all(w, [a, b])
    assert warnings.addrs == [ADDR_B]


def test_decode_rank_0_warns_once_for_all_ranks_and_stages_of_a_per_token_prefill(warnings: Warnings) -> None:
    """The control of the test above that passes: rank 0, a TP4 PP2 prefill (8 ranks registering), three rooms."""
    rig = MixRig(12, 6, slots=40, tp=2, engine_rank=0)
    w = World(rig)
    a = rig.room(1, [0])
    w.absorb(rig.register_all())
    rig.add(4, pp=2)
    rooms = [rig.room(2 + k, [3 + k], addr=ADDR_B) for k in range(3)]
    w.absorb(rig.register_all())
    assert warnings.addrs == [ADDR_B]
    finish_all(w, [a, *rooms])


def _dp_instance(tp: int, dp: int, host: str = "10.0.0.2") -> PrefillInstance:
    ranks = {}
    for d, t in itertools.product(range(dp), range(tp)):
        rank = prank(tp, t, f"dp{d}", host)
        endpoint = f"tcp://{host}:{17000 + 100 * d + t}"
        ranks[(d, t, 0)] = dataclasses.replace(rank, dp_size=dp, dp_rank=d, endpoint=endpoint)
    return PrefillInstance(tp_size=tp, pp_size=1, dp_size=dp, page_size=PAGE, kv_dtype="bfloat16", is_mla=False,
                           protocol_version=ranks[(0, 0, 0)].protocol_version, ranks=ranks)


def test_a_per_token_prefill_with_two_dp_groups_is_named_once(warnings: Warnings) -> None:
    """6 heads, slots shaped by TP3 (2 heads); a TP2 DP2 prefill (3 heads a rank) goes per token. Rooms of both DP
    groups register with both groups' rank 0: one warning for the instance (the first version logged two)."""
    rig = MixRig(6, 3, slots=20)
    w = World(rig)
    a = rig.room(1, [0])
    w.absorb(rig.register_all())
    rig.core.topology_fetched(ADDR_B, _dp_instance(2, 2), rig.now)
    rooms = [rig.room(k, [2 + k], addr=ADDR_B) for k in (2, 3)]  # (DP groups 0 and 1)
    w.absorb(rig.register_all())
    assert not any(r.staged for r in rooms)
    finish_all(w, [a, *rooms])
    assert warnings.addrs == [ADDR_B]


def test_a_decode_pp_stage_1_warns_about_a_per_token_prefill(warnings: Warnings) -> None:
    """Decode PP2 stage 1 (equal PP: it registers with the prefill's stage 1 only), 6 heads, slots shaped by TP3;
    a TP2 PP2 prefill goes per token: stage 1 names it once (the first version logged nothing)."""
    rig = AreaRig(6, 3, 4, pp=2, pp_rank=1)
    rig.add(3, addr="10.0.0.3:8998", prefix="shaper", pp=2)
    rig.core.preconnect("10.0.0.3:8998", rig.now)
    rig.register_all()
    assert rig.staging.slot_heads == 2
    rig.add(2, pp=2)
    room = rig.room(2, [3], addr=ADDR_B)
    rig.register_all()
    assert room.state is ReceiverState.WAITING and not room.staged
    assert warnings.addrs == [ADDR_B]


# -- 4. the marker's floor: pages under 16 bytes never stage and never corrupt ------------------------------------

TINY_HEADS, TINY_ENTRIES, TINY_PAGES = 8, 4, 16


class TinyRig(Rig):
    """A decode TP1 rank of 8 heads with one-token pages and heads of ``hb`` bytes (a rank of ``h`` heads has pages
    of ``h * hb`` bytes), an area of ``decode_pages`` of its pages, the instance at ``ADDR`` at TP ``first``."""

    def __init__(self, hb: int, first: int, decode_pages: int = 12, hbs: tuple[int, ...] | None = None) -> None:
        self.hbs = hbs or (hb,) * TINY_ENTRIES
        self.pools = [np.random.default_rng(3).integers(0, 256, TINY_PAGES * TINY_HEADS * b, dtype=np.uint8)
                   for b in self.hbs]
        self.nsa = None
        args = KVArgs(kv_data_ptrs=[int(x.ctypes.data) for x in self.pools],
                      kv_data_lens=[x.nbytes for x in self.pools],
                      kv_item_lens=[TINY_HEADS * b for b in self.hbs], aux_data_ptrs=[], aux_data_lens=[],
                      aux_item_lens=[], page_size=1, tp_size=1, engine_rank=0, kv_head_num=TINY_HEADS,
                      total_kv_head_num=TINY_HEADS)
        self.staging = DecodeStaging(decode_pages * TINY_HEADS * sum(self.hbs), args)
        self.config = Config()
        register = dataclasses.replace(decode_register(args), page_size=1)
        self.core = DecodeCore(ME, "tcp://10.0.0.9:5000", args, self.config, register, itertools.count(1),
                               self.staging)
        self.now = 0.0
        self.core.topology_fetched(ADDR, tiny_instance(first), self.now)
        self.out: list[Any] = []
        self.sessions: dict[str, int] = {}
        self.registers: dict[str, Any] = {}
        self.expect = [x.copy() for x in self.pools]
        self.infos: dict[tuple[int, str], TransferInfo] = {}

    def run(self, room: ReceiverRoom, seed: int) -> None:
        """Every real rank writes its heads of the room's pages as its Register and TransferInfo say (pages of the
        area, or its heads of each decode page in place), succeeds, and the copy runs; the expectation follows."""
        model = [np.random.default_rng(seed).integers(0, 256, (len(room.pages), TINY_HEADS, b), dtype=np.uint8)
                 for b in self.hbs]
        st = self.staging
        for agent, prog in room.ranks.items():
            if prog.dummy:
                continue
            reg, info = self.registers[agent], self.infos[(room.room, agent)]
            heads = heads_of(prog.rank, TINY_HEADS)
            staged = st.addr <= reg.kv_ptrs[0] < st.addr + st.capacity
            for e, b in enumerate(self.hbs):
                for pos, k in enumerate(info.dst_pages.tolist()):
                    block = model[e][pos, heads.start:heads.stop].reshape(-1)
                    if staged:
                        assert reg.kv_item_lens[e] == block.nbytes >= MARK
                        off = reg.kv_ptrs[e] - st.addr + k * reg.kv_item_lens[e]
                        st.buffer[off:off + block.nbytes] = block
                    else:
                        self.pools[e][k * TINY_HEADS * b + heads.start * b:k * TINY_HEADS * b + heads.stop * b] = block
        for e, b in enumerate(self.hbs):
            rows = self.expect[e].reshape(TINY_PAGES, TINY_HEADS * b)
            rows[room.pages] = model[e].reshape(len(room.pages), -1)
        out = self.succeed(room)
        for a in out:
            if isinstance(a, act.Scatter):
                st.scatter(room.pages, a.slices)
                self.core.scattered(room, None, self.now)
        assert room.poll() is KVPoll.Success, room.exception

    def open(self, room: int, pages: list[int], addr: str = ADDR) -> ReceiverRoom:
        r: ReceiverRoom = self.room(room, pages, addr=addr)
        for a in self.register_all():
            if isinstance(a, act.Send) and isinstance(a.msg, TransferInfo):
                self.infos[(a.msg.room, a.msg.prefill_id)] = a.msg
        return r

    def check(self) -> None:
        for e in range(TINY_ENTRIES):
            assert np.array_equal(self.pools[e], self.expect[e]), f"entry {e} differs from per token"


def tiny_instance(tp: int, prefix: str = "prefill", host: str = "10.0.0.1") -> PrefillInstance:
    return dataclasses.replace(instance(tp, prefix, host), page_size=1)


def tiny(hb: int, first: int, **kw: Any) -> TinyRig:
    return TinyRig(hb, first, **kw)


@pytest.mark.parametrize("hb, first, later, staged", [
    (8, 8, 2, (False, True, True)),  # TP8 pages 8 bytes: cannot shape; TP2 shapes half; TP4 pages 16 bytes: stage
    (8, 2, 8, (True, False, True)),  # (third room: TP4) TP8 under the marker after TP2 shaped
    (4, 4, 2, (False, True, False)),  # TP4 pages 8 bytes, TP2 16 bytes (shapes), then TP8 (4 bytes)
    (2, 2, 4, (False, False, False)),  # every rank's pages under 16 bytes: never shaped
])
def test_pages_under_the_marker_never_stage_and_land_as_per_token(hb: int, first: int, later: int,
                                                                 staged: tuple[bool, ...], warnings: Warnings) -> None:
    """One-token pages of ``hb``-byte heads (8 heads): a TP whose rank's page is under 16 bytes cannot shape the
    area (a later TP still can) nor stage into one shaped by another, it writes per token (named in one warning);
    the rooms of the three instances (first, later, then a TP4 or TP8 one), in flight together, end as per token."""
    rig = tiny(hb, first)
    third = 4 if 8 in (first, later) else 8
    addrs = [ADDR, ADDR_B, "10.0.0.3:8998"]
    rig.core.topology_fetched(ADDR_B, tiny_instance(later, "late", "10.0.0.2"), rig.now)
    rig.core.topology_fetched(addrs[2], tiny_instance(third, "third", "10.0.0.3"), rig.now)
    rooms = [rig.open(1 + i, [3 * i, 3 * i + 1, 3 * i + 2], addr=addr) for i, addr in enumerate(addrs)]
    assert tuple(bool(r.staged) for r in rooms) == staged
    pages = {1: 8 * hb, 2: 4 * hb, 4: 2 * hb, 8: hb}
    assert sorted(warnings.addrs) == sorted(a for a, tp_p in zip(addrs, (first, later, third), strict=True)
                                            if pages[tp_p] < MARK)
    if rig.staging.slot_heads is not None:
        assert rig.staging.slot_heads == 4 and int(rig.staging.slot_items.min()) == 4 * hb
    for i, room in enumerate(rooms[::-1]):
        rig.run(room, seed=i)
    rig.check()
    assert_nothing_leaks(rig)


def test_an_entry_whose_heads_are_too_small_for_the_marker_keeps_the_whole_area_unshaped(warnings: Warnings) -> None:
    """Entries of 8- and 2-byte heads (one-token pages): a TP2 rank's page of the small entries is 8 bytes, so
    the area cannot be shaped by any TP (the marker must fit every entry's page); rooms go per token, unharmed."""
    rig = tiny(8, 2, hbs=(8, 2, 8, 2))
    room = rig.open(1, [4, 9])
    assert rig.staging.slot_heads is None and not room.staged and warnings.addrs == [ADDR]
    rig.run(room, seed=5)
    rig.check()


# -- 5. fuzzing: odd heads, a per-token TP beside a staged one, PP stages -----------------------------------------

FUZZ = [  # (heads, decode TP, decode rank, first TP, later TP, slots of the first's pages, later PP)
    (6, 1, 0, 3, 2, 9, 1), (12, 2, 1, 6, 4, 10, 1), (10, 1, 0, 5, 10, 9, 2), (6, 1, 0, 6, 2, 9, 3),
    (12, 1, 0, 3, 12, 12, 3), (8, 1, 0, 16, 2, 24, 2), (8, 2, 1, 16, 4, 12, 1),
]


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("heads, tp, rank, first, later, slots, pp", FUZZ,
                         ids=[f"h{h}-d{t}r{k}-tp{a}and{b}pp{p}-{s}slots" for h, t, k, a, b, s, p in FUZZ])
def test_random_interleavings_with_odd_heads_and_a_replicated_shaper_keep_every_slot_promise(
        heads: int, tp: int, rank: int, first: int, later: int, slots: int, pp: int, seed: int) -> None:
    """``Fuzz`` (aborts, clears, liars, timeouts, restarts) over layouts the earlier fuzzing lacked: odd heads with
    the later TP staged or per token, a replicated TP16 shaping half-heads slots that a TP2 or TP4 then shares.
    After every event the allocator's invariants hold; at the end every byte is per token's, nothing is held."""
    f = Fuzz(seed, heads, tp, rank, first, later, slots, pp)
    for _ in range(200):
        f.step()
    f.drain()
    assert f.seen["success"] >= 3 and f.seen["failed"] >= 3, f.seen
