"""Attacks on protocol v5's state rank (``Register.state_tp_size``, ``state_engine_rank``, ``state_head_num``).

A decode rank with a staging area registers with a prefill rank of a larger TP *as a decode rank of that
prefill's TP* (its KV pool: staging slots), and names its real rank for the state, which the prefill
writes straight into the real state buffers. The promises attacked here:

1. staged or per token, the same state bytes land at the same places (and the KV bytes are right);
2. state the same on every prefill TP rank (NSA, a mamba entry of dim 0, SWA or NSA of MLA) is written
   into each decode rank once per PP stage, never by every staged rank nor by none; every staged rank
   gets the room's state indices;
3. an inconsistent or hostile Register is refused naming the values, never an exception out of the
   prefill core nor a plan writing outside the claimed buffers;
4. ``state_tp_size`` 0 plans exactly as the real rank's own fields;
5. the wire is v5.

``transfer`` runs one room sans IO, end to end: a real ``DecodeCore`` (with a real ``DecodeStaging`` or
none), one real ``PrefillCore`` per prefill rank, every message through the codec, every ``Post`` turned
into descriptors with the kernels the data plane uses and copied between numpy buffers (a descriptor
outside every registered buffer is recorded), statuses back, the staged slices scattered. Each element of
the full model is random, so a byte landing anywhere but its place shows.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import json
import struct
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from asynckv.config import Config
from asynckv.errors import LayoutMismatch, RemoteProtocolError
from asynckv.kernels import block_descriptors, head_slice_descriptors, kv_page_descriptors
from asynckv.layout import KVArgs
from asynckv.proto import actions as act
from asynckv.proto.bootstrap import PrefillRank
from asynckv.proto.decode import DecodeCore
from asynckv.proto.destinations import CheckDestination
from asynckv.proto.messages import (
    MAGIC,
    PROTOCOL_VERSION,
    Register,
    RegisterResult,
    TransferInfo,
    VersionMismatch,
    decode,
    encode,
    pack,
)
from asynckv.proto.prefill import PrefillCore
from asynckv.proto.registration import state_rank
from asynckv.proto.states import ReceiverState
from asynckv.proto.topology import PeerPlan, PrefillInstance, plan_peer, plan_targets, stub_agent_metadata
from asynckv.service.decode_staging import DecodeStaging, applies
from asynckv.service.manager import _register_template

PAGE, HB, NSA_ROW = 4, 8, 16
"""Tokens per page, bytes per KV head per token, bytes of the NSA index row per token."""
POOL, SLOTS, LAYERS = 12, 4, 6
MAMBA = ((16, 2, 2), (0, 1, 24))
"""Mamba entries per layer: (full sliced dim, rows before it, bytes per element); dim 0: replicated, 24 bytes."""
SRC, DST = [7, 2, 9], [10, 0, 6]
STATE_SRC, STATE_DST = {"mamba": [3], "swa": [5, 1], "nsa": [5, 1]}, {"mamba": [1], "swa": [8, 3], "nsa": [8, 3]}
ME, DEC_EP, ADDR = "decode-attack", "tcp://10.0.0.9:5000", "10.0.0.1:8998"
ROOM = 7


@dataclasses.dataclass(frozen=True)
class Geo:
    tp_p: int
    tp_d: int
    heads: int
    pp_p: int = 1
    pp_d: int = 1
    state: str = "none"
    mla: bool = False

    def heads_on(self, tp: int, rank: int) -> range:
        if self.mla:
            return range(1)
        per = max(1, self.heads // tp)
        group = rank // max(1, tp // self.heads)
        return range(group * per, (group + 1) * per)

    def layers_on(self, pp: int, stage: int) -> list[int]:
        per = LAYERS // pp
        return list(range(stage * per, (stage + 1) * per))

    @property
    def kinds(self) -> list[int]:
        return [0] if self.mla else [0, 1]

    @property
    def mamba(self) -> tuple[tuple[int, int, int], ...]:
        return MAMBA[1:] if self.mla else MAMBA  # (MLA state is the same on every rank: replicated only)

    @property
    def total_heads(self) -> int:
        return 1 if self.mla else self.heads

    def __str__(self) -> str:
        kind = "mla" if self.mla else f"h{self.heads}"
        return f"tp{self.tp_p}to{self.tp_d}-pp{self.pp_p}to{self.pp_d}-{kind}-{self.state}"


class Model:
    """The full model's values (random bytes, fixed seed), by key, made on first use."""

    def __init__(self, geo: Geo, seed: int = 1) -> None:
        self.geo, self.rng = geo, np.random.default_rng(seed)
        self.cache: dict[tuple[Any, ...], np.ndarray] = {}

    def _get(self, key: tuple[Any, ...], shape: tuple[int, ...]) -> np.ndarray:
        if key not in self.cache:
            self.cache[key] = np.asarray(self.rng.integers(0, 256, shape, dtype=np.uint8))
        return self.cache[key]

    def kv(self, kind: int, layer: int) -> np.ndarray:
        return self._get(("kv", kind, layer), (len(SRC), PAGE, self.geo.total_heads, HB))

    def state(self, key: tuple[int, int], heads: range, tp: int, rank: int) -> np.ndarray:
        """What a rank (TP ``tp``, rank ``rank``, these heads) holds of state entry ``key`` for the room."""
        kind, layer = key
        g = self.geo
        if g.state == "swa":
            return self._get(("swa", kind, layer), (2, PAGE, g.total_heads, HB))[:, :, heads.start:heads.stop]
        if g.state == "nsa":
            return self._get(("nsa", layer), (2, PAGE, 1, NSA_ROW))
        dim, outer, elem = g.mamba[kind - 20]
        if dim == 0:
            return self._get(("mamba", kind, layer), (1, elem))
        per = dim // tp
        return self._get(("mamba", kind, layer), (1, outer, dim, elem))[:, :, rank * per:(rank + 1) * per]


