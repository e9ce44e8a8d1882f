"""Q1 bulk throughput: GB/s of asynckv end to end (decode's wait() resolved) against raw
NIXL moving the same pages with a minimal loop, and against np.copyto of the same pages (page by
page when they are scattered),
for requests from 64 KiB to 1 GiB, contiguous and with scattered pages.

Layout: one layer's K and V entries, 32 KiB pages (64 KiB per page index). asynckv and
raw NIXL run in the same process over the same kind of buffers; bytes are verified
outside the timed region. Measured one request at a time (latency-bound: every room pays
its control round trips; raw NIXL posts it from one agent, as asynckv posts one request from
one write lane) and with up to 4 requests in flight (throughput: a window over 16 requests, a new
one starting as one finishes), where raw NIXL is the faster
of one agent posting back to back and two agents posting from two threads (asynckv's
prefill writes through two lanes by default). "From send()" also times each request from
prefill's first send() (its destination already known, as when it arrives while prefill computes)
to decode's wait() resolving: what a serving stack waits once the KV is ready; raw NIXL's time
still includes no message to the decode. The pipelined trials also count the process's CPU time
(every thread, both sides and raw NIXL's agents are in this one process): its CPU seconds per GB,
and the GB/s that CPU per GB would allow with every core busy and nothing else to pay (the
CPU-bound limit, against raw NIXL's fastest). Both managers run on uvloop, the loop asynckv's own
processes install (the demo, the reference workload's processes); ``--loop asyncio`` measures the
standard loop, whose rounds cost more CPU per room.
Target: asynckv at least 0.9x raw NIXL from 16 MiB up.
"""

from __future__ import annotations

import argparse
import itertools
import os
import pathlib
import statistics
import sys
import time

import numpy as np

from asynckv.demo import bounded
from asynckv.testing import fill_pages, verify_pages
from asynckv.transport import steer as steer_mod

from ._common import write_result
from ._pairs import RawNixl, pair, room, run

ITEM = 32 * 1024
PAGE_BYTES = 2 * ITEM
WINDOW_ROUNDS = 4
"""Requests per pipelined trial, in units of the requests in flight: the window refills as rooms
finish (16 rooms with 4 in flight), rather than 4 starting together and all awaited, which made
every trial pay its rooms' control messages with no copy to overlap them."""
CORES = len(os.sched_getaffinity(0))
"""The cores this process may run on: the CPU-bound limit assumes all of them busy."""


def copy_pages(a: np.ndarray, b: np.ndarray, src: np.ndarray, dst: np.ndarray, contiguous: bool) -> None:
    """The memory ceiling for the same pages: one ``np.copyto`` of the run when contiguous, else one
    per page (every entry of page ``src[i]`` into page ``dst[i]``), as a copy engine would do them."""
    if contiguous:
        np.copyto(b[:, dst[0]:dst[0] + len(dst)], a[:, src[0]:src[0] + len(src)])
        return
    for s, d in zip(src.tolist(), dst.tolist(), strict=True):
        np.copyto(b[:, d], a[:, s])


