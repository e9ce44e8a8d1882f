"""Q4 descriptor kernels: build time for MHA (K and V per layer) and MLA (one buffer per
layer) at 1k, 16k and 128k pages and 64 layers, contiguous and fragmented, against a
pure-Python builder (one tuple per page per entry, the reference connector's approach);
descriptors per request after coalescing; and the size above which offloading the math to
a worker thread beats building inline on the event loop.

The Python builder is timed on one layer's entries and scaled by the entry count (it is
linear); the numpy kernels are timed on the full request.
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import sys
import time

import numpy as np

from asynckv.config import Config
from asynckv.kernels import _reference as ref
from asynckv.kernels import kv_page_descriptors, prepped_indices

from ._common import best_of, write_result

LAYERS, ITEM = 64, 32 * 1024


def build_case(entries: int, pages: int, fragmented: bool) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(pages)
    sp = (np.arange(entries, dtype=np.uint64) << np.uint64(34)) + np.uint64(1 << 40)
    dp = (np.arange(entries, dtype=np.uint64) << np.uint64(34)) + np.uint64(1 << 46)
    items = np.full(entries, ITEM, dtype=np.uint64)
    if fragmented:
        src, dst = rng.permutation(2 * pages)[:pages], rng.permutation(2 * pages)[:pages]
    else:
        src, dst = np.arange(pages), np.arange(pages) + 7
    return sp, dp, items, src.astype(np.int64), dst.astype(np.int64)


def thread_hop_s() -> float:
    """Median cost of handing a trivial call to a worker thread and getting it back."""
    async def hops() -> float:
        samples = []
        for _ in range(200):
            t = time.perf_counter()
            await asyncio.to_thread(lambda: None)
            samples.append(time.perf_counter() - t)
        return float(np.median(samples))
    return asyncio.run(hops())


def main(argv: list[str] | None = None, out_dir: pathlib.Path | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pages", type=int, nargs="*", default=[1024, 16384, 131072])
    parser.add_argument("--layers", type=int, default=LAYERS)
    args = parser.parse_args(argv)
    print(f"Q4 descriptor kernels, {args.layers} layers:")
    rows = []
    for model, entries in (("MHA", 2 * args.layers), ("MLA", args.layers)):
        for pages in args.pages:
            for fragmented in (False, True):
                sp, dp, items, src, dst = build_case(entries, pages, fragmented)
                t_desc = best_of(lambda: kv_page_descriptors(sp, dp, items, items, src, dst))  # noqa: B023
                t_idx = best_of(lambda: prepped_indices(src, 2 * pages + 8, entries))  # noqa: B023
                descs = len(kv_page_descriptors(sp, dp, items, items, src, dst)[0])
                lists = (sp[:2].tolist(), dp[:2].tolist(), items[:2].tolist(), src.tolist(), dst.tolist())
                t_py = best_of(lambda: ref.per_page_descriptors(*lists), repeat=1) * entries / 2  # noqa: B023
                layout = "fragmented" if fragmented else "contiguous"
                rows.append({"model": model, "entries": entries, "pages": pages, "layout": layout,
                             "coalesced_ms": t_desc * 1e3, "prepped_indices_ms": t_idx * 1e3,
                             "python_ms": t_py * 1e3, "speedup_coalesced": t_py / t_desc,
                             "speedup_prepped": t_py / t_idx, "descriptors": descs,
                             "python_descriptors": entries * pages})
                print(f"  {model} {pages:>6} pages {layout:10s}: coalesced {t_desc * 1e3:8.2f} ms ({descs:>8} descs), "
                      f"prepped indices {t_idx * 1e3:7.2f} ms, Python {t_py * 1e3:9.1f} ms "
                      f"({entries * pages} descs) -> {t_py / t_desc:6.1f}x / {t_py / t_idx:6.1f}x", flush=True)
    hop = thread_hop_s()
    # Offloading wins once the inline build would block the loop longer than a thread round trip.
    sizes = [256, 1024, 4096, 16384, 65536, 262144]
    per_size = []
    for rows_n in sizes:
        entries = 128
        pages = max(1, rows_n // entries)
        sp, dp, items, src, dst = build_case(entries, pages, True)
        per_size.append((entries * pages, best_of(lambda: prepped_indices(src, 2 * pages + 8, entries)),  # noqa: B023
                         best_of(lambda: kv_page_descriptors(sp, dp, items, items, src, dst))))  # noqa: B023
    crossover = next((n for n, t_idx, _ in per_size if t_idx > hop), None)
    crossover_desc = next((n for n, _, t_d in per_size if t_d > hop), None)
    print(f"  thread round trip {hop * 1e6:.0f} us: offloading beats inline from ~{crossover} rows (prepared "
          f"indices) / ~{crossover_desc} rows (coalesced descriptors); Config.offload_min_descs = "
          f"{Config().offload_min_descs}", flush=True)
    result = {"question": __doc__.strip().splitlines()[0], "rows": rows, "thread_hop_us": hop * 1e6,
              "offload_crossover_rows_prepped": crossover, "offload_crossover_rows_descriptors": crossover_desc,
              "inline_vs_offload": [{"rows": n, "prepped_ms": a * 1e3, "descriptors_ms": b * 1e3}
                                    for n, a, b in per_size]}
    write_result("kernels", result, out_dir)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
