from __future__ import annotations

from typing import cast

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asynckv.errors import InvalidArgument
from asynckv.kernels import _reference as ref
from asynckv.kernels import (
    aux_descriptors,
    check_pages,
    coalesce_runs,
    handle_bounds,
    kv_page_descriptors,
    prepped_indices,
    prepped_pages_and_row,
    prepped_row,
    split_long,
    validate_pages,
)

Rows = list[tuple[int, int, int]]  # descriptor rows as the reference takes them: (address, length, device)


@st.composite
def page_pairs(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray]:
    n = draw(st.integers(0, 64))
    kind = draw(st.sampled_from(["random", "contiguous", "runs"]))
    if kind == "contiguous":
        s0, d0 = draw(st.integers(0, 100)), draw(st.integers(0, 100))
        return np.arange(s0, s0 + n), np.arange(d0, d0 + n)
    src = np.array(draw(st.permutations(range(200)))[:n])
    dst = np.array(draw(st.permutations(range(200)))[:n])
    if kind == "runs" and n:
        cut = draw(st.integers(0, n))
        src[:cut] = np.arange(cut) + 300
        dst[:cut] = np.arange(cut) + 500
    return src.astype(np.int64), dst.astype(np.int64)


@settings(max_examples=200, deadline=None)
@given(page_pairs())
def test_coalesce_runs_matches_reference(pair: tuple[np.ndarray, np.ndarray]) -> None:
    src, dst = pair
    s0, d0, n = coalesce_runs(src, dst)
    assert list(zip(s0.tolist(), d0.tolist(), n.tolist(), strict=True)) == ref.coalesce_runs(src.tolist(), dst.tolist())
    assert int(n.sum()) == len(src)


@settings(max_examples=200, deadline=None)
@given(page_pairs(), st.integers(1, 6), st.booleans())
def test_kv_page_descriptors_match_reference(pair: tuple[np.ndarray, np.ndarray], entries: int,
                                             wider_dst: bool) -> None:
    src, dst = pair
    rng = np.random.default_rng(entries)
    sp = rng.integers(1 << 30, 1 << 40, entries).astype(np.uint64)
    dp = rng.integers(1 << 30, 1 << 40, entries).astype(np.uint64)
    si = rng.integers(1, 5000, entries).astype(np.uint64)
    di = cast(npt.NDArray[np.uint64], si + (rng.integers(0, 100, entries).astype(np.uint64) if wider_dst else 0))
    got_s, got_d = kv_page_descriptors(sp, dp, si, di, src, dst, 0, 3)
    want_s, want_d = ref.kv_page_descriptors(sp.tolist(), dp.tolist(), si.tolist(), di.tolist(),
                                             src.tolist(), dst.tolist(), 0, 3)
    assert [tuple(r) for r in got_s.tolist()] == want_s
    assert [tuple(r) for r in got_d.tolist()] == want_d
    assert got_s.dtype == np.uint64 and got_s.flags.c_contiguous and got_s.shape[1] == 3


def test_coalescing_contiguous_pages_gives_one_descriptor_per_entry() -> None:
    src, dst = kv_page_descriptors(np.array([0, 10**6], dtype=np.uint64),
                                   np.array([5 * 10**6, 6 * 10**6], dtype=np.uint64),
                                   np.array([100, 100], dtype=np.uint64), np.array([100, 100], dtype=np.uint64),
                                   np.arange(10, 42), np.arange(0, 32))
    assert src.tolist() == [[1000, 3200, 0], [10**6 + 1000, 3200, 0]]
    assert dst.tolist() == [[5 * 10**6, 3200, 0], [6 * 10**6, 3200, 0]]


def test_all_scattered_pages_give_one_descriptor_per_page() -> None:
    src, _ = kv_page_descriptors(np.array([0], dtype=np.uint64), np.array([0], dtype=np.uint64),
                                 np.array([8], dtype=np.uint64), np.array([8], dtype=np.uint64),
                                 np.array([0, 2, 4, 6]), np.array([9, 7, 5, 3]))
    assert len(src) == 4