async def measure(sizes: list[int], reps: int) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    max_pages = max(sizes) // PAGE_BYTES
    async with pair(2, max_pages, ITEM) as (p, d):
        ppool, dpool = p._bench_pools  # type: ignore[attr-defined]
        raw = RawNixl(ppool, dpool, initiators=2)
        rng = np.random.default_rng(0)
        await room(p, d, 10**9, np.arange(1), np.arange(1))  # first contact happens here, not in the timings
        room_id = 1
        pipelined_ids = itertools.count(10**8)
        try:
            for size in sizes:
                n = size // PAGE_BYTES
                for layout in ("contiguous", "scattered"):
                    src = np.arange(n) if layout == "contiguous" else rng.permutation(max_pages)[:n]
                    dst = np.arange(n) if layout == "contiguous" else rng.permutation(max_pages)[:n]
                    fill_pages(ppool, room_id, src)
                    t_kv, t_raw, t_copy = [], [], []
                    t_send: list[float] = []
                    for _ in range(reps):
                        t_raw.append(raw.write(src, dst))
                        t_kv.append(await room(p, d, room_id, src, dst, from_send=t_send))
                        if verify_pages(dpool, room_id, dst):
                            raise RuntimeError("asynckv delivered wrong bytes")
                        t = time.perf_counter()
                        copy_pages(ppool.kv, dpool.kv, src, dst, layout == "contiguous")
                        t_copy.append(time.perf_counter() - t)
                        room_id += 1
                        fill_pages(ppool, room_id, src)
                    kv, kv_send, rw, cp = (size / statistics.median(t) / 1e9 for t in (t_kv, t_send, t_raw, t_copy))
                    # Pipelined: k requests in flight (as a serving stack has) over WINDOW_ROUNDS * k
                    # requests, a new one starting as one finishes, so one room's control messages
                    # overlap another's copy. Raw NIXL posts the same writes back to back.
                    k = max(1, min(4, max_pages // n))
                    kv_runs, one_runs, two_runs, kv_cpu, two_cpu, kv_busy = [], [], [], [], [], []
                    for _trial in range(reps):  # interleaved trials, medians (one shot each was noise)
                        sets = [(rng.permutation(max_pages)[:n], rng.permutation(max_pages)[:n])
                                if layout == "scattered" else (np.arange(n) + i % k * n, np.arange(n) + i % k * n)
                                for i in range(WINDOW_ROUNDS * k)]
                        jobs = [(next(pipelined_ids), sv, dv) for sv, dv in sets]
                        total = len(sets) * size
                        t, c = time.perf_counter(), time.process_time()
                        await bounded(jobs, k, lambda job: room(p, d, *job))
                        wall, cpu = time.perf_counter() - t, time.process_time() - c
                        kv_runs.append(total / wall / 1e9)
                        kv_cpu.append(cpu / (total / 1e9))
                        kv_busy.append(cpu / wall / CORES)
                        t = time.perf_counter()
                        for sv, dv in sets:
                            raw.write(sv, dv)
                        one_runs.append(total / (time.perf_counter() - t) / 1e9)
                        # Two agents on two threads: with one request in flight, each request's pages
                        # split between them (as asynckv splits a large write over its two lanes).
                        c = time.process_time()
                        two = raw.write_parallel(sets) if k > 1 or n < 2 else sum(
                            raw.write_parallel([(sv[:n // 2], dv[:n // 2]), (sv[n // 2:], dv[n // 2:])])
                            for sv, dv in sets)
                        two_cpu.append((time.process_time() - c) / (total / 1e9))
                        two_runs.append(total / two / 1e9)
                    kv_pipe, rw_one, rw_two, kv_cpu_gb, two_cpu_gb, busy = (
                        statistics.median(r) for r in (kv_runs, one_runs, two_runs, kv_cpu, two_cpu, kv_busy))
                    rw_pipe = max(rw_one, rw_two)  # raw NIXL's fastest configuration in this run
                    cpu_bound = CORES / kv_cpu_gb  # GB/s with every core busy at asynckv's CPU per GB
                    rows.append({"bytes": size, "layout": layout, "asynckv_gbps": kv, "raw_nixl_gbps": rw,
                                 "asynckv_from_send_gbps": kv_send, "from_send_ratio_vs_raw": kv_send / rw,
                                 "copyto_gbps": cp, "ratio_vs_raw": kv / rw, "inflight": k,
                                 "asynckv_pipelined_gbps": kv_pipe, "raw_pipelined_gbps": rw_pipe,
                                 "raw_pipelined_one_agent_gbps": rw_one, "raw_pipelined_two_agents_gbps": rw_two,
                                 "pipelined_ratio": kv_pipe / rw_pipe, "asynckv_pipelined_min_gbps": min(kv_runs),
                                 "asynckv_pipelined_max_gbps": max(kv_runs), "pipelined_trials": reps,
                                 "cores": CORES, "asynckv_pipelined_cpu_s_per_gb": kv_cpu_gb,
                                 "asynckv_pipelined_cores_busy": busy,
                                 "raw_two_agents_cpu_s_per_gb": two_cpu_gb,
                                 "asynckv_cpu_bound_gbps": cpu_bound, "cpu_bound_ratio": cpu_bound / rw_pipe})
                    print(f"  {size / 2**20:8.2f} MiB {layout:10s}: one request: asynckv {kv:6.2f} GB/s, raw NIXL "
                          f"{rw:6.2f}, np.copyto {cp:6.2f} -> {kv / rw:.2f}x raw ({kv_send / rw:.2f}x from send()); "
                          f"{k} in flight: asynckv "
                          f"{kv_pipe:6.2f}, raw one agent {rw_one:6.2f}, two agents on two threads {rw_two:6.2f} "
                          f"-> {kv_pipe / rw_pipe:.2f}x the faster; asynckv kept {busy:.0%} of {CORES} cores busy at "
                          f"{kv_cpu_gb:.3f} CPU s/GB (raw two agents {two_cpu_gb:.3f}): all of them would allow "
                          f"{cpu_bound:.2f} GB/s, {cpu_bound / rw_pipe:.2f}x the faster", flush=True)
        finally:
            raw.close()
    return rows


def main(argv: list[str] | None = None, out_dir: pathlib.Path | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes-mib", type=float, nargs="*", default=[0.0625, 1, 16, 64, 256, 1024])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop")
    parser.add_argument("--steer", choices=["auto", "off"], default="auto",
                        help="off: a relayed part's lane may be woken onto its carrier's CPU "
                             "(asynckv/transport/steer.py; results then go to throughput_unsteered.json)")
    args = parser.parse_args(argv)
    sizes = [int(s * 2**20) // PAGE_BYTES * PAGE_BYTES or PAGE_BYTES for s in args.sizes_mib]
    print(f"Q1 bulk throughput (asynckv vs raw NIXL vs np.copyto), {args.loop}"
          f"{', steering off' if args.steer == 'off' else ''}:")
    steering = steer_mod.steering_available
    if args.steer == "off":
        steer_mod.steering_available = lambda: False
    try:
        rows = run(measure(sizes, args.reps), args.loop)
    finally:
        steer_mod.steering_available = steering
    big = [r for r in rows if int(r["bytes"]) >= 16 * 2**20]
    result = {"question": __doc__.strip().splitlines()[0], "rows": rows, "loop": args.loop, "steer": args.steer,
              "min_ratio_from_16MiB": min((float(r["ratio_vs_raw"]) for r in big), default=None),
              "min_pipelined_ratio_from_16MiB": min((float(r["pipelined_ratio"]) for r in big),
                                                    default=None)}
    write_result("throughput" if args.steer == "auto" else "throughput_unsteered", result, out_dir)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
