"""Page indices to NIXL descriptors, for MHA (K and V entries) and MLA (one entry per layer).

A descriptor array is ``(N, 3)`` C-contiguous ``uint64``: address, length, device id,
the shape ``nixl_agent.get_xfer_descs`` converts without holding a Python loop.
Entries are paired positionally: ``src_ptrs[e]`` is copied into ``dst_ptrs[e]``; the
caller reorders ``dst_ptrs`` when the pairing is by layer id.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import InvalidArgument

__all__ = [
    "aux_descriptors",
    "check_pages",
    "coalesce_runs",
    "handle_bounds",
    "kv_page_descriptors",
    "prepped_indices",
    "prepped_pages_and_row",
    "prepped_row",
    "split_long",
    "validate_pages",
]

IntArray = npt.NDArray[np.int64]
DescArray = npt.NDArray[np.uint64]
_INT32_MAX = int(np.iinfo(np.int32).max)


def validate_pages(pages: Any, num_pages: int, what: str = "page indices") -> IntArray:
    """Return ``pages`` as a 1-D int64 array, refusing non-integers, out-of-range and duplicates."""
    arr = _index_array(pages, what)
    if arr.size == 0:
        return np.empty(0, dtype=np.int64)
    _check_range_unique(arr, num_pages, what)
    return arr.astype(np.int64, copy=False)


def check_pages(pages: Any, num_pages: int, what: str = "page indices") -> None:
    """Refuse what ``validate_pages`` refuses, in the array's own dtype: no int64 copy (for arrays
    that are checked and kept as they are, such as a decode's destination: a 64 MiB int32 array
    sorts 3x faster than its int64 copy, in half the memory)."""
    arr = _index_array(pages, what)
    if arr.size:
        _check_range_unique(arr, num_pages, what)


def _index_array(pages: Any, what: str) -> npt.NDArray[Any]:
    arr = np.asarray(pages)
    if arr.ndim != 1:
        raise InvalidArgument(f"{what} must be one-dimensional, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise InvalidArgument(f"{what} must be integers, got dtype {arr.dtype}")
    return arr


def _check_range_unique(arr: npt.NDArray[Any], num_pages: int, what: str) -> None:
    """Every value of a non-empty integer array is in ``[0, num_pages)`` and appears once."""
    if arr.size <= 64:  # small requests: plain Python beats numpy's per-call overhead
        values = arr.tolist()
        lo, hi = min(values), max(values)
    else:  # one sort gives the range and the duplicates (min and max first cost two more passes: +1.6 us at 256)
        sorted_pages = np.sort(arr)
        lo, hi = int(sorted_pages[0]), int(sorted_pages[-1])
    if lo < 0 or hi >= num_pages:
        raise InvalidArgument(f"{what}: index {lo if lo < 0 else hi} outside the registered range [0, {num_pages})")
    if arr.size > num_pages:  # more indices than slots: one repeats within the first num_pages + 1
        raise InvalidArgument(f"{what}: page {_first_repeat(arr)} appears more than once")
    if arr.size <= 64:
        if len(set(values)) != len(values):
            raise InvalidArgument(f"{what}: page {_first_repeat(arr)} appears more than once")
        return
    dup = sorted_pages[1:] == sorted_pages[:-1]
    if dup.any():
        raise InvalidArgument(f"{what}: page {int(sorted_pages[1:][dup][0])} appears more than once")


def _first_repeat(arr: npt.NDArray[Any]) -> int:
    """The first value that repeats an earlier one (the array has one)."""
    seen: set[int] = set()
    for start in range(0, arr.size, 65536):  # a chunk at a time: stops early without listing all
        for v in arr[start:start + 65536].tolist():
            if v in seen:
                return int(v)
            seen.add(v)
    raise AssertionError("no value repeats")


def coalesce_runs(src: IntArray, dst: IntArray) -> tuple[IntArray, IntArray, IntArray]:
    """Split paired page lists into maximal runs where both sides advance by exactly one.

    Returns ``(src_start, dst_start, length)``; order is preserved, nothing is sorted.
    """
    if src.shape != dst.shape:
        raise InvalidArgument(f"source and destination page counts differ: {src.size} != {dst.size}")
    if src.size == 0:
        empty = np.empty(0, dtype=np.int64)
        return empty, empty.copy(), empty.copy()
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [src.size]))
    return src[starts].astype(np.int64), dst[starts].astype(np.int64), (ends - starts).astype(np.int64)


def kv_page_descriptors(
    src_ptrs: npt.NDArray[np.uint64], dst_ptrs: npt.NDArray[np.uint64],
    src_item_lens: npt.NDArray[np.uint64], dst_item_lens: npt.NDArray[np.uint64],
    src_pages: IntArray, dst_pages: IntArray, src_dev: int = 0, dst_dev: int = 0,
) -> tuple[DescArray, DescArray]:
    """Coalesced (src, dst) descriptors copying pages of every entry, entry-major.

    Each side strides by its own item length; the bytes copied per page are the source
    item length, which must not exceed the destination's (checked).
    """
    if np.any(src_item_lens > dst_item_lens):
        raise InvalidArgument("a source item is larger than its destination item")
    s0, d0, n = coalesce_runs(src_pages, dst_pages)
    n_entries, n_runs = len(src_ptrs), len(n)
    src = np.empty((n_entries * n_runs, 3), dtype=np.uint64)
    dst = np.empty((n_entries * n_runs, 3), dtype=np.uint64)
    s_item = src_item_lens.astype(np.uint64)[:, None]
    d_item = dst_item_lens.astype(np.uint64)[:, None]
    src[:, 0] = (src_ptrs.astype(np.uint64)[:, None] + s_item * s0.astype(np.uint64)[None, :]).ravel()
    dst[:, 0] = (dst_ptrs.astype(np.uint64)[:, None] + d_item * d0.astype(np.uint64)[None, :]).ravel()
    length = (s_item * n.astype(np.uint64)[None, :]).ravel()
    src[:, 1] = length
    dst[:, 1] = length
    src[:, 2] = src_dev
    dst[:, 2] = dst_dev
    return src, dst


def prepped_indices(pages: IntArray, num_slots: int, num_entries: int) -> npt.NDArray[np.int32]:
    """Flat indices into a prepared dlist laid out entry-major (``entry * num_slots + page``);
    ``pages`` must lie in ``[0, num_slots)`` (checked where they came in)."""
    return (_entry_bases(num_slots, num_entries) + pages.astype(np.int32, copy=False)[None, :]).ravel()


def prepped_row(row: int, num_slots: int, num_entries: int, first: int = 0) -> npt.NDArray[np.int32]:
    """``prepped_indices`` of one slot ``row``, in a dlist whose first such row is ``first`` (the
    aux rows follow the KV rows); the caller keeps every index within int32."""
    return _entry_bases(num_slots, num_entries)[:, 0] + np.int32(first + row)


def prepped_pages_and_row(pages: IntArray, num_slots: int, num_entries: int, row: int, row_slots: int,
                          row_entries: int, first: int) -> npt.NDArray[np.int32]:
    """``prepped_indices(pages, num_slots, num_entries)`` followed by ``prepped_row(row, row_slots,
    row_entries, first)`` as one array: a small KV post with the aux row riding on it. ``row`` must
    lie in ``[0, row_slots)`` (checked where it came in). A 1-page post (the common small room) is
    one add to a cached template: 1.5 us against 3.2 us for the entry bases, the row and a join
    (64 entries; the prefill loop of the reference workload's 1-page case spent 8% of its samples
    here, py-spy, 2026-12-07)."""
    bases = _pages_and_row_bases(num_slots, num_entries, row_slots, row_entries, first)
    n = len(pages)
    if n == 1:
        offsets = np.empty(num_entries + row_entries, dtype=np.int32)
        offsets[:num_entries] = pages[0]
        offsets[num_entries:] = row
        return bases + offsets
    out = np.empty(num_entries * n + row_entries, dtype=np.int32)
    np.add(_entry_bases(num_slots, num_entries), pages.astype(np.int32, copy=False),
           out=out[:num_entries * n].reshape(num_entries, n))
    np.add(bases[num_entries:], np.int32(row), out=out[num_entries * n:])
    return out


@functools.lru_cache(maxsize=64)
def _pages_and_row_bases(num_slots: int, num_entries: int, row_slots: int, row_entries: int,
                         first: int) -> npt.NDArray[np.int32]:
    """The indices of page 0 in every KV entry, then of row 0 in every row entry (from ``first``):
    what ``prepped_pages_and_row`` adds a page and a row to (read-only, per dlist shape)."""
    last = first + (row_entries - 1) * row_slots + row_slots - 1
    if first < 0 or last > _INT32_MAX:
        raise InvalidArgument(f"prepared rows {first}..{last} exceed int32 indexing")
    out = np.concatenate((_entry_bases(num_slots, num_entries)[:, 0], prepped_row(0, row_slots, row_entries, first)))
    out.flags.writeable = False
    return out


@functools.lru_cache(maxsize=64)
def _entry_bases(num_slots: int, num_entries: int) -> npt.NDArray[np.int32]:
    """``entry * num_slots`` as an int32 column, per dlist shape (read-only; a room's write used to
    rebuild it, which with the int64 round trips cost more than the indices of a 1-page write)."""
    total = num_slots * num_entries
    if total > _INT32_MAX:
        raise InvalidArgument(f"prepared dlist of {total} rows exceeds int32 indexing")
    base = (np.arange(num_entries, dtype=np.int64) * num_slots).astype(np.int32)[:, None]
    base.flags.writeable = False
    return base


def aux_descriptors(
    src_ptrs: npt.NDArray[np.uint64], dst_ptrs: npt.NDArray[np.uint64],
    item_lens: npt.NDArray[np.uint64], src_row: int, dst_row: int,
) -> tuple[DescArray, DescArray]:
    """One DRAM descriptor per aux buffer: row ``src_row`` into row ``dst_row``."""
    n = len(src_ptrs)
    items = item_lens.astype(np.uint64)
    src = np.zeros((n, 3), dtype=np.uint64)
    dst = np.zeros((n, 3), dtype=np.uint64)
    src[:, 0] = src_ptrs.astype(np.uint64) + items * np.uint64(src_row)
    dst[:, 0] = dst_ptrs.astype(np.uint64) + items * np.uint64(dst_row)
    src[:, 1] = items
    dst[:, 1] = items
    return src, dst


def split_long(src: DescArray, dst: DescArray, max_len: int) -> tuple[DescArray, DescArray]:
    """Cut every descriptor pair longer than ``max_len`` bytes into pieces of at most ``max_len``."""
    if max_len < 1:
        raise InvalidArgument(f"max_len must be >= 1, got {max_len}")
    if len(src) == 0:
        return src, dst
    lens = src[:, 1].astype(np.int64)
    parts = -(-lens // max_len)  # ceil
    if not np.any(parts > 1):
        return src, dst
    row = np.repeat(np.arange(len(src)), parts)
    first = np.repeat(np.cumsum(parts) - parts, parts)
    offset = ((np.arange(len(row)) - first) * max_len).astype(np.uint64)
    length = np.minimum(lens[row] - offset.astype(np.int64), max_len).astype(np.uint64)
    out_s, out_d = src[row].copy(), dst[row].copy()
    out_s[:, 0] += offset
    out_d[:, 0] += offset
    out_s[:, 1] = length
    out_d[:, 1] = length
    return out_s, out_d


def handle_bounds(lengths: npt.NDArray[np.integer], max_descs: int, max_bytes: int) -> list[tuple[int, int]]:
    """Cut a row sequence into consecutive ``[start, end)`` groups of at most ``max_descs`` rows and
    ``max_bytes`` bytes (a single longer row forms a group of its own)."""
    n = len(lengths)
    if n == 0:
        return []
    cum = np.cumsum(lengths, dtype=np.int64)
    if n <= max_descs and int(cum[-1]) <= max_bytes:  # one handle (most writes): no search
        return [(0, n)]
    bounds = []
    start = 0
    while start < n:
        base = int(cum[start - 1]) if start else 0
        end = int(np.searchsorted(cum, base + max_bytes, side="right"))
        end = min(max(end, start + 1), start + max_descs, n)
        bounds.append((start, end))
        start = end
    return bounds