def test_empty_and_one_page() -> None:
    s, d = kv_page_descriptors(np.array([0], dtype=np.uint64), np.array([0], dtype=np.uint64),
                               np.array([8], dtype=np.uint64), np.array([8], dtype=np.uint64),
                               np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64))
    assert s.shape == (0, 3) and d.shape == (0, 3)
    s, d = kv_page_descriptors(np.array([0], dtype=np.uint64), np.array([0], dtype=np.uint64),
                               np.array([8], dtype=np.uint64), np.array([8], dtype=np.uint64),
                               np.array([3]), np.array([5]))
    assert s.tolist() == [[24, 8, 0]] and d.tolist() == [[40, 8, 0]]


def test_source_item_larger_than_destination_is_refused() -> None:
    with pytest.raises(InvalidArgument):
        kv_page_descriptors(np.array([0], dtype=np.uint64), np.array([0], dtype=np.uint64),
                            np.array([16], dtype=np.uint64), np.array([8], dtype=np.uint64),
                            np.array([0]), np.array([0]))


def test_unequal_page_counts_are_refused() -> None:
    with pytest.raises(InvalidArgument, match="differ"):
        coalesce_runs(np.arange(3), np.arange(4))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 99), max_size=50, unique=True), st.integers(1, 5))
def test_prepped_indices_match_reference(pages: list[int], entries: int) -> None:
    got = prepped_indices(np.array(pages, dtype=np.int64), 100, entries)
    assert got.dtype == np.int32
    assert got.tolist() == ref.prepped_indices(pages, 100, entries)


def test_prepped_indices_refuse_int32_overflow() -> None:
    with pytest.raises(InvalidArgument, match="int32"):
        prepped_indices(np.array([0]), 2**31, 2)


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 99), st.integers(1, 5), st.integers(0, 10_000))
def test_prepped_row_is_one_rows_indices_after_first(row: int, entries: int, first: int) -> None:
    got = prepped_row(row, 100, entries, first)
    assert got.dtype == np.int32
    assert got.tolist() == [first + i for i in ref.prepped_indices([row], 100, entries)]
    assert prepped_indices(np.array([row]), 100, entries).tolist() == ref.prepped_indices([row], 100, entries)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 99), min_size=1, max_size=20, unique=True), st.integers(1, 5), st.integers(0, 15),
       st.integers(1, 3), st.integers(0, 10_000))
def test_prepped_pages_and_row_is_the_pages_indices_then_the_rows(pages: list[int], entries: int, row: int,
                                                                   row_entries: int, first: int) -> None:
    got = prepped_pages_and_row(np.array(pages, dtype=np.int64), 100, entries, row, 16, row_entries, first)
    assert got.dtype == np.int32
    assert got.tolist() == ref.prepped_indices(pages, 100, entries) + [
        first + i for i in ref.prepped_indices([row], 16, row_entries)]


def test_prepped_pages_and_row_of_no_pages_is_the_rows_alone() -> None:
    got = prepped_pages_and_row(np.empty(0, dtype=np.int64), 100, 3, 2, 16, 2, 500)
    assert got.dtype == np.int32
    assert got.tolist() == [502, 518]


def test_prepped_pages_and_row_refuses_rows_past_int32() -> None:
    top = int(np.iinfo(np.int32).max)
    assert prepped_pages_and_row(np.array([1]), 10, 2, 3, 4, 2, top - 7).tolist()[-2:] == [top - 4, top]
    with pytest.raises(InvalidArgument, match="exceed int32"):
        prepped_pages_and_row(np.array([1]), 10, 2, 3, 4, 2, top - 6)


@pytest.mark.parametrize("pages, needle", [
    ([0, 1, 1], "appears more than once"),
    ([0, 10], "outside the registered range"),
    ([-1], "outside the registered range"),
    ([[1, 2]], "one-dimensional"),
    ([0.5], "integers"),
])
def test_validate_pages_refuses_bad_input(pages: list[object], needle: str) -> None:
    with pytest.raises(InvalidArgument, match=needle):
        validate_pages(pages, 10)


