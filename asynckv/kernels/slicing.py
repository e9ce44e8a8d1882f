"""Descriptors for layouts that are not whole-page copies: TP head slices and state slots.

Heterogeneous TP (MHA, NHD layout): inside one page item, token ``t`` starts at
``t * item / page_size`` and head ``h`` of that token ``h * head_bytes`` further. A prefill
rank writes ``n`` heads of every token of every page into a decode rank's page at a head
offset. Rows are built vectorized (entry x page x token) and adjacent rows that are
contiguous on both sides are merged, so a slice that covers whole token rows collapses
back into page-sized descriptors.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from ..errors import InvalidArgument

__all__ = ["block_descriptors", "head_slice_descriptors", "merge_contiguous"]

U64 = npt.NDArray[np.uint64]
I64 = npt.NDArray[np.int64]


def merge_contiguous(src: U64, dst: U64) -> tuple[U64, U64]:
    """Merge consecutive descriptor pairs that continue each other on both sides."""
    if len(src) != len(dst):
        raise InvalidArgument(f"descriptor counts differ: {len(src)} != {len(dst)}")
    if len(src) < 2:
        return src, dst
    joins = ((src[:-1, 0] + src[:-1, 1] == src[1:, 0]) & (dst[:-1, 0] + dst[:-1, 1] == dst[1:, 0])
             & (src[:-1, 2] == src[1:, 2]) & (dst[:-1, 2] == dst[1:, 2]))
    if not joins.any():
        return src, dst
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    lengths = np.add.reduceat(src[:, 1], starts)
    out_s, out_d = src[starts].copy(), dst[starts].copy()
    out_s[:, 1] = lengths
    out_d[:, 1] = lengths
    return out_s, out_d


def head_slice_descriptors(
    src_ptrs: U64, dst_ptrs: U64, src_items: U64, dst_items: U64, page_size: int,
    src_pages: I64, dst_pages: I64, src_offs: U64, dst_offs: U64, nbytes: U64,
    src_dev: int = 0, dst_dev: int = 0,
) -> tuple[U64, U64]:
    """One (merged) descriptor per entry x page x token: ``nbytes[e]`` from the source token row
    at ``src_offs[e]`` into the destination token row at ``dst_offs[e]``. All per-entry arrays
    are aligned (entry ``e`` of the source pairs with entry ``e`` of the destination)."""
    if len(src_pages) != len(dst_pages):
        raise InvalidArgument(f"source and destination page counts differ: {len(src_pages)} != {len(dst_pages)}")
    if np.any(src_items % np.uint64(page_size)) or np.any(dst_items % np.uint64(page_size)):
        raise InvalidArgument("item sizes must be whole token rows (a multiple of page_size)")
    src_row = src_items // np.uint64(page_size)
    dst_row = dst_items // np.uint64(page_size)
    if np.any(src_offs + nbytes > src_row) or np.any(dst_offs + nbytes > dst_row):
        raise InvalidArgument("a head slice crosses a token boundary")
    tok = np.arange(page_size, dtype=np.uint64)
    sp = src_pages.astype(np.uint64)
    dp = dst_pages.astype(np.uint64)
    s_addr = (src_ptrs[:, None, None] + sp[None, :, None] * src_items[:, None, None]
              + tok[None, None, :] * src_row[:, None, None] + src_offs[:, None, None])
    d_addr = (dst_ptrs[:, None, None] + dp[None, :, None] * dst_items[:, None, None]
              + tok[None, None, :] * dst_row[:, None, None] + dst_offs[:, None, None])
    n = s_addr.size
    src = np.empty((n, 3), dtype=np.uint64)
    dst = np.empty((n, 3), dtype=np.uint64)
    src[:, 0] = s_addr.ravel()
    dst[:, 0] = d_addr.ravel()
    lens = np.broadcast_to(nbytes[:, None, None], s_addr.shape).ravel()
    src[:, 1] = lens
    dst[:, 1] = lens
    src[:, 2] = src_dev
    dst[:, 2] = dst_dev
    return merge_contiguous(src, dst)


def block_descriptors(
    src_ptrs: U64, dst_ptrs: U64, src_items: U64, dst_items: U64, src_slot: int, dst_slot: int,
    src_offs: U64, dst_offs: U64, lens: U64, src_dev: int = 0, dst_dev: int = 0,
) -> tuple[U64, U64]:
    """Byte blocks of one slot per entry: block ``k`` of entry ``e`` copies ``lens[e, k]`` bytes
    from ``src_offs[e, k]`` inside the source slot to ``dst_offs[e, k]`` inside the destination
    slot. Blocks with length 0 are skipped. Used for mamba state slices across TP sizes."""
    s_addr = src_ptrs[:, None] + src_items[:, None] * np.uint64(src_slot) + src_offs
    d_addr = dst_ptrs[:, None] + dst_items[:, None] * np.uint64(dst_slot) + dst_offs
    keep = (lens > 0).ravel()
    src = np.empty((int(keep.sum()), 3), dtype=np.uint64)
    dst = np.empty_like(src)
    src[:, 0] = s_addr.ravel()[keep]
    dst[:, 0] = d_addr.ravel()[keep]
    src[:, 1] = lens.ravel()[keep]
    dst[:, 1] = lens.ravel()[keep]
    src[:, 2] = src_dev
    dst[:, 2] = dst_dev
    return merge_contiguous(src, dst)
