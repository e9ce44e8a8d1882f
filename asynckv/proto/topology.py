"""Rank mapping and per-peer transfer plans, for every supported parallel layout.

Decode side (``plan_targets``): which prefill ranks a decode rank contacts for a room,
which of them are dummies (they take part so every rank's counts close, but send
nothing), who writes the aux row (exactly one sender per destination), how many decode
ranks each prefill rank waits for and how many senders decode waits for.

Prefill side (``plan_peer``): for one registered decode rank, which local entry goes to
which remote entry (paired by global layer id, never by count), whether pages are copied
whole or as TP head slices, and how hybrid state travels. Anything unsupported is refused
here, at registration, with a message naming both sides' values.

Notation: H total KV heads, Tp / Td prefill /
decode attention TP, hs = max(1, H // Tp), hd = max(1, H // Td) heads per rank. When TP
exceeds H, consecutive ranks hold the same heads (GQA replication): rank r holds head
group ``r // max(1, T // H)``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import LayoutMismatch, RemoteProtocolError
from ..layout import KVArgs, entry_keys
from .bootstrap import PayloadError, PrefillRank
from .endpoints import transport_of
from .messages import PROTOCOL_VERSION, Register
from .registration import check_pool_size, check_registration, check_tp, state_rank

__all__ = [
    "HeadSlice",
    "PeerPlan",
    "PrefillInstance",
    "StatePlan",
    "Target",
    "TargetPlan",
    "check_compatible",
    "check_metadata_name",
    "check_registration",
    "head_slice",
    "plan_peer",
    "plan_targets",
    "stub_agent_metadata",
]

U64 = npt.NDArray[np.uint64]
I64 = npt.NDArray[np.int64]


@dataclasses.dataclass(frozen=True, slots=True)
class PrefillInstance:
    """A prefill instance as its bootstrap server describes it (``GET /route``)."""

    tp_size: int
    pp_size: int
    dp_size: int
    page_size: int
    kv_dtype: str
    is_mla: bool
    protocol_version: int
    ranks: dict[tuple[int, int, int], PrefillRank]

    @classmethod
    def from_route(cls, data: Any) -> PrefillInstance:
        if not isinstance(data, dict) or not isinstance(data.get("ranks"), list):
            raise RemoteProtocolError("bootstrap /route answer is not a topology object")
        try:
            ranks = [PrefillRank.from_json(r) for r in data["ranks"]]
        except PayloadError as exc:
            raise RemoteProtocolError(f"bootstrap /route answer has a bad rank: {exc}") from None
        if not ranks:
            raise RemoteProtocolError("bootstrap /route answer lists no ranks")
        first = ranks[0]
        return cls(tp_size=first.tp_size, pp_size=first.pp_size, dp_size=first.dp_size,
                   page_size=first.page_size, kv_dtype=first.kv_dtype, is_mla=first.is_mla,
                   protocol_version=first.protocol_version, ranks={r.key: r for r in ranks})


@dataclasses.dataclass(frozen=True, slots=True)
class Target:
    """One prefill rank of a room, from the decode rank's point of view."""

    rank: PrefillRank
    is_dummy: bool
    """Takes part (so its counts close) but writes no KV: another rank holds the same heads (or the
    latent, MLA). Unless ``state_only``, it writes nothing and reports nothing."""
    write_aux: bool
    """The one sender that writes this destination's aux row (and replicated state)."""
    state_only: bool = False
    """A dummy that still holds a slice of the state of its own (mamba state split by TP, where
    several ranks replicate the KV heads): it gets the state indices, writes its slice, and reports."""

    @property
    def reports(self) -> bool:
        """It writes into the room and reports its outcome."""
        return not self.is_dummy or self.state_only


@dataclasses.dataclass(frozen=True, slots=True)
class TargetPlan:
    """The prefill ranks one decode rank sends a room's destination to."""

    targets: tuple[Target, ...]
    required_dst_info_num: int
    """How many decode ranks each target prefill rank waits for."""
    ranks: tuple[PrefillRank, ...] = dataclasses.field(init=False, compare=False, repr=False)
    required_responses: int = dataclasses.field(init=False, compare=False, repr=False)
    """Distinct senders that must report success to this decode rank (state-only ranks count in rooms
    with state: ``ReceiverRoom.required_responses``)."""

    def __post_init__(self) -> None:  # (a plan serves every room of its DP group: computed once, not per room)
        object.__setattr__(self, "ranks", tuple(t.rank for t in self.targets))
        object.__setattr__(self, "required_responses", sum(1 for t in self.targets if t.reports))


