"""Prefill side: what a decode rank's ``Register`` must satisfy before anything is built from it.

Its geometry must be able to receive ours (checked against this rank's own, naming both
values), and its claimed pool is bounded: the destination dlist prefill prepares has one row
per local KV entry and decode page, built from the claim alone.
"""

from __future__ import annotations

from typing import Any

from ..errors import LayoutMismatch, RemoteProtocolError
from ..layout import KVArgs
from .messages import Register

__all__ = [
    "INT32_ROWS", "POOL_RATIO", "check_pool_size", "check_registration", "check_tp", "registered_slots", "state_rank",
]


def check_tp(tp_prefill: int, tp_decode: int) -> None:
    """Either TP size must divide the other: rank mapping (``topology.plan_targets``) needs it."""
    if min(tp_prefill, tp_decode) < 1:
        raise LayoutMismatch(f"tp_size mismatch: prefill has {tp_prefill}, decode has {tp_decode}; both must be "
                             f"at least 1")
    if tp_prefill % tp_decode and tp_decode % tp_prefill:
        raise LayoutMismatch(f"tp_size mismatch: prefill has {tp_prefill}, decode has {tp_decode}; "
                             f"one must divide the other")


INT32_ROWS = 2**31 - 1
"""Prepared dlists are indexed with int32."""
POOL_RATIO = 4
"""A decode rank may register up to this many times this rank's own pool (in memory)."""


def registered_slots(lens: Any, items: Any) -> int:
    """Whole items (pages, rows, slots) that every one of these entries holds (0 when there is none)."""
    return min((int(n) // int(i) for n, i in zip(lens, items, strict=True)), default=0)


def check_pool_size(local: KVArgs, reg: Register, max_rows: int | None) -> None:
    """Refuse a decode pool whose destination dlist (one row per local KV entry and decode page) is
    larger than ``max_rows`` and than ``POOL_RATIO`` times this rank's own rows, scaled by the decode's
    TP size over ours (a decode rank at twice our TP holds half the heads per page: twice the pages in
    the same memory). The rows would be built from the claim alone (a 1 KiB Register can claim 10M
    pages); past int32 indexing nothing is accepted."""
    pages = registered_slots(reg.kv_lens, reg.kv_item_lens)
    entries = local.num_entries
    rows, own = entries * pages, entries * local.num_pages
    relative = POOL_RATIO * max(1, reg.tp_size // local.tp_size) * own
    limit = min(INT32_ROWS, max(relative, INT32_ROWS if max_rows is None else max_rows))
    if rows > limit:
        raise RemoteProtocolError(
            f"decode pool too large: {pages} pages x {entries} KV entries = {rows} destination rows, at most "
            f"{limit} accepted (max_peer_dlist_rows={max_rows}; this rank's own pool is {own} rows, a decode at "
            f"TP {reg.tp_size} may have {relative})")


def check_registration(local: KVArgs, reg: Register) -> None:
    """Refuse a decode rank whose geometry cannot receive ours, naming both values."""
    checks: list[tuple[str, object, object]] = [
        ("page_size", local.page_size, reg.page_size),
        ("kv_dtype", local.kv_dtype, reg.kv_dtype),
        ("is_mla", local.is_mla, reg.is_mla),
        ("total_kv_head_num", local.total_kv_head_num, reg.total_kv_head_num),
        ("number of aux buffers", len(local.aux_data_ptrs), len(reg.aux_ptrs)),
    ]
    for name, ours, theirs in checks:
        if ours != theirs:
            raise LayoutMismatch(f"{name} mismatch: prefill has {ours!r}, decode has {theirs!r}")
    check_tp(local.tp_size, reg.tp_size)
    n = len(reg.kv_ptrs)
    if not len(reg.kv_lens) == len(reg.kv_item_lens) == len(reg.kv_layer_ids) == n:
        raise LayoutMismatch("decode registration: kv_ptrs/kv_lens/kv_item_lens/kv_layer_ids lengths differ")
    if not len(reg.aux_lens) == len(reg.aux_item_lens) == len(reg.aux_ptrs):
        raise LayoutMismatch("decode registration: aux_ptrs/aux_lens/aux_item_lens lengths differ")
    if not len(reg.state_lens) == len(reg.state_item_lens) == len(reg.state_ptrs):
        raise LayoutMismatch("decode registration: state_ptrs/state_lens/state_item_lens lengths differ")
    for name in ("state_layer_ids", "state_dims", "state_outer"):  # (each optional: empty, or one per entry)
        if len(getattr(reg, name)) not in (0, len(reg.state_ptrs)):
            raise LayoutMismatch(f"decode registration: {len(getattr(reg, name))} {name} for "
                                 f"{len(reg.state_ptrs)} state entries")
    _check_state_rank(local, reg)
    for i, (ours_item, theirs_item) in enumerate(zip(local.aux_item_lens, reg.aux_item_lens, strict=True)):
        if ours_item != theirs_item:
            raise LayoutMismatch(f"aux buffer {i} row size mismatch: prefill has {ours_item} bytes, "
                                 f"decode has {theirs_item}")
    for what, lens, items in (("KV", reg.kv_lens, reg.kv_item_lens), ("aux", reg.aux_lens, reg.aux_item_lens),
                              ("state", reg.state_lens, reg.state_item_lens)):
        for i, (length, item) in enumerate(zip(lens, items, strict=True)):
            if item <= 0 or length < item:
                raise LayoutMismatch(f"decode {what} entry {i}: item_len {item} vs data_len {length}")
    if reg.mem_kind not in ("DRAM", "VRAM"):
        raise LayoutMismatch(f"decode mem_kind must be DRAM or VRAM, got {reg.mem_kind!r}")


def state_rank(reg: Register) -> tuple[int, int, int]:
    """(TP size, engine rank, KV heads) of the rank a Register's state entries belong to: its own, or where
    its KV pool is a decode staging area's slots (registered as a rank of the prefill's TP) the real rank's
    (``Register.state_tp_size``, ``state_engine_rank``, ``state_head_num``)."""
    if reg.state_tp_size:
        return reg.state_tp_size, reg.state_engine_rank, reg.state_head_num
    return reg.tp_size, reg.engine_rank, reg.kv_head_num


def _check_state_rank(local: KVArgs, reg: Register) -> None:
    """The rank a staging area's state belongs to (``Register.state_tp_size``) must be a rank of a TP we
    can pair with, holding the heads that TP gives a rank."""
    if not reg.state_tp_size:
        return
    tp, rank, heads = state_rank(reg)
    check_tp(local.tp_size, tp)
    if rank >= tp:
        raise LayoutMismatch(f"decode registration: state_engine_rank {rank} is not a rank of state_tp_size {tp}")
    expected = max(1, local.total_kv_head_num // tp)
    if not local.is_mla and heads != expected:
        raise LayoutMismatch(f"decode registration: state_head_num {heads} at state_tp_size {tp}, expected {expected} "
                             f"({local.total_kv_head_num} KV heads in all)")
