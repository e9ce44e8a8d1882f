from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asynckv.errors import InvalidArgument
from asynckv.kernels import _reference as ref
from asynckv.kernels import block_descriptors, head_slice_descriptors, merge_contiguous


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 4), st.integers(1, 8), st.integers(0, 12), st.sampled_from([1, 2, 4]),
       st.sampled_from([1, 2, 4]), st.data())
def test_head_slices_match_the_per_token_reference(entries: int, page_size: int, n: int, hs: int, hd: int,
                                                    data: st.DataObject) -> None:
    head = 8
    heads = min(hs, hd)
    src_items = np.full(entries, page_size * hs * head, dtype=np.uint64)
    dst_items = np.full(entries, page_size * hd * head, dtype=np.uint64)
    src_offs = np.full(entries, data.draw(st.integers(0, hs - heads)) * head, dtype=np.uint64)
    dst_offs = np.full(entries, data.draw(st.integers(0, hd - heads)) * head, dtype=np.uint64)
    nbytes = np.full(entries, heads * head, dtype=np.uint64)
    src_pages = np.array(data.draw(st.permutations(range(20)))[:n], dtype=np.int64)
    dst_pages = np.array(data.draw(st.permutations(range(20)))[:n], dtype=np.int64)
    sp = np.arange(entries, dtype=np.uint64) * np.uint64(1 << 20) + np.uint64(1 << 30)
    dp = np.arange(entries, dtype=np.uint64) * np.uint64(1 << 20) + np.uint64(1 << 36)
    got_s, got_d = head_slice_descriptors(sp, dp, src_items, dst_items, page_size, src_pages, dst_pages,
                                          src_offs, dst_offs, nbytes)
    want_s, want_d = ref.merge_contiguous(*ref.head_slice_descriptors(
        sp.tolist(), dp.tolist(), src_items.tolist(), dst_items.tolist(), page_size, src_pages.tolist(),
        dst_pages.tolist(), src_offs.tolist(), dst_offs.tolist(), nbytes.tolist()))
    assert [tuple(r) for r in got_s.tolist()] == want_s
    assert [tuple(r) for r in got_d.tolist()] == want_d


def test_full_token_rows_collapse_back_into_runs() -> None:
    items = np.array([64], dtype=np.uint64)
    zero = np.zeros(1, dtype=np.uint64)
    src, dst = head_slice_descriptors(zero, zero + np.uint64(1 << 20), items, items, 4, np.arange(3, dtype=np.int64),
                                      np.arange(5, 8, dtype=np.int64), zero, zero, np.array([16], dtype=np.uint64))
    assert src.tolist() == [[0, 192, 0]] and dst.tolist() == [[(1 << 20) + 320, 192, 0]]


def test_a_slice_crossing_a_token_boundary_is_refused() -> None:
    items = np.array([64], dtype=np.uint64)
    with pytest.raises(InvalidArgument, match="crosses a token boundary"):
        head_slice_descriptors(items * 0, items * 0, items, items, 4, np.arange(1), np.arange(1),
                               np.array([8], dtype=np.uint64), np.zeros(1, dtype=np.uint64),
                               np.array([16], dtype=np.uint64))


def test_merge_contiguous_only_merges_when_both_sides_continue() -> None:
    src = np.array([[0, 8, 0], [8, 8, 0], [16, 8, 0], [40, 8, 0]], dtype=np.uint64)
    dst = np.array([[100, 8, 0], [108, 8, 0], [200, 8, 0], [208, 8, 0]], dtype=np.uint64)
    s, d = merge_contiguous(src, dst)
    assert s.tolist() == [[0, 16, 0], [16, 8, 0], [40, 8, 0]]
    assert d.tolist() == [[100, 16, 0], [200, 8, 0], [208, 8, 0]]


def test_block_descriptors_skip_empty_blocks() -> None:
    one = np.array([1], dtype=np.uint64)
    src, dst = block_descriptors(one * 1000, one * 5000, one * 64, one * 128, 2, 3,
                                 np.array([[0, 32]], dtype=np.uint64), np.array([[16, 80]], dtype=np.uint64),
                                 np.array([[16, 0]], dtype=np.uint64))
    assert src.tolist() == [[1128, 16, 0]] and dst.tolist() == [[5000 + 384 + 16, 16, 0]]