def check_compatible(instance: PrefillInstance, *, page_size: int, kv_dtype: str, is_mla: bool,
                     endpoint: str = "") -> None:
    """Refuse a prefill instance whose geometry differs from ours, naming both values; with our
    ``endpoint``, also one whose ranks listen on another control transport."""
    checks: list[tuple[str, object, object]] = [
        ("protocol version", instance.protocol_version, PROTOCOL_VERSION), ("page_size", instance.page_size, page_size),
        ("kv_dtype", instance.kv_dtype, kv_dtype), ("is_mla", instance.is_mla, is_mla)]
    if endpoint:
        used = ", ".join(sorted({str(transport_of(r.endpoint)) for r in instance.ranks.values()}))
        checks.append(("control_transport", used, transport_of(endpoint)))
    for name, theirs, ours in checks:
        if theirs != ours:
            raise LayoutMismatch(f"{name} mismatch: prefill has {theirs!r}, decode has {ours!r}")


def head_group(rank: int, tp_size: int, total_heads: int) -> int:
    """Which group of heads a rank holds (ranks beyond the head count replicate)."""
    return rank // max(1, tp_size // total_heads)


def plan_targets(instance: PrefillInstance, *, room: int, tp_size: int, engine_rank: int,
                 pp_size: int = 1, pp_rank: int = 0, is_mla: bool = False,
                 total_kv_heads: int = 1, split_state: bool = False) -> TargetPlan:
    """Resolve the target ranks of one room (the DP group is ``room % dp_size``). ``split_state``: the
    decode has state split by TP (mamba), so every rank holds a slice of its own: a rank that
    replicates another's KV heads is still a dummy for the KV, but writes its state (``state_only``)."""
    tp_p, tp_d = instance.tp_size, tp_size
    check_tp(tp_p, tp_d)
    if pp_size == instance.pp_size:
        stages = [pp_rank]
    elif pp_size == 1:
        stages = list(range(instance.pp_size))
    else:
        raise LayoutMismatch(f"pp_size mismatch: prefill has {instance.pp_size}, decode has {pp_size}; "
                             f"decode PP must be 1 or equal")
    if tp_d >= tp_p:
        tps = [engine_rank // (tp_d // tp_p)]
        required_dst = tp_d // tp_p
    else:
        k = tp_p // tp_d
        tps = list(range(engine_rank * k, (engine_rank + 1) * k))
        required_dst = 1
    if is_mla:
        real = {tps[0]}  # the latent is replicated on every prefill rank: one sender is enough
    else:
        real, groups = set(), set()
        for tp in tps:  # replicated heads (TP > H) are sent once
            group = head_group(tp, tp_p, total_kv_heads)
            if group not in groups:
                groups.add(group)
                real.add(tp)
    dp = room % instance.dp_size
    aux_tp, aux_pp = min(real), max(stages)
    targets = []
    for pp in reversed(stages):
        for tp in tps:
            rank = instance.ranks.get((dp, tp, pp))
            if rank is None:
                raise RemoteProtocolError(f"prefill rank dp={dp} tp={tp} pp={pp} is not registered")
            dummy = tp not in real
            targets.append(Target(rank, is_dummy=dummy, write_aux=(tp, pp) == (aux_tp, aux_pp),
                                  state_only=dummy and split_state))
    return TargetPlan(tuple(targets), required_dst)


@dataclasses.dataclass(frozen=True, slots=True)
class HeadSlice:
    """Per paired entry: bytes of each token row to send, and where (prefill TP != decode TP)."""

    src_offs: U64
    dst_offs: U64
    nbytes: U64


@dataclasses.dataclass(frozen=True, slots=True)
class StatePlan:
    """How hybrid state travels to one peer (on the last chunk)."""

    kind: str
    """"items" (whole slots), "blocks" (mamba slices), "pages" or "head_slice" (swa/nsa)."""
    src_entries: I64
    dst_entries: I64
    head_slice: HeadSlice | None = None
    blocks: tuple[U64, U64, U64] | None = None
    """(src_offs, dst_offs, lens), each [entries, blocks], for kind "blocks"."""
    replicated: bool = False
    """The same bytes are on every prefill TP rank of a stage: one of them sends them (``first``)."""
    first: bool = True
    """This prefill rank is the first of its stage's ranks writing into that decode rank (``first_writer``)."""
    nbytes: int = 0
    """Bytes sent per state index (slot or page): what the in-flight budget and the metrics count."""


@dataclasses.dataclass(frozen=True, slots=True)
class PeerPlan:
    """Everything prefill needs to write into one registered decode rank."""

    src_entries: I64
    """Local KV entries this peer receives: all of them, 0..n-1 (an unpaired one is refused)."""
    dst_entries: I64
    """The paired remote entry of each."""
    head_slice: HeadSlice | None
    """None: whole pages (equal TP, or MLA)."""
    state: StatePlan | None

    @property
    def whole_pages(self) -> bool:
        """Pages are copied whole (prepared dlists apply); False for TP head slices."""
        return self.head_slice is None


def _pair(local_ids: Any, remote_ids: Any, what: str) -> tuple[I64, I64]:
    remote = {key: i for i, key in enumerate(entry_keys(remote_ids))}
    src, dst = [], []
    for i, key in enumerate(entry_keys(local_ids)):
        j = remote.get(key)
        if j is None:
            raise LayoutMismatch(f"prefill {what} entry {i} (layer {key[0]}, occurrence {key[1]}) has no decode "
                                 f"entry with that layer id")
        src.append(i)
        dst.append(j)
    return np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)


