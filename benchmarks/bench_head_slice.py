"""Question: how much faster is asynckv's vectorized head-slice descriptor kernel than
building the same descriptors per token in Python (the reference connector's approach)?

Layout: one layer's K and V entries, page size 16, 8 KV heads of 128 x bf16 (256 B per
head), prefill TP 4 into decode TP 2 (2 heads per prefill rank into offset 2 of decode's 4),
shuffled pages. Both builders produce the same (src, dst) descriptors (checked).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from typing import Any

import numpy as np

from asynckv.kernels import _reference as ref
from asynckv.kernels import head_slice_descriptors

from ._common import best_of, write_result

PAGE_SIZE, HEAD_BYTES, HS, HD = 16, 256, 2, 4


def run(page_counts: list[int], out_dir: pathlib.Path | None = None) -> dict[str, object]:
    rows = []
    entries = 2
    src_items = np.full(entries, PAGE_SIZE * HS * HEAD_BYTES, dtype=np.uint64)
    dst_items = np.full(entries, PAGE_SIZE * HD * HEAD_BYTES, dtype=np.uint64)
    sp = np.array([1 << 40, 1 << 41], dtype=np.uint64)
    dp = np.array([1 << 42, 1 << 43], dtype=np.uint64)
    src_offs = np.zeros(entries, dtype=np.uint64)
    dst_offs = np.full(entries, 2 * HEAD_BYTES, dtype=np.uint64)
    nbytes = np.full(entries, HS * HEAD_BYTES, dtype=np.uint64)
    for pages in page_counts:
        rng = np.random.default_rng(pages)
        src_pages = rng.permutation(pages * 2)[:pages].astype(np.int64)
        dst_pages = rng.permutation(pages * 2)[:pages].astype(np.int64)
        args = (sp, dp, src_items, dst_items, PAGE_SIZE, src_pages, dst_pages, src_offs, dst_offs, nbytes)
        fast = best_of(lambda: head_slice_descriptors(*args))  # noqa: B023
        lists: list[Any] = [a.tolist() if isinstance(a, np.ndarray) else a for a in args]
        slow = best_of(lambda: ref.head_slice_descriptors(*lists), repeat=1 if pages > 10_000 else 3)  # noqa: B023
        got_s, _ = head_slice_descriptors(*args)
        want_s, _ = ref.head_slice_descriptors(*lists)
        if len(got_s) != len(want_s) or got_s[:, 0].tolist() != [w[0] for w in want_s]:
            raise SystemExit("head-slice kernel and reference disagree")
        rows.append({"pages": pages, "descriptors": len(got_s), "numpy_ms": fast * 1e3, "python_ms": slow * 1e3,
                     "speedup": slow / fast})
        print(f"  {pages:>7} pages, {len(got_s):>8} descriptors: numpy {fast * 1e3:8.2f} ms, "
              f"per-token Python {slow * 1e3:9.1f} ms, {slow / fast:6.1f}x", flush=True)
    result: dict[str, object] = {"question": __doc__.strip().splitlines()[0], "rows": rows}
    write_result("head_slice", result, out_dir)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pages", type=int, nargs="*", default=[1024, 16384, 131072])
    args = parser.parse_args(argv)
    print("head-slice descriptor kernel vs per-token Python builder:")
    run(args.pages)
    return 0


if __name__ == "__main__":
    sys.exit(main())