@dataclasses.dataclass
class Buffers:
    args: KVArgs
    heads: range
    kv: list[np.ndarray]
    kv_keys: list[tuple[int, int]]
    state: list[np.ndarray]
    state_keys: list[tuple[int, int]]


def build(geo: Geo, tp: int, rank: int, pp: int, stage: int) -> Buffers:
    heads, layers = geo.heads_on(tp, rank), geo.layers_on(pp, stage)
    kv_keys = [(k, layer) for k in geo.kinds for layer in layers]
    kv = [np.zeros((POOL, PAGE, len(heads), HB), dtype=np.uint8) for _ in kv_keys]
    state: list[np.ndarray] = []
    state_keys: list[tuple[int, int]] = []
    extra: dict[str, Any] = {}
    if geo.state == "swa":
        state_keys = [(10 + k, layer) for k in geo.kinds for layer in layers]
        state = [np.zeros((POOL, PAGE, len(heads), HB), dtype=np.uint8) for _ in state_keys]
    elif geo.state == "nsa":
        state_keys = [(3, layer) for layer in layers]
        state = [np.zeros((POOL, PAGE, 1, NSA_ROW), dtype=np.uint8) for _ in state_keys]
    elif geo.state == "mamba":
        state_keys = [(20 + e, layer) for layer in layers for e in range(len(geo.mamba))]
        for kind, _ in state_keys:
            dim, outer, elem = geo.mamba[kind - 20]
            state.append(np.zeros((SLOTS, elem) if dim == 0 else (SLOTS, outer, dim // tp, elem), dtype=np.uint8))
        extra = dict(state_dim_per_tensor=[geo.mamba[k - 20][0] // tp for k, _ in state_keys],
                     state_outer=[geo.mamba[k - 20][1] if geo.mamba[k - 20][0] else 1 for k, _ in state_keys])
    if state:
        extra.update(state_type=geo.state, state_layer_ids=[layer for _, layer in state_keys])
    args = KVArgs.from_arrays(kv, page_size=PAGE, state=state, engine_rank=rank, tp_size=tp, pp_rank=stage, pp_size=pp,
                              is_mla=geo.mla, kv_head_num=len(heads), total_kv_head_num=geo.total_heads,
                              kv_layer_ids=[layer for _, layer in kv_keys], **extra)
    return Buffers(args, heads, kv, kv_keys, state, state_keys)


def fill(model: Model, b: Buffers) -> None:
    a = b.args
    for arr, (kind, layer) in zip(b.kv, b.kv_keys, strict=True):
        arr[SRC] = model.kv(kind, layer)[:, :, b.heads.start:b.heads.stop]
    for arr, key in zip(b.state, b.state_keys, strict=True):
        arr[STATE_SRC[model.geo.state]] = model.state(key, b.heads, a.tp_size, a.engine_rank)


def check_decode(model: Model, b: Buffers) -> list[str]:
    """What is wrong in a decode rank's buffers after the room (empty: every byte where it belongs)."""
    a, bad = b.args, []
    for arr, (kind, layer) in zip(b.kv, b.kv_keys, strict=True):
        if not np.array_equal(arr[DST], model.kv(kind, layer)[:, :, b.heads.start:b.heads.stop]):
            bad.append(f"KV {(kind, layer)} wrong")
        if np.delete(arr, DST, axis=0).any():
            bad.append(f"KV {(kind, layer)}: a page outside the room written")
    for arr, key in zip(b.state, b.state_keys, strict=True):
        dst = STATE_DST[model.geo.state]
        if not np.array_equal(arr[dst], model.state(key, b.heads, a.tp_size, a.engine_rank)):
            bad.append(f"state {key} wrong")
        if np.delete(arr, dst, axis=0).any():
            bad.append(f"state {key}: a slot outside the room written")
    return bad


class Memory:
    """Registered buffers by address: descriptors are copied between them (one outside any is recorded)."""

    def __init__(self) -> None:
        self.bases: list[int] = []
        self.bufs: list[tuple[int, np.ndarray, tuple[Any, ...]]] = []
        self.outside: list[str] = []

    def add(self, arr: np.ndarray, tag: tuple[Any, ...]) -> None:
        base = int(arr.ctypes.data)
        i = bisect.bisect(self.bases, base)
        self.bases.insert(i, base)
        self.bufs.insert(i, (base, arr.reshape(-1).view(np.uint8), tag))

    def find(self, addr: int, n: int) -> tuple[np.ndarray, int, tuple[Any, ...]] | None:
        i = bisect.bisect(self.bases, addr) - 1
        if i < 0:
            return None
        base, flat, tag = self.bufs[i]
        return (flat, addr - base, tag) if addr + n <= base + flat.nbytes else None

    def copy(self, src: np.ndarray, dst: np.ndarray, what: str) -> list[tuple[Any, ...]]:
        """Copy (src, dst) descriptor rows; returns (src tag, src offset, dst tag, dst offset, length) of each."""
        done = []
        for (sa, n, _), (da, _, _) in zip(src.tolist(), dst.tolist(), strict=True):
            s, d = self.find(int(sa), int(n)), self.find(int(da), int(n))
            if s is None or d is None:
                self.outside.append(f"{what}: {n} bytes {sa:#x} -> {da:#x}")
                continue
            d[0][d[1]:d[1] + n] = s[0][s[1]:s[1] + n]
            done.append((s[2], s[1], d[2], d[1], int(n)))
        return done


def descriptors(local: KVArgs, reg: Register, plan: PeerPlan, post: act.Post) -> tuple[np.ndarray, np.ndarray]:
    """The descriptors the data plane builds for one post (``service.writes``: per token for head slices)."""
    u64 = np.uint64
    if post.kind == "kv":
        sp, si = np.asarray(local.kv_data_ptrs, u64)[plan.src_entries], np.asarray(local.kv_item_lens, u64)
        dp, di = np.asarray(reg.kv_ptrs, u64)[plan.dst_entries], np.asarray(reg.kv_item_lens, u64)
        si, di = si[plan.src_entries], di[plan.dst_entries]
        if plan.head_slice is None:
            return kv_page_descriptors(sp, dp, si, di, post.src, post.dst)
        h = plan.head_slice
        return head_slice_descriptors(sp, dp, si, di, local.page_size, post.src, post.dst, h.src_offs, h.dst_offs,
                                      h.nbytes)
    st = plan.state
    assert post.kind == "state" and st is not None, post.kind
    sp = np.asarray(local.state_data_ptrs, u64)[st.src_entries]
    si = np.asarray(local.state_item_lens, u64)[st.src_entries]
    dp, di = np.asarray(reg.state_ptrs, u64)[st.dst_entries], np.asarray(reg.state_item_lens, u64)[st.dst_entries]
    if st.kind == "blocks" and st.blocks is not None:
        return block_descriptors(sp, dp, si, di, int(post.src[0]), int(post.dst[0]), *st.blocks)
    if st.kind == "head_slice" and st.head_slice is not None:
        h = st.head_slice
        return head_slice_descriptors(sp, dp, si, di, local.page_size, post.src, post.dst, h.src_offs, h.dst_offs,
                                      h.nbytes)
    return kv_page_descriptors(sp, dp, si, di, post.src, post.dst)


def prank(geo: Geo, tp: int, pp: int) -> PrefillRank:
    return PrefillRank(tp_size=geo.tp_p, tp_rank=tp, pp_size=geo.pp_p, pp_rank=pp, dp_size=1, dp_rank=0,
                       endpoint=f"tcp://10.0.0.1:{17000 + 100 * pp + tp}", agent_id=f"prefill-{pp}-{tp}",
                       page_size=PAGE, kv_dtype="bfloat16", is_mla=geo.mla)


@dataclasses.dataclass
class Outcome:
    decode: Buffers
    staging: DecodeStaging | None
    registers: dict[str, Register]
    infos: dict[str, TransferInfo]
    state_writes: list[tuple[Any, ...]]
    """(prefill agent, src tag, src offset, dst tag, dst offset, length) of each state descriptor copied."""
    state_posts: Counter[str]
    outside: list[str]
    final: ReceiverState
    wrong: list[str]
    dummies: set[str]
    stage_of: dict[str, int]
    state_bytes: Counter[str] = dataclasses.field(default_factory=Counter)
    """State bytes each prefill core counted (its ``state_bytes`` stat: the metrics and the in-flight budget)."""


def pump(dcore: DecodeCore, pcores: dict[str, tuple[PrefillCore, Buffers]], by_endpoint: dict[str, str],
         mem: Memory, staging: DecodeStaging | None, now: float,
         sent: Callable[[str, Any], None] = lambda agent, msg: None,
         posted: Callable[[str, act.Post, list[Any]], None] = lambda agent, post, done: None) -> None:
    """Run a decode core and its prefill cores until no action is left: messages cross through the codec
    (``sent`` sees each of decode's), Scatters copy out of ``staging``, connections and destination checks
    succeed, and each post becomes descriptors whose bytes ``mem`` copies (``posted`` sees what it wrote)
    and settles at once."""
    busy = True
    while busy:
        busy = False
        for a in dcore.actions():
            busy = True
            if isinstance(a, act.Send):
                msg = wire(a.msg)
                agent = by_endpoint[a.endpoint]
                sent(agent, msg)
                pcores[agent][0].receive(msg, now)
            elif isinstance(a, act.Scatter):
                assert staging is not None
                staging.scatter(a.room.pages, a.slices)
                dcore.scattered(a.room, None, now)
        for agent, (core, b) in pcores.items():
            settle = []
            for a in core.actions():
                busy = True
                if isinstance(a, act.Send):
                    assert a.endpoint == dcore.endpoint, a
                    dcore.receive(wire(a.msg), now)
                elif isinstance(a, act.ConnectPeer):
                    core.peer_connected(a.peer, None, now)
                elif isinstance(a, CheckDestination):
                    core.destination_checked(a.token, a.run(), now)
                elif isinstance(a, act.Post):
                    peer = core.peers[a.peer]
                    src, dst = descriptors(b.args, peer.reg, peer.plan, a)
                    posted(agent, a, mem.copy(src, dst, f"{agent} {a.kind}"))
                    settle.append(a.post_id)
            for post_id in settle:
                core.post_settled(post_id, None, now)


def wire(msg: Any) -> Any:
    """Through the codec, as on the wire."""
    return decode([pack(encode(msg))])


def transfer(geo: Geo, d_rank: int, staged: bool, d_stage: int = 0, seed: int = 1, with_state: bool = True) -> Outcome:
    """One room from every prefill rank the decode rank (``d_rank`` of stage ``d_stage``) maps to, sans IO
    (``with_state`` False: a room of a hybrid model that carries no state indices)."""
    model, mem, now = Model(geo, seed), Memory(), 0.0
    dec = build(geo, geo.tp_d, d_rank, geo.pp_d, d_stage)
    for e, arr in enumerate(dec.kv):
        mem.add(arr, ("decode-kv", e))
    for e, arr in enumerate(dec.state):
        mem.add(arr, ("decode-state", e))
    staging = None
    if staged:
        assert applies(dec.args), "a DRAM MHA decode with state of any kind stages (promise 1)"
        staging = DecodeStaging(64 * int(sum(dec.args.kv_item_lens)), dec.args)
        mem.add(staging.buffer, ("staging",))
    register = _register_template(ME, DEC_EP, dec.args, (0, 0), stub_agent_metadata(ME))
    dcore = DecodeCore(ME, DEC_EP, dec.args, Config(), register, itertools.count(1), staging)
    ranks = {(0, t, p): prank(geo, t, p) for t in range(geo.tp_p) for p in range(geo.pp_p)}
    inst = PrefillInstance(tp_size=geo.tp_p, pp_size=geo.pp_p, dp_size=1, page_size=PAGE, kv_dtype="bfloat16",
                           is_mla=geo.mla, protocol_version=PROTOCOL_VERSION, ranks=ranks)
    plan = plan_targets(inst, room=ROOM, tp_size=geo.tp_d, engine_rank=d_rank, pp_size=geo.pp_d, pp_rank=d_stage,
                        is_mla=geo.mla, total_kv_heads=geo.total_heads)
    assert plan.required_dst_info_num == 1, "one decode rank drives the room: prefill TP >= decode TP only"
    pcores: dict[str, tuple[PrefillCore, Buffers]] = {}
    by_endpoint: dict[str, str] = {}
    for t in plan.targets:
        r = t.rank
        b = build(geo, geo.tp_p, r.tp_rank, geo.pp_p, r.pp_rank)
        fill(model, b)
        for e, arr in enumerate(b.kv):
            mem.add(arr, (r.agent_id, "kv", e))
        for e, arr in enumerate(b.state):
            mem.add(arr, (r.agent_id, "state", e))
        pcores[r.agent_id] = (PrefillCore(r.agent_id, r.endpoint, b.args, Config()), b)
        by_endpoint[r.endpoint] = r.agent_id
    out = Outcome(dec, staging, {}, {}, [], Counter(), mem.outside, ReceiverState.CREATED, [],
                  {t.rank.agent_id for t in plan.targets if t.is_dummy},
                  {t.rank.agent_id: t.rank.pp_rank for t in plan.targets})

    dcore.topology_fetched(ADDR, inst, now)
    room = dcore.open_receiver(ADDR, ROOM, now)
    state_dst = STATE_DST[geo.state] if geo.state != "none" and with_state else None
    dcore.receiver_init(room, DST, -1, state_dst, 0, now)
    senders = {}
    for agent, (core, _) in pcores.items():
        senders[agent] = core.open_sender(ROOM, now)
        core.sender_init(senders[agent], len(SRC), -1, now)

    def sent(agent: str, msg: Any) -> None:
        if isinstance(msg, Register):
            out.registers[agent] = msg
        elif isinstance(msg, TransferInfo):
            out.infos[agent] = msg

    def posted(agent: str, post: act.Post, done: list[Any]) -> None:
        if post.kind == "state":
            out.state_posts[agent] += 1
            out.state_writes += [(agent, *d) for d in done]

    def run() -> None:
        pump(dcore, pcores, by_endpoint, mem, staging, now, sent, posted)

    run()
    for agent, (core, _) in pcores.items():
        core.send_chunk(senders[agent], SRC[:2], None, now)
        core.send_chunk(senders[agent], SRC[2:], STATE_SRC[geo.state] if state_dst else None, now)
    run()
    out.state_bytes.update({agent: core.stats["state_bytes"] for agent, (core, _) in pcores.items()})
    out.final = room.state
    out.wrong = check_decode(model, dec)
    return out


def state_coverage(out: Outcome) -> list[str]:
    """Each byte of every decode state entry at the room's slots written exactly once (nothing else)."""
    counts = [np.zeros(arr.nbytes, dtype=np.int64) for arr in out.decode.state]
    for _, _, _, dtag, doff, n in out.state_writes:
        counts[dtag[1]][doff:doff + n] += 1
    bad = []
    for e, (arr, c) in enumerate(zip(out.decode.state, counts, strict=True)):
        per = c.reshape(arr.shape[0], -1)
        hit = np.zeros(arr.shape[0], dtype=bool)
        hit[STATE_DST[out.decode.args.state_type]] = True
        if not (per[hit] == 1).all():
            bad.append(f"state entry {e}: bytes written {sorted(set(per[hit].ravel().tolist()))} times")
        if per[~hit].any():
            bad.append(f"state entry {e}: a slot outside the room written")
    return bad


def staged_ranks(out: Outcome) -> list[str]:
    return [a for a, reg in out.registers.items() if reg.tp_size != state_rank(reg)[0]]


# -- promises 1 and 2: staged state lands where per-token state does, once ----------------------------------------


def geometries(states: tuple[str, ...], mla: bool = False) -> list[Geo]:
    pairs = [(2, 1), (4, 1), (4, 2), (8, 1), (8, 2), (8, 4)]
    out = []
    for (tp_p, tp_d), heads, pp, state in itertools.product(pairs, (1, 2, 4, 8), (1, 2, 3), states):
        if mla:
            out.append(Geo(tp_p, tp_d, 1, pp_p=pp, state=state, mla=True))
        elif not (state == "mamba" and tp_p > heads):  # (mamba with prefill TP > heads: see the test below)
            out.append(Geo(tp_p, tp_d, heads, pp_p=pp, state=state))
    return list(dict.fromkeys(out))


def _compare(geo: Geo, d_rank: int) -> list[str]:
    per_token, staged = transfer(geo, d_rank, staged=False), transfer(geo, d_rank, staged=True)
    where = f"{geo} decode rank {d_rank}"
    bad = [f"{where} {kind}: {w}" for kind, o in (("per token", per_token), ("staged", staged))
           for w in o.wrong + o.outside + state_coverage(o) + ([] if o.final is ReceiverState.SUCCEEDED
                                                               else [f"room {o.final.name}"])]
    hs, hd = max(1, geo.heads // geo.tp_p), max(1, geo.heads // geo.tp_d)
    want_staged = sorted(staged.registers) if hd > hs else []  # (dummies too: a registration is per rank)
    if sorted(staged_ranks(staged)) != want_staged:
        bad.append(f"{where}: staged ranks {sorted(staged_ranks(staged))}, expected {want_staged}")
    if staged_ranks(per_token):
        bad.append(f"{where}: per-token run staged {staged_ranks(per_token)}")
    for agent in staged_ranks(staged):
        reg = staged.registers[agent]
        if state_rank(reg) != (geo.tp_d, d_rank, hd) or reg.tp_size != geo.tp_p:
            bad.append(f"{where}: {agent}'s Register names {state_rank(reg)} for the state, TP {reg.tp_size}")
    if geo.state != "none":
        for agent, info in staged.infos.items():
            want = [] if agent in staged.dummies else STATE_DST[geo.state]
            if info.dst_state_indices.tolist() != want:
                bad.append(f"{where}: {agent} got state indices {info.dst_state_indices.tolist()}, expected {want}")
    if sorted(per_token.state_writes) != sorted(staged.state_writes):
        bad.append(f"{where}: state descriptors differ between per token and staged")
    if per_token.state_posts != staged.state_posts:
        bad.append(f"{where}: state posts per rank differ: {dict(per_token.state_posts)} vs {dict(staged.state_posts)}")
    return bad


@pytest.mark.parametrize("state", ["none", "nsa", "mamba", "swa"])
def test_staged_state_lands_exactly_where_per_token_state_does(state: str) -> None:
    """Every (prefill TP > decode TP, heads, prefill PP 1-3) for the last decode rank: staged and per token the
    decode's KV and state end byte for byte as the model says, each state byte written once, by the same
    descriptors from the same prefill ranks; the staged Registers name the real rank for the state."""
    bad: list[str] = []
    for geo in geometries((state,)):
        bad += _compare(geo, geo.tp_d - 1)
    assert not bad, bad[:8]


def test_prefill_and_decode_pp_stages_with_staging_write_state_once() -> None:
    """Decode PP equal to the prefill's (each decode stage registers with its own stage's ranks): staged and per
    token alike, every state byte of the last stage's decode rank lands once, from that stage only."""
    bad: list[str] = []
    for state, pp, (tp_p, tp_d) in itertools.product(("nsa", "mamba", "swa"), (2, 3), ((4, 1), (4, 2), (8, 2))):
        geo = Geo(tp_p, tp_d, 8, pp_p=pp, pp_d=pp, state=state)
        for staged in (False, True):
            out = transfer(geo, tp_d - 1, staged, d_stage=pp - 1)
            bad += [f"{geo} staged={staged}: {w}" for w in out.wrong + out.outside + state_coverage(out)]
            bad += [f"{geo}: {a} of stage {out.stage_of[a]} wrote state" for a in out.state_posts
                    if out.stage_of[a] != pp - 1]
    assert not bad, bad[:8]


@pytest.mark.parametrize("state", ["nsa", "swa", "mamba"])
def test_a_decode_with_a_staging_area_registers_per_token_with_an_equal_tp(state: str) -> None:
    """Equal TP (nothing to slice): the staging area is not used, and the Register is the rank's own, v4's
    meaning (``state_tp_size`` 0)."""
    for pp in (1, 2):
        out = transfer(Geo(2, 2, 8, pp_p=pp, state=state), 1, staged=True)
        assert out.final is ReceiverState.SUCCEEDED and not out.wrong + out.outside + state_coverage(out)
        assert out.registers and all(r.state_tp_size == 0 and r.tp_size == 2 for r in out.registers.values())
        assert out.staging is not None and out.staging.tp_prefill is None


@pytest.mark.parametrize("state", ["nsa", "swa", "mamba"])
def test_state_of_an_mla_model_is_written_once_per_stage(state: str) -> None:
    """MLA (no staging: one real sender per stage, the rest dummies): the state, the same on every prefill TP rank,
    lands once per stage (mamba: replicated entries only), one state post per prefill stage."""
    bad: list[str] = []
    for geo in geometries((state,), mla=True):
        out = transfer(geo, geo.tp_d - 1, staged=False)
        bad += [f"{geo}: {w}" for w in out.wrong + out.outside + state_coverage(out)]
        per_stage = Counter(out.stage_of[a] for a, n in out.state_posts.items() for _ in range(n))
        if per_stage != Counter(range(geo.pp_p)):
            bad.append(f"{geo}: state posts per stage {dict(per_stage)}")
    assert not bad, bad[:8]


@pytest.mark.parametrize("staged", [False, True], ids=["per-token", "staged"])
@pytest.mark.parametrize("geo", [Geo(4, 1, 2, state="mamba"), Geo(8, 1, 4, state="mamba"),
                                 Geo(8, 2, 4, state="mamba"), Geo(4, 2, 2, state="mamba")], ids=str)
def test_mamba_state_of_prefill_ranks_replicating_kv_heads_is_written(geo: Geo, staged: bool) -> None:
    """Prefill TP above the KV head count: ranks holding the same heads are dummies for the KV (``plan_targets``),
    but each holds its own slice of every sliced mamba entry (split by TP, not by heads). Those slices must
    still reach the decode (``test_layouts.py::test_hybrid_state`` shows the same over NIXL)."""
    d_rank, k = geo.tp_d - 1, geo.tp_p // geo.tp_d
    out = transfer(geo, d_rank, staged)
    assert out.final is ReceiverState.SUCCEEDED and not out.outside  # (the room succeeds all the same)
    counts = [np.zeros(arr.nbytes, dtype=np.int64) for arr in out.decode.state]
    for _, _, _, dtag, doff, n in out.state_writes:
        counts[dtag[1]][doff:doff + n] += 1
    lost: set[int] = set()  # prefill ranks whose slice of a sliced entry never landed
    for arr, c in zip(out.decode.state, counts, strict=True):
        if arr.ndim == 4:  # (slot, outer, dim, elem): a sliced entry
            seen = c.reshape(arr.shape)[STATE_DST["mamba"][0]].min(axis=(0, 2))
            dim_s = arr.shape[2] // k
            lost |= {d_rank * k + i // dim_s for i in np.flatnonzero(seen == 0).tolist()}
    dummies = sorted(int(a.rsplit("-", 1)[1]) for a in out.dummies)
    assert not lost, f"mamba slices of prefill ranks {sorted(lost)} never written (the KV dummies are {dummies})"
    assert not out.wrong and not state_coverage(out)


@pytest.mark.parametrize("geo", [Geo(4, 1, 2, state="mamba"), Geo(4, 2, 8, state="mamba"), Geo(4, 1, 4, state="swa"),
                                 Geo(4, 1, 4, state="nsa"), Geo(4, 1, 1, state="mamba", mla=True)], ids=str)
def test_each_rank_counts_the_state_bytes_it_sends(geo: Geo) -> None:
    """The state bytes a prefill rank counts (metrics, in-flight budget) are those its descriptors move: its
    share of split state, none of replicated state it does not send (it counted every local state byte)."""
    for staged in ([False, True] if not geo.mla else [False]):
        out = transfer(geo, 0, staged)
        moved: Counter[str] = Counter()
        for agent, *_, n in out.state_writes:
            moved[agent] += n
        assert +out.state_bytes == +moved, (staged, dict(out.state_bytes), dict(moved))


@pytest.mark.parametrize("staged", [False, True], ids=["per-token", "staged"])
def test_a_room_without_state_does_not_wait_for_state_only_ranks(staged: bool) -> None:
    """The ranks replicating KV heads report only where they write state: a room of the same model with no
    state indices waits for the KV senders alone (it waited for the dummies until its timeout)."""
    out = transfer(Geo(4, 1, 2, state="mamba"), 0, staged, with_state=False)
    assert out.final is ReceiverState.SUCCEEDED and not out.state_posts
    assert all(not len(m.dst_state_indices) for m in out.infos.values())


# -- promise 4 (and 1, by plan): state_tp_size 0 is the real rank's own fields; staged plans equal per-token --------


def _register(b: Buffers, **kw: Any) -> Register:
    return dataclasses.replace(_register_template(ME, DEC_EP, b.args, (0, 0), stub_agent_metadata(ME)),
                               prefill_id="p", session=1, **kw)


def _same_state_plan(a: PeerPlan, b: PeerPlan) -> bool:
    if (a.state is None) != (b.state is None):
        return False
    if a.state is None or b.state is None:
        return True
    x, y = a.state, b.state

    def arrays(s: Any) -> list[Any]:
        hs = [] if s.head_slice is None else [s.head_slice.src_offs, s.head_slice.dst_offs, s.head_slice.nbytes]
        return [s.src_entries, s.dst_entries, *hs, *(s.blocks or ())]
    return (x.kind, x.replicated, x.first, x.head_slice is None, x.blocks is None) == \
        (y.kind, y.replicated, y.first, y.head_slice is None, y.blocks is None) and \
        all(np.array_equal(p, q) for p, q in zip(arrays(x), arrays(y), strict=True))


def _plan(local: KVArgs, reg: Register) -> PeerPlan | str:
    try:
        return plan_peer(local, reg)
    except (LayoutMismatch, RemoteProtocolError) as exc:
        return f"refused: {exc}"


def test_state_tp_size_0_plans_exactly_as_the_real_ranks_own_fields() -> None:
    """Every TP pair (either way), heads, state kind and MLA: a Register with ``state_tp_size`` 0 and one naming
    its own TP, rank and heads get the same plan (KV and state), or the same refusal."""
    bad: list[str] = []
    tps = (1, 2, 4, 8)
    for tp_p, tp_d, heads, state, mla in itertools.product(tps, tps, (1, 2, 4, 8), ("none", "nsa", "mamba", "swa"),
                                                           (False, True)):
        if mla and heads > 1:
            continue
        geo = Geo(tp_p, tp_d, heads, state=state, mla=mla)
        d_rank = tp_d - 1
        dec = build(geo, tp_d, d_rank, 1, 0)
        p_rank = d_rank * tp_p // tp_d if tp_p >= tp_d else d_rank // (tp_d // tp_p)
        local = build(geo, tp_p, p_rank, 1, 0).args
        zero = _plan(local, _register(dec))
        own = _plan(local, _register(dec, state_tp_size=tp_d, state_engine_rank=d_rank,
                                     state_head_num=dec.args.kv_head_num))
        if isinstance(zero, str) or isinstance(own, str):
            if zero != own:
                bad.append(f"{geo}: {zero!s:.80} vs {own!s:.80}")
            continue
        if not (zero.whole_pages == own.whole_pages and _same_state_plan(zero, own)):
            bad.append(f"{geo}: plans differ")
    assert not bad, bad[:8]


def test_a_staged_registers_state_plan_is_the_per_token_one_for_every_prefill_rank() -> None:
    """For every prefill rank a decode rank maps to (prefill TP > decode TP): the Register its staging area sends
    (``DecodeStaging.register_fields``) plans whole KV pages and the very state plan of its per-token Register."""
    bad: list[str] = []
    for (tp_p, tp_d), heads, state in itertools.product(((2, 1), (4, 1), (4, 2), (8, 1), (8, 2), (8, 4)),
                                                        (1, 2, 4, 8), ("none", "nsa", "mamba", "swa")):
        geo = Geo(tp_p, tp_d, heads, state=state)
        for d_rank in range(tp_d):
            dec = build(geo, tp_d, d_rank, 1, 0)
            staging = DecodeStaging(1 << 16, dec.args)
            if not staging.usable(tp_p):
                continue
            k = tp_p // tp_d
            for p_rank in range(d_rank * k, (d_rank + 1) * k):
                local = build(geo, tp_p, p_rank, 1, 0).args
                staged = _plan(local, _register(dec, **staging.register_fields(prank(geo, p_rank, 0))))
                per_token = _plan(local, _register(dec))
                where = f"{geo} decode {d_rank} prefill {p_rank}"
                if isinstance(staged, str) or isinstance(per_token, str):
                    bad.append(f"{where}: staged {staged!s:.100}, per token {per_token!s:.100}")
                elif not staged.whole_pages or not _same_state_plan(staged, per_token):
                    bad.append(f"{where}: staged plan differs")
    assert not bad, bad[:8]


# -- promise 3: hostile Registers, through a prefill core -------------------------------------------------------------


HOSTILE_GEO = {s: Geo(4, 2, 8, state=s) for s in ("nsa", "mamba", "swa")}
"""Prefill TP4 rank 3, decode TP2 rank 1 registering its staging area with it."""


def _staged_hostile(state: str, **patch: Any) -> tuple[KVArgs, Register]:
    geo = HOSTILE_GEO[state]
    dec = build(geo, 2, 1, 1, 0)
    staging = DecodeStaging(1 << 16, dec.args)
    assert staging.usable(4)
    reg = _register(dec, **staging.register_fields(prank(geo, 3, 0)))
    fields = {k: (v(reg) if callable(v) else v) for k, v in patch.items()}
    return build(geo, 4, 3, 1, 0).args, dataclasses.replace(reg, prefill_id="prefill-3", **fields)


def _feed(local: KVArgs, reg: Register) -> tuple[PrefillCore, RegisterResult]:
    """A prefill core fed ``reg`` (connections succeed at once): its answer. Anything the core raises propagates."""
    core = PrefillCore("prefill-3", "tcp://10.0.0.1:17003", local, Config())
    core.receive(reg, 0.0)
    results = []
    for _ in range(4):
        for a in core.actions():
            if isinstance(a, act.ConnectPeer):
                core.peer_connected(a.peer, None, 0.0)
            elif isinstance(a, act.Send) and isinstance(a.msg, RegisterResult):
                results.append(a.msg)
    assert len(results) == 1, results
    return core, results[0]


def plan_bounds(local: KVArgs, reg: Register, plan: PeerPlan) -> list[str]:
    """Where a plan would read outside our items or write outside the decode's claimed items."""
    bad: list[str] = []
    u64 = np.uint64
    si = np.asarray(local.kv_item_lens, u64)[plan.src_entries]
    di = np.asarray(reg.kv_item_lens, u64)[plan.dst_entries]
    if plan.head_slice is None:
        bad += [] if np.all(si <= di) else ["KV pages larger than the decode's items"]
    else:
        h, ps = plan.head_slice, u64(local.page_size)
        if np.any(h.src_offs + h.nbytes > si // ps) or np.any(h.dst_offs + h.nbytes > di // ps):
            bad.append("KV head slice outside a token row")
    st = plan.state
    if st is None:
        return bad
    si = np.asarray(local.state_item_lens, u64)[st.src_entries]
    di = np.asarray(reg.state_item_lens, u64)[st.dst_entries]
    if st.blocks is not None:
        so, do, n = st.blocks
        if np.any((so + n > si[:, None]) & (n > 0)) or np.any((do + n > di[:, None]) & (n > 0)):
            bad.append(f"mamba blocks outside the items: src {so.tolist()} dst {do.tolist()} lens {n.tolist()}, "
                       f"items {si.tolist()} / {di.tolist()}")
    elif st.head_slice is not None:
        h, ps = st.head_slice, u64(local.page_size)
        if np.any(h.src_offs + h.nbytes > si // ps) or np.any(h.dst_offs + h.nbytes > di // ps):
            bad.append("state head slice outside a token row")
    elif np.any(si > di):
        bad.append("state items larger than the decode's")
    return bad


BIG = 2**64 - 1
HOSTILE: list[tuple[str, dict[str, Any]]] = [
    ("tp 0", {"tp_size": 0}),
    ("tp huge", {"tp_size": BIG}),
    ("tp 2**63", {"tp_size": 2**63}),
    ("engine rank huge", {"engine_rank": BIG}),
    ("kv heads 0", {"kv_head_num": 0}),
    ("state tp 3", {"state_tp_size": 3}),
    ("state tp huge", {"state_tp_size": BIG}),
    ("state tp 2**63", {"state_tp_size": 2**63, "state_head_num": 1}),
    ("state tp 8", {"state_tp_size": 8, "state_engine_rank": 7, "state_head_num": 1}),
    ("state rank huge", {"state_engine_rank": BIG}),
    ("state rank = tp", {"state_engine_rank": 2}),
    ("state heads 0", {"state_head_num": 0}),
    ("state heads huge", {"state_head_num": BIG}),
    ("state items huge", {"state_item_lens": lambda r: (BIG,) * len(r.state_ptrs),
                          "state_lens": lambda r: (BIG,) * len(r.state_ptrs)}),
    ("state dims short", {"state_dims": lambda r: r.state_dims[:1]}),
    ("state dims long", {"state_dims": lambda r: (*r.state_dims, 4)}),
    ("state outer short", {"state_outer": lambda r: r.state_outer[:1]}),
    ("state layer ids longer", {"state_layer_ids": lambda r: (99, *r.state_layer_ids)}),
    ("state layer ids shorter", {"state_layer_ids": lambda r: r.state_layer_ids[:1]}),
]


@pytest.mark.parametrize("state", ["nsa", "mamba", "swa"])
@pytest.mark.parametrize("name, patch", HOSTILE, ids=[n for n, _ in HOSTILE])
def test_a_hostile_staged_register_is_refused_or_planned_within_the_claimed_buffers(
        name: str, patch: dict[str, Any], state: str) -> None:
    """Nothing but a RegisterResult comes out of the prefill core: a refusal, or an accepted plan that reads within
    our items and writes within the decode's claimed ones."""
    local, reg = _staged_hostile(state, **patch)
    try:
        core, result = _feed(local, reg)
    except Exception as exc:  # (what escapes the core is the finding)
        pytest.fail(f"{type(exc).__name__} out of the prefill core: {exc}")
    if result.ok:
        peer = core.peers[reg.decode_id]
        assert not plan_bounds(local, peer.reg, peer.plan)


REFUSED: list[tuple[str, dict[str, Any], str]] = [
    ("state tp 3", {"state_tp_size": 3}, "3"),
    ("state rank = state tp", {"state_engine_rank": 2}, "2"),
    ("state rank 5", {"state_engine_rank": 5}, "5"),
    ("state rank huge", {"state_engine_rank": BIG}, str(BIG)),
    ("state heads 3", {"state_head_num": 3}, "3"),
    ("state heads 0", {"state_head_num": 0}, "0"),
    ("state heads 8", {"state_head_num": 8}, "8"),
]


@pytest.mark.parametrize("state", ["nsa", "mamba", "swa"])
@pytest.mark.parametrize("name, patch, value", REFUSED, ids=[n for n, _, _ in REFUSED])
def test_inconsistent_state_rank_claims_are_refused_naming_the_values(name: str, patch: dict[str, Any], value: str,
                                                                      state: str) -> None:
    """A staged Register naming the real rank 1 of TP2 with 4 heads (8 in all), one claim off: a state rank
    outside the state TP, or a head count other than 8 / 2. Refused with a reason naming the claimed value."""
    local, reg = _staged_hostile(state, **patch)
    _, result = _feed(local, reg)
    assert not result.ok, f"accepted: {state_rank(reg)} (state {state}, prefill TP4 rank 3)"
    assert value in result.reason, result.reason


# -- promise 5: the wire ----------------------------------------------------------------------------------------------


def _sample_register() -> Register:
    geo = HOSTILE_GEO["mamba"]
    dec = build(geo, 2, 1, 1, 0)
    return _register(dec, state_tp_size=2, state_engine_rank=1, state_head_num=4)


@pytest.mark.parametrize("values", [(2, 1, 4), (0, 0, 0), (BIG, BIG, BIG)])
def test_the_v5_fields_round_trip(values: tuple[int, int, int]) -> None:
    reg = dataclasses.replace(_sample_register(), state_tp_size=values[0], state_engine_rank=values[1],
                              state_head_num=values[2])
    for got in (decode(encode(reg)), decode([pack(encode(reg))])):
        assert isinstance(got, Register) and got == reg
        assert (got.state_tp_size, got.state_engine_rank, got.state_head_num) == values
    body = json.loads(encode(reg)[1])
    assert (body["state_tp_size"], body["state_engine_rank"], body["state_head_num"]) == values


def _v4(frames: list[bytes]) -> list[bytes]:
    body = json.loads(frames[1])
    for name in ("state_tp_size", "state_engine_rank", "state_head_num"):
        del body[name]
    return [struct.pack("<4sHH", MAGIC, 4, Register.TYPE), json.dumps(body).encode(), *frames[2:]]


def test_a_v4_register_is_a_version_mismatch_naming_both_and_the_prefill_refuses_it() -> None:
    assert PROTOCOL_VERSION == 5
    reg = _sample_register()
    for frames in (_v4(encode(reg)), [pack(_v4(encode(reg)))]):
        with pytest.raises(VersionMismatch) as info:
            decode(frames)
        assert (info.value.theirs, info.value.ours) == (4, 5)
        assert "v4" in str(info.value) and "v5" in str(info.value)
    core = PrefillCore("p", "tcp://10.0.0.1:17000", build(HOSTILE_GEO["mamba"], 4, 3, 1, 0).args, Config())
    core.version_mismatch(info.value.msg_type, info.value.body, str(info.value), 0.0)
    sent = [a for a in core.actions() if isinstance(a, act.Send)]
    assert len(sent) == 1 and sent[0].endpoint == reg.endpoint
    msg = sent[0].msg
    assert isinstance(msg, RegisterResult) and not msg.ok and msg.decode_id == reg.decode_id
    assert "v4" in msg.reason and "v5" in msg.reason


@pytest.mark.parametrize("field", ["state_tp_size", "state_engine_rank", "state_head_num"])
@pytest.mark.parametrize("value", [None, -1, 2**64, 1.5, True, "2", [2]], ids=repr)
def test_a_v5_register_missing_or_mistyping_a_new_field_is_a_remote_protocol_error(field: str, value: Any) -> None:
    frames = encode(_sample_register())
    body = json.loads(frames[1])
    if value is None:
        del body[field]
    else:
        body[field] = value
    with pytest.raises(RemoteProtocolError, match=field) as info:
        decode([frames[0], json.dumps(body).encode(), *frames[2:]])
    assert not isinstance(info.value, VersionMismatch)
