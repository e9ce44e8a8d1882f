"""The reference connector's published workload (SGLang's NIXL connector measured on this kind of
machine), run by asynckv in the same way: a prefill process and a decode process on this machine, DRAM,
UCX over loopback, 32 layers MHA = 64 buffers of 32 KiB pages (2 MiB per page), 10 aux
rows; 8 rooms in flight unless noted. Decode latency: init() to Success.

The reference's numbers come from its own published run (same kind of machine, not this run; a
same-run comparison is the performance issue's work); asynckv's are measured here. Pages are not
filled or verified (the demo does that).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import resource
import sys

import numpy as np

from asynckv.demo import DemoSpec

from ._common import write_result
from ._pairs import decode_against_prefill_process, receive_plan

SEED = {  # seed-performance.md: GB/s, req/s, decode p50, p99 (ms), CPU s decode / prefill
    "64 x 32 pages, contiguous": (2.24, 33, 228, 385, 1.55, 2.16),
    "64 x 32 pages, scattered": (3.20, 48, 152, 268, 0.60, 2.04),
    "400 x 1 page, 32 in flight": (0.37, 175, 176, 247, 2.04, 2.46),
    "16 x 256 pages": (2.75, 5.1, 1515, 1600, 3.09, 3.09),
}
CASES = [("64 x 32 pages, contiguous", 64, 32, 8, False), ("64 x 32 pages, scattered", 64, 32, 8, True),
         ("400 x 1 page, 32 in flight", 400, 1, 32, False), ("16 x 256 pages", 16, 256, 8, False)]


async def run_case(requests: int, pages: int, inflight: int, scattered: bool, scale: int) -> dict[str, float]:
    spec = DemoSpec(requests=requests, min_pages=pages, max_pages=pages, chunk_pages=pages, inflight=inflight,
                    fill=False, seed=requests * 1000 + pages, layers=32 // scale)
    async with decode_against_prefill_process(spec) as (d, spec, pool):
        rng = np.random.default_rng(1)
        c0 = os.times()
        latencies, elapsed = await receive_plan(d, spec, lambda k: rng.permutation(spec.pool_pages)[:pages]
                                                if scattered else np.arange(pages) + k * pages)
        c1 = os.times()
    child = resource.getrusage(resource.RUSAGE_CHILDREN)
    lat = np.asarray(latencies) * 1e3
    nbytes = requests * pages * pool.page_bytes
    return {"gbps": nbytes / elapsed / 1e9, "rps": requests / elapsed, "p50_ms": float(np.percentile(lat, 50)),
            "p99_ms": float(np.percentile(lat, 99)), "cpu_decode_s": c1.user + c1.system - c0.user - c0.system,
            "cpu_prefill_s_total": child.ru_utime + child.ru_stime}


def main(argv: list[str] | None = None, out_dir: pathlib.Path | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--scale", type=int, default=1, help="divide the layer count (smoke runs)")
    parser.add_argument("--cases", type=int, default=len(CASES))
    args = parser.parse_args(argv)
    print("The reference connector's workload, asynckv vs its published numbers:")
    rows = []
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    prev_child = before.ru_utime + before.ru_stime  # children of earlier benchmarks are not ours
    for name, requests, pages, inflight, scattered in CASES[:args.cases]:
        row = asyncio.run(run_case(requests, pages, inflight, scattered, args.scale))
        row["cpu_prefill_s"] = row.pop("cpu_prefill_s_total") - prev_child
        prev_child += row["cpu_prefill_s"]
        seed = SEED[name]
        rows.append({"workload": name, **row, "seed_gbps": seed[0], "seed_rps": seed[1], "seed_p50_ms": seed[2],
                     "seed_p99_ms": seed[3], "seed_cpu_decode_s": seed[4], "seed_cpu_prefill_s": seed[5],
                     "gbps_ratio": row["gbps"] / seed[0], "p50_ratio": seed[2] / row["p50_ms"]})
        print(f"  {name:28s}: {row['gbps']:5.2f} GB/s ({row['gbps'] / seed[0]:4.1f}x seed), {row['rps']:7.1f} req/s, "
              f"p50 {row['p50_ms']:7.1f} ms p99 {row['p99_ms']:7.1f} ms (seed {seed[2]}/{seed[3]}), CPU s decode "
              f"{row['cpu_decode_s']:.2f} prefill {row['cpu_prefill_s']:.2f} (seed {seed[4]}/{seed[5]})", flush=True)
    result = {"question": "asynckv on the reference connector's own workload", "rows": rows}
    write_result("seed_workload", result, out_dir)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
