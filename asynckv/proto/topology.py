"""Which prefill ranks a decode rank talks to, and how many answers each side waits for."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..errors import LayoutMismatch, RemoteProtocolError
from ..layout import KVArgs
from .bootstrap import PayloadError, PrefillRank
from .messages import PROTOCOL_VERSION, Register

__all__ = ["PrefillInstance", "TargetPlan", "check_compatible", "check_registration", "plan_targets"]


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
class TargetPlan:
    """The prefill ranks one decode rank sends a room's destination to."""

    ranks: tuple[PrefillRank, ...]
    required_dst_info_num: int
    """How many decode ranks each target prefill rank waits for."""
    required_responses: int
    """How many distinct prefill senders must report success to this decode rank."""


def check_compatible(instance: PrefillInstance, *, page_size: int, kv_dtype: str, is_mla: bool) -> None:
    """Refuse a prefill instance whose geometry differs from ours, naming both values."""
    for name, theirs, ours in (("protocol version", instance.protocol_version, PROTOCOL_VERSION),
                               ("page_size", instance.page_size, page_size),
                               ("kv_dtype", instance.kv_dtype, kv_dtype),
                               ("is_mla", instance.is_mla, is_mla)):
        if theirs != ours:
            raise LayoutMismatch(f"{name} mismatch: prefill has {theirs!r}, decode has {ours!r}")


def plan_targets(instance: PrefillInstance, *, room: int, tp_size: int, engine_rank: int,
                 pp_size: int = 1) -> TargetPlan:
    """Resolve the target ranks of one room.

    Supported here: equal attention TP, prefill PP = 1; the DP group is ``room % dp_size``.
    Other layouts are refused with a LayoutMismatch that names both sides.
    """
    if instance.tp_size != tp_size:
        raise LayoutMismatch(f"tp_size mismatch: prefill has {instance.tp_size}, decode has {tp_size} "
                             f"(heterogeneous TP is not supported yet)")
    if instance.pp_size != 1 or pp_size != 1:
        raise LayoutMismatch(f"pipeline parallelism is not supported yet: prefill pp_size "
                             f"{instance.pp_size}, decode pp_size {pp_size}")
    dp = room % instance.dp_size
    key = (dp, engine_rank % tp_size, 0)
    rank = instance.ranks.get(key)
    if rank is None:
        raise RemoteProtocolError(f"prefill rank dp={key[0]} tp={key[1]} pp={key[2]} is not registered")
    return TargetPlan(ranks=(rank,), required_dst_info_num=1, required_responses=1)


def check_registration(local: KVArgs, reg: Register) -> None:
    """Prefill side: refuse a decode rank whose buffers cannot receive ours, naming both values."""
    checks: list[tuple[str, object, object]] = [
        ("page_size", local.page_size, reg.page_size),
        ("kv_dtype", local.kv_dtype, reg.kv_dtype),
        ("is_mla", local.is_mla, reg.is_mla),
        ("tp_size", local.tp_size, reg.tp_size),
        ("number of KV entries", local.num_entries, len(reg.kv_ptrs)),
        ("number of aux buffers", len(local.aux_data_ptrs), len(reg.aux_ptrs)),
    ]
    for name, ours, theirs in checks:
        if ours != theirs:
            raise LayoutMismatch(f"{name} mismatch: prefill has {ours!r}, decode has {theirs!r}")
    n = len(reg.kv_ptrs)
    if not len(reg.kv_lens) == len(reg.kv_item_lens) == len(reg.kv_layer_ids) == n:
        raise LayoutMismatch("decode registration: kv_ptrs/kv_lens/kv_item_lens/kv_layer_ids lengths differ")
    if not len(reg.aux_lens) == len(reg.aux_item_lens) == len(reg.aux_ptrs):
        raise LayoutMismatch("decode registration: aux_ptrs/aux_lens/aux_item_lens lengths differ")
    for i, (ours_item, theirs_item) in enumerate(zip(local.kv_item_lens, reg.kv_item_lens, strict=True)):
        if ours_item != theirs_item:
            raise LayoutMismatch(f"KV entry {i} item size mismatch: prefill has {ours_item} bytes per page, "
                                 f"decode has {theirs_item}")
    for i, (ours_item, theirs_item) in enumerate(zip(local.aux_item_lens, reg.aux_item_lens, strict=True)):
        if ours_item != theirs_item:
            raise LayoutMismatch(f"aux buffer {i} row size mismatch: prefill has {ours_item} bytes, "
                                 f"decode has {theirs_item}")
    if tuple(local.layer_ids) != tuple(reg.kv_layer_ids):
        raise LayoutMismatch(f"KV layer ids differ: prefill has {list(local.layer_ids)[:8]}..., "
                             f"decode has {list(reg.kv_layer_ids)[:8]}...")
    for i, (length, item) in enumerate(zip(reg.kv_lens, reg.kv_item_lens, strict=True)):
        if item <= 0 or length < item:
            raise LayoutMismatch(f"decode KV entry {i}: item_len {item} vs data_len {length}")
    for i, (length, item) in enumerate(zip(reg.aux_lens, reg.aux_item_lens, strict=True)):
        if item <= 0 or length < item:
            raise LayoutMismatch(f"decode aux buffer {i}: item_len {item} vs data_len {length}")
    if reg.mem_kind not in ("DRAM", "VRAM"):
        raise LayoutMismatch(f"decode mem_kind must be DRAM or VRAM, got {reg.mem_kind!r}")
