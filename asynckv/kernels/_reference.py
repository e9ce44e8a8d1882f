"""Slow, obviously correct twins of the kernels, for tests and benchmarks only."""

from __future__ import annotations

from collections.abc import Sequence


def coalesce_runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if runs:
            s0, d0, n = runs[-1]
            if s == s0 + n and d == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((s, d, 1))
    return runs


def kv_page_descriptors(
    src_ptrs: Sequence[int], dst_ptrs: Sequence[int], src_items: Sequence[int],
    dst_items: Sequence[int], src_pages: Sequence[int], dst_pages: Sequence[int],
    src_dev: int = 0, dst_dev: int = 0,
) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    src: list[tuple[int, int, int]] = []
    dst: list[tuple[int, int, int]] = []
    runs = coalesce_runs(src_pages, dst_pages)
    for e in range(len(src_ptrs)):
        for s0, d0, n in runs:
            src.append((src_ptrs[e] + s0 * src_items[e], n * src_items[e], src_dev))
            dst.append((dst_ptrs[e] + d0 * dst_items[e], n * src_items[e], dst_dev))
    return src, dst


def per_page_descriptors(
    src_ptrs: Sequence[int], dst_ptrs: Sequence[int], items: Sequence[int],
    src_pages: Sequence[int], dst_pages: Sequence[int],
) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    """One descriptor per page per entry, built the way the reference connector does."""
    src: list[tuple[int, int, int]] = []
    dst: list[tuple[int, int, int]] = []
    for e in range(len(src_ptrs)):
        for s, d in zip(src_pages, dst_pages, strict=True):
            src.append((src_ptrs[e] + s * items[e], items[e], 0))
            dst.append((dst_ptrs[e] + d * items[e], items[e], 0))
    return src, dst


def prepped_indices(pages: Sequence[int], num_slots: int, num_entries: int) -> list[int]:
    return [e * num_slots + p for e in range(num_entries) for p in pages]


def head_slice_descriptors(
    src_ptrs: Sequence[int], dst_ptrs: Sequence[int], src_items: Sequence[int], dst_items: Sequence[int],
    page_size: int, src_pages: Sequence[int], dst_pages: Sequence[int], src_offs: Sequence[int],
    dst_offs: Sequence[int], nbytes: Sequence[int],
) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    """Per-token loop, the way the reference connector builds head slices (unmerged)."""
    src: list[tuple[int, int, int]] = []
    dst: list[tuple[int, int, int]] = []
    for e in range(len(src_ptrs)):
        srow, drow = src_items[e] // page_size, dst_items[e] // page_size
        for ps, pd in zip(src_pages, dst_pages, strict=True):
            for t in range(page_size):
                src.append((src_ptrs[e] + ps * src_items[e] + t * srow + src_offs[e], nbytes[e], 0))
                dst.append((dst_ptrs[e] + pd * dst_items[e] + t * drow + dst_offs[e], nbytes[e], 0))
    return src, dst


def merge_contiguous(
    src: list[tuple[int, int, int]], dst: list[tuple[int, int, int]],
) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    out_s: list[tuple[int, int, int]] = []
    out_d: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if out_s and out_s[-1][0] + out_s[-1][1] == s[0] and out_d[-1][0] + out_d[-1][1] == d[0] \
                and out_s[-1][2] == s[2] and out_d[-1][2] == d[2]:
            out_s[-1] = (out_s[-1][0], out_s[-1][1] + s[1], s[2])
            out_d[-1] = (out_d[-1][0], out_d[-1][1] + d[1], d[2])
        else:
            out_s.append(s)
            out_d.append(d)
    return out_s, out_d


def split_long(src: Sequence[tuple[int, int, int]], dst: Sequence[tuple[int, int, int]],
               max_len: int) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    out_s, out_d = [], []
    for (sa, n, sdev), (da, _, ddev) in zip(src, dst, strict=True):
        off = 0
        while off < n:
            k = min(max_len, n - off)
            out_s.append((sa + off, k, sdev))
            out_d.append((da + off, k, ddev))
            off += k
    return out_s, out_d


def handle_bounds(lengths: Sequence[int], max_descs: int, max_bytes: int) -> list[tuple[int, int]]:
    bounds, start, total = [], 0, 0
    for i, n in enumerate(lengths):
        if i > start and (i - start >= max_descs or total + n > max_bytes):
            bounds.append((start, i))
            start, total = i, 0
        total += n
    if len(lengths):
        bounds.append((start, len(lengths)))
    return bounds