@pytest.mark.parametrize("change, message", [
    ({7: 500}, "index 500 outside the registered range [0, 200)"),
    ({7: -2, 9: 500}, "index -2 outside the registered range [0, 200)"),  # (the low end is named first)
    ({7: 42}, "page 42 appears more than once"),
])
def test_validate_pages_names_the_offending_index_above_the_small_path(change: dict[int, int], message: str) -> None:
    """Above 64 indices one sort gives the range and the duplicates: the same refusals, the same index named."""
    pages = 43 + np.random.default_rng(3).permutation(157)[:100]  # distinct, all in range, none is 42
    pages[0] = 42
    for at, value in change.items():
        pages[at] = value
    with pytest.raises(InvalidArgument) as exc:
        validate_pages(pages, 200)
    assert str(exc.value).endswith(message)


def test_validate_pages_accepts_unsorted_and_empty() -> None:
    assert validate_pages([9, 0, 4], 10).tolist() == [9, 0, 4]
    assert validate_pages([], 10).size == 0
    assert validate_pages(np.array([3], dtype=np.int32), 10).dtype == np.int64


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-3, 120), max_size=150), st.integers(1, 100),
       st.sampled_from([np.int32, np.int64, np.uint32]))
def test_check_pages_refuses_exactly_what_validate_pages_refuses(pages: list[int], num_pages: int,
                                                                  dtype: type[np.integer]) -> None:
    """Over the small (Python) and large (numpy) paths, with and without more indices than pages."""
    if dtype is np.uint32:
        pages = [p for p in pages if p >= 0]
    arr = np.array(pages, dtype=dtype)
    try:
        want: str | None = None
        validate_pages(arr, num_pages)
    except InvalidArgument as exc:
        want = str(exc)
    try:
        got: str | None = None
        check_pages(arr, num_pages)
    except InvalidArgument as exc:
        got = str(exc)
    assert got == want
    assert (want is None) == (len(set(pages)) == len(pages) and all(0 <= p < num_pages for p in pages))


def test_check_pages_keeps_the_arrays_dtype_and_finds_a_repeat_in_a_long_array_without_sorting_it() -> None:
    with pytest.raises(InvalidArgument, match="page 3 appears more than once"):
        check_pages(np.array([3, 1, 2, 3] + [0] * 10**6, dtype=np.int32), 4)  # more indices than pages
    check_pages(np.arange(10**6, dtype=np.int32)[::-1], 10**6)


def test_aux_descriptors() -> None:
    s, d = aux_descriptors(np.array([1000, 2000], dtype=np.uint64), np.array([5000, 6000], dtype=np.uint64),
                           np.array([64, 32], dtype=np.uint64), 2, 5)
    assert s.tolist() == [[1128, 64, 0], [2064, 32, 0]]
    assert d.tolist() == [[5320, 64, 0], [6160, 32, 0]]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2**40), st.integers(1, 5000)), max_size=30), st.integers(1, 700))
def test_split_long_matches_the_reference(rows: list[tuple[int, int]], max_len: int) -> None:
    src = np.array([(a, n, 1) for a, n in rows], dtype=np.uint64).reshape(-1, 3)
    dst = np.array([(a + 7, n, 2) for a, n in rows], dtype=np.uint64).reshape(-1, 3)
    out_s, out_d = split_long(src, dst, max_len)
    want_s, want_d = ref.split_long(cast(Rows, [tuple(map(int, r)) for r in src]),
                                    cast(Rows, [tuple(map(int, r)) for r in dst]), max_len)
    assert [tuple(map(int, r)) for r in out_s] == want_s and [tuple(map(int, r)) for r in out_d] == want_d
    assert int(out_s[:, 1].sum()) == sum(n for _, n in rows)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 1000), max_size=60), st.integers(1, 9), st.integers(1, 3000))
def test_handle_bounds_match_the_reference(lengths: list[int], max_descs: int, max_bytes: int) -> None:
    got = handle_bounds(np.array(lengths, dtype=np.int64), max_descs, max_bytes)
    assert got == ref.handle_bounds(lengths, max_descs, max_bytes)
    for start, end in got:
        assert end - start <= max_descs and (end - start == 1 or sum(lengths[start:end]) <= max_bytes)
