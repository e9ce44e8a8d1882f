"""asynckv's side of the reference workload (the cases of SGLang's NIXL connector's own published
run): a prefill process and a decode process on this machine, DRAM, UCX over loopback, 32 layers
MHA = 64 buffers of 32 KiB pages (2 MiB per page); 8 rooms in flight unless noted. Decode latency:
init() to Success. Pages are not filled or verified (the demo does that). ``bench_sglang`` runs
these cases beside SGLang's own connector, in the same run.
"""

from __future__ import annotations

import asyncio
import os
import resource

import numpy as np

from asynckv.demo import DemoSpec

from ._pairs import decode_against_prefill_process, receive_plan

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


def measure_case(requests: int, pages: int, inflight: int, scattered: bool, scale: int) -> dict[str, float]:
    """``run_case`` in its own event loop, with the prefill process's CPU seconds of this case alone."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    row = asyncio.run(run_case(requests, pages, inflight, scattered, scale))
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    row.pop("cpu_prefill_s_total")
    row["cpu_prefill_s"] = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    spec = DemoSpec(layers=32 // scale)
    row["gb"] = requests * pages * spec.entries * spec.item_bytes / 1e9
    return row
