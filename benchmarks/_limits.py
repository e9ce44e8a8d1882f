"""The machine's limit for one case of the reference workload, measured in the same rounds as the
two connectors: the same pages (64 buffers of 32 KiB items, the prefill's pages in contiguous slots,
the decode's contiguous or scattered, drawn as asynckv's side draws them: the same generator and
seed, alike in distribution rather than the very same sets), moved

- by raw NIXL in its fastest configuration on this kind of host: one agent posting back to back,
  and two agents posting from two threads (on one host the posting thread does the CMA copy, and
  NIXL's own thread-pool engine gave no gain here: every agent call would be serialised); prepared
  dlists, no control message, one notification per request (a request is done when the target has
  seen it: the least a connector must tell the decode), both agents in one process;
- by ``np.copyto`` (page by page when scattered), on one thread and on two (the memory ceiling of 2 cores).

CPU seconds per GB are this process's CPU time (`time.process_time`) over the timed region (both NIXL sides
live here, as asynckv's and SGLang's figures count both their processes; the two-thread figure
includes the target's polling thread). On one host the copy is charged to the writer's CPU, so raw
NIXL's one agent and ``np.copyto`` show what copying these bytes costs at the least.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np

from asynckv.demo import DemoSpec
from asynckv.testing import KVPool

from ._pairs import RawNixl
from .bench_seed_workload import decode_pages
from .bench_throughput import copy_pages


def plan(requests: int, pages: int, inflight: int, scattered: bool) -> list[tuple[np.ndarray, np.ndarray]]:
    """(prefill pages, decode pages) per request: slot ``j % inflight`` of each pool, the decode's
    drawn as ``bench_seed_workload.run_case`` draws them (the same generator and seed)."""
    rng = np.random.default_rng(1)
    return [(np.arange(pages) + j % inflight * pages, decode_pages(rng, inflight, pages, j % inflight, scattered))
            for j in range(requests)]


def _timed(fn: Callable[[], object]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of ``fn()``."""
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def _two_threads(work: Callable[[list[tuple[np.ndarray, np.ndarray]]], object],
                 sets: list[tuple[np.ndarray, np.ndarray]]) -> None:
    threads = [threading.Thread(target=work, args=(sets[i::2],)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def limit_case(requests: int, pages: int, inflight: int, scattered: bool, scale: int) -> dict[str, float]:
    """One measurement of the case's limits (see the module docstring)."""
    spec = DemoSpec(layers=32 // scale)
    pool_pages = inflight * pages
    src, dst = KVPool(spec.entries, pool_pages, spec.item_bytes, aux_rows=1), \
        KVPool(spec.entries, pool_pages, spec.item_bytes, aux_rows=1)
    src.kv.fill(1)
    dst.kv.fill(0)  # both pools faulted in before timing, as the connectors' are
    sets = plan(requests, pages, inflight, scattered)
    gb = requests * pages * spec.entries * spec.item_bytes / 1e9
    raw = RawNixl(src, dst, initiators=2)  # warms both writers up on first contact
    try:
        one = _timed(lambda: raw.write_serial(sets, notify=True))
        two = _timed(lambda: raw.write_parallel(sets, notify=True))
    finally:
        raw.close()

    def copy(part: list[tuple[np.ndarray, np.ndarray]]) -> None:
        for s, d in part:
            copy_pages(src.kv, dst.kv, s, d, not scattered)

    cp1 = _timed(lambda: copy(sets))
    cp2 = _timed(lambda: _two_threads(copy, sets))
    fastest = one if one[0] <= two[0] else two
    return {"gb": gb, "raw_one_agent_gbps": gb / one[0], "raw_two_agents_gbps": gb / two[0],
            "raw_gbps": gb / fastest[0], "raw_cpu_s_per_gb": fastest[1] / gb,
            "raw_one_agent_cpu_s_per_gb": one[1] / gb, "copyto_gbps": gb / cp1[0],
            "copyto_cpu_s_per_gb": cp1[1] / gb, "copyto_two_threads_gbps": gb / cp2[0]}