def head_slice(*, tp_prefill: int, tp_decode: int, prefill_rank: int, decode_rank: int, total_heads: int,
               prefill_heads: int, decode_heads: int, page_size: int, src_items: U64, dst_items: U64,
               what: str = "KV") -> HeadSlice:
    """Byte offsets of the heads one prefill rank sends one decode rank (section 4.6, fixed)."""
    hs, hd = max(1, total_heads // tp_prefill), max(1, total_heads // tp_decode)
    if (hs, hd) != (prefill_heads, decode_heads):
        raise LayoutMismatch(f"kv_head_num inconsistent with total_kv_head_num={total_heads}: prefill has "
                             f"{prefill_heads} (expected {hs} at TP {tp_prefill}), decode has {decode_heads} "
                             f"(expected {hd} at TP {tp_decode})")
    if tp_prefill > tp_decode:
        src_start, n = 0, hs
        dst_start = (head_group(prefill_rank, tp_prefill, total_heads) * hs) % hd
    else:
        src_start, n = (head_group(decode_rank, tp_decode, total_heads) * hd) % hs, hd
        dst_start = 0
    if src_start + n > hs or dst_start + n > hd:
        raise LayoutMismatch(f"head slice out of range: {n} heads from {src_start} of {hs} into {dst_start} of {hd}")
    row = np.uint64(page_size * hs)
    if np.any(src_items % row):
        raise LayoutMismatch(f"prefill {what} item sizes are not page_size x {hs} heads x head bytes")
    head_bytes = src_items // row
    if np.any(dst_items != head_bytes * np.uint64(page_size * hd)):
        raise LayoutMismatch(f"{what} head size mismatch: prefill has {head_bytes.tolist()[:4]} bytes per head, "
                             f"decode items {dst_items.tolist()[:4]} are not page_size x {hd} heads of that")
    return HeadSlice(src_offs=head_bytes * np.uint64(src_start), dst_offs=head_bytes * np.uint64(dst_start),
                     nbytes=head_bytes * np.uint64(n))


def _mamba_blocks(local: KVArgs, reg: Register, src: I64, dst: I64) -> tuple[U64, U64, U64]:
    """Byte blocks of each mamba state entry (section 4.8: aggregation or scatter)."""
    tp_p, (tp_d, decode_rank, _) = local.tp_size, state_rank(reg)
    if local.state_dim_per_tensor is None or not reg.state_dims:
        raise LayoutMismatch(f"mamba state across TP sizes (prefill {tp_p}, decode {tp_d}) needs "
                             f"state_dim_per_tensor on both sides")
    outer_s = local.state_outer or [1] * len(local.state_data_ptrs)
    outer_d = reg.state_outer or tuple([1] * len(reg.state_ptrs))
    n_out = int(max(outer_s)) if len(outer_s) else 1
    shape = (len(src), n_out)
    src_offs, dst_offs, lens = (np.zeros(shape, dtype=np.uint64) for _ in range(3))
    for row, (i, j) in enumerate(zip(src.tolist(), dst.tolist(), strict=True)):
        dim_s, dim_d = int(local.state_dim_per_tensor[i]), int(reg.state_dims[j])
        outer, item_s, item_d = int(outer_s[i]), int(local.state_item_lens[i]), int(reg.state_item_lens[j])
        if outer != int(outer_d[j]):
            raise LayoutMismatch(f"mamba state entry {i}: outer rows differ (prefill {outer}, decode {outer_d[j]})")
        if dim_s == 0 and dim_d == 0:  # replicated: whole item, written by one sender only
            if item_s != item_d:
                raise LayoutMismatch(f"mamba replicated state entry {i}: prefill {item_s} bytes, decode {item_d}")
            lens[row, 0] = item_s if first_writer(local.engine_rank, tp_p, tp_d) else 0
            continue
        if dim_s == 0 or dim_d == 0 or item_s % (dim_s * outer) or item_d % (dim_d * outer):
            raise LayoutMismatch(f"mamba state entry {i}: dims {dim_s}/{dim_d} do not divide items {item_s}/{item_d}")
        bpd = item_s // (dim_s * outer)
        if bpd != item_d // (dim_d * outer):
            raise LayoutMismatch(f"mamba state entry {i}: bytes per element row differ "
                                 f"({bpd} vs {item_d // (dim_d * outer)})")
        if tp_p >= tp_d:
            if dim_d != dim_s * (tp_p // tp_d):
                raise LayoutMismatch(f"mamba state entry {i}: decode dim {dim_d} != prefill dim {dim_s} x "
                                     f"{tp_p // tp_d}")
            src_start, dst_start, dims = 0, (local.engine_rank % (tp_p // tp_d)) * dim_s, dim_s
        else:
            if dim_s != dim_d * (tp_d // tp_p):
                raise LayoutMismatch(f"mamba state entry {i}: prefill dim {dim_s} != decode dim {dim_d} x "
                                     f"{tp_d // tp_p}")
            src_start, dst_start, dims = (decode_rank * dim_d) % dim_s, 0, dim_d
        for o in range(outer):
            src_offs[row, o] = (o * dim_s + src_start) * bpd
            dst_offs[row, o] = (o * dim_d + dst_start) * bpd
            lens[row, o] = dims * bpd
    return src_offs, dst_offs, lens


def first_writer(prefill_rank: int, tp_prefill: int, tp_decode: int) -> bool:
    """Whether prefill TP rank ``prefill_rank`` is the first of the ranks of its PP stage that write into
    one decode rank (the only one when the decode TP is not smaller): the one that sends bytes all of
    them hold. Each stage has one, for its own layers' entries."""
    return tp_prefill <= tp_decode or prefill_rank % (tp_prefill // tp_decode) == 0


def _state_plan(local: KVArgs, reg: Register) -> StatePlan | None:
    if local.state_type != reg.state_type:
        raise LayoutMismatch(f"state_type mismatch: prefill has {local.state_type!r}, decode has {reg.state_type!r}")
    if local.state_type == "none":
        return None
    local_ids = local.state_layer_ids if local.state_layer_ids is not None else range(len(local.state_data_ptrs))
    remote_ids = reg.state_layer_ids if reg.state_layer_ids else range(len(reg.state_ptrs))
    src, dst = _pair(local_ids, remote_ids, "state")
    items_s = np.asarray(local.state_item_lens, dtype=np.uint64)[src]
    items_d = np.asarray(reg.state_item_lens, dtype=np.uint64)[dst]
    tp_d, decode_rank, decode_heads = state_rank(reg)  # (the real rank's, where the KV pool is staging slots)
    if local.state_type == "nsa" or (local.tp_size == tp_d and local.state_type in ("swa", "mamba")) or \
            (local.state_type == "swa" and local.is_mla):
        if np.any(items_s != items_d):
            raise LayoutMismatch(f"{local.state_type} state item sizes differ: prefill "
                                 f"{items_s.tolist()[:4]}, decode {items_d.tolist()[:4]}")
        kind = "items" if local.state_type == "mamba" else "pages"
        return StatePlan(kind, src, dst, replicated=local.state_type == "nsa" or local.is_mla,
                         first=first_writer(local.engine_rank, local.tp_size, tp_d), nbytes=int(items_s.sum()))
    if local.state_type == "swa":
        hs = head_slice(tp_prefill=local.tp_size, tp_decode=tp_d, prefill_rank=local.engine_rank,
                        decode_rank=decode_rank, total_heads=local.total_kv_head_num,
                        prefill_heads=local.kv_head_num, decode_heads=decode_heads,
                        page_size=local.page_size, src_items=items_s, dst_items=items_d, what="SWA")
        return StatePlan("head_slice", src, dst, head_slice=hs, nbytes=int(hs.nbytes.sum()) * local.page_size)
    blocks = _mamba_blocks(local, reg, src, dst)
    return StatePlan("blocks", src, dst, blocks=blocks, nbytes=int(blocks[2].sum()))


def plan_peer(local: KVArgs, reg: Register, *, max_rows: int | None = None) -> PeerPlan:
    """Prefill side: validate a decode rank's registration and plan every write into it.

    Its claimed pool is bounded here, before any destination row exists (``check_pool_size``).
    """
    check_metadata_name(reg.agent_metadata, reg.decode_id)  # before anything is built from its claims
    check_registration(local, reg)
    check_pool_size(local, reg, max_rows)
    src, dst = _pair(local.layer_ids, reg.kv_layer_ids, "KV")
    items_s = np.asarray(local.kv_item_lens, dtype=np.uint64)[src]
    items_d = np.asarray(reg.kv_item_lens, dtype=np.uint64)[dst]
    sliced: HeadSlice | None = None
    if local.is_mla or local.tp_size == reg.tp_size:
        bad = np.flatnonzero(items_s != items_d)
        if len(bad):
            i = int(bad[0])
            raise LayoutMismatch(f"KV entry {int(src[i])} item size mismatch: prefill has {int(items_s[i])} bytes "
                                 f"per page, decode has {int(items_d[i])}")
    else:
        sliced = head_slice(tp_prefill=local.tp_size, tp_decode=reg.tp_size, prefill_rank=local.engine_rank,
                            decode_rank=reg.engine_rank, total_heads=local.total_kv_head_num,
                            prefill_heads=local.kv_head_num, decode_heads=reg.kv_head_num,
                            page_size=local.page_size, src_items=items_s, dst_items=items_d)
    return PeerPlan(src, dst, sliced, _state_plan(local, reg))


_NIXL_MD_PREFIX = b"nixlSerDes|Agent"


def metadata_agent_name(metadata: bytes) -> bytes | None:
    """The agent name inside NIXL agent metadata (``nixlSerDes|Agent`` + u64 LE length + name),
    read without loading it; None if the blob does not start that way."""
    start = len(_NIXL_MD_PREFIX) + 8
    if len(metadata) < start or not metadata.startswith(_NIXL_MD_PREFIX):
        return None
    size = int.from_bytes(metadata[len(_NIXL_MD_PREFIX):start], "little")
    if size > 4096 or len(metadata) < start + size:
        return None
    return bytes(metadata[start:start + size])


def stub_agent_metadata(name: str) -> bytes:
    """Agent metadata that names ``name`` and nothing else (for simulations and unit tests)."""
    raw = name.encode()
    return _NIXL_MD_PREFIX + len(raw).to_bytes(8, "little") + raw + b"|stub"


def check_metadata_name(metadata: bytes, decode_id: str) -> None:
    """Refuse agent metadata that does not name ``decode_id``: loading it would touch (and undoing
    it would remove) another agent's connection."""
    name = metadata_agent_name(metadata)
    if name != decode_id.encode():
        shown = "no NIXL agent metadata" if name is None else f"agent {name[:64]!r}"
        raise RemoteProtocolError(f"registration of {decode_id[:64]!r} carries {shown}")
