"""asynckv's side of the reference workload (the cases of SGLang's NIXL connector's own published
run): a prefill process and a decode process on this machine, DRAM, UCX over loopback, 32 layers
MHA = 64 buffers of 32 KiB pages (2 MiB per page); 8 rooms in flight unless noted. Decode latency:
init() to Success, after one warm-up room (``WARMUP``). Pages are not filled or verified (the demo
does that). ``bench_sglang`` runs these cases beside SGLang's own connector, in the same run.
"""

from __future__ import annotations

import asyncio
import json
import os

import numpy as np

from asynckv.demo import DemoSpec

from ._pairs import decode_against_prefill_process, receive_plan

WARMUP = 1
"""Rooms each side serves before its timing and CPU count start: the first contact (NIXL's
``add_remote_agent`` and UCX's wire-up, about 45 ms for asynckv on this VM; Q6 measures it) is not
steady-state serving. SGLang's side does the same (``tests/interop/sglang_peer.py``)."""

CASES = [("64 x 32 pages, contiguous", 64, 32, 8, False), ("64 x 32 pages, scattered", 64, 32, 8, True),
         ("400 x 1 page, 32 in flight", 400, 1, 32, False), ("16 x 256 pages", 16, 256, 8, False)]


def decode_pages(rng: np.random.Generator, inflight: int, pages: int, slot: int, scattered: bool) -> np.ndarray:
    """The decode pages of a request in ``slot``: the slot's own run of the pool, or ``pages`` drawn
    from the whole pool (``inflight * pages``) when scattered. Every side of the reference workload
    draws them here (asynckv's, SGLang's and the machine's limit)."""
    return rng.permutation(inflight * pages)[:pages] if scattered else np.arange(pages) + slot * pages


async def run_case(requests: int, pages: int, inflight: int, scattered: bool, scale: int) -> dict[str, float]:
    spec = DemoSpec(requests=requests + WARMUP, min_pages=pages, max_pages=pages, chunk_pages=pages,
                    inflight=inflight, fill=False, seed=requests * 1000 + pages, layers=32 // scale, warmup=WARMUP)
    printed: list[str] = []
    async with decode_against_prefill_process(spec, printed) as (d, spec, pool):
        rng = np.random.default_rng(1)
        started: list[os.times_result] = []  # (when the warm-up is done)
        latencies, elapsed = await receive_plan(d, spec, lambda k: decode_pages(rng, inflight, pages, k, scattered),
                                                started=lambda: started.append(os.times()))
        c0, c1 = started[0], os.times()
    # Both sides' CPU while serving, as the SGLang peer counts it: prefill's from its first
    # destination after the warm-up to its last room, decode's from the warm-up done to the last Success.
    # (The whole prefill process also pays start-up: imports, the pool's page faults, NIXL set-up.)
    serving = next(ev for ev in (json.loads(line) for line in printed if line.startswith("{"))
                   if ev.get("event") == "cpu")
    lat = np.asarray(latencies) * 1e3
    nbytes = requests * pages * pool.page_bytes
    return {"gbps": nbytes / elapsed / 1e9, "rps": requests / elapsed, "p50_ms": float(np.percentile(lat, 50)),
            "p99_ms": float(np.percentile(lat, 99)), "cpu_decode_s": c1.user + c1.system - c0.user - c0.system,
            "cpu_prefill_s": serving["serving_s"]}


def measure_case(requests: int, pages: int, inflight: int, scattered: bool, scale: int) -> dict[str, float]:
    """``run_case`` in its own event loop."""
    row = asyncio.run(run_case(requests, pages, inflight, scattered, scale))
    spec = DemoSpec(layers=32 // scale)
    row["gb"] = requests * pages * spec.entries * spec.item_bytes / 1e9
    return row
