"""Heterogeneous TP: GB/s of prefill TP1 -> decode TP2 (and TP2 -> TP1) against TP1 -> TP1 on the
same bytes, in the same run (target: at least 0.8x).

32 layers MHA (64 buffers), 8 KV heads of 128 x 2 bytes, 16-token pages: 32 KiB per page and
buffer at TP1. 16 requests of 32 pages, 4 in flight, every rank a manager in this process (one
event loop; each prefill rank has its engine threads). TP1 -> TP2: each decode rank takes 4 of
the prefill rank's 8 heads, its whole token row, so the prefill gathers the slices into its
staging area and sends one descriptor per page; the same run with staging off sends one per
token. TP2 -> TP1: each prefill rank's 4 heads go into half of every decode token row: with
decode staging (``decode_staging_bytes``) each rank writes its whole pages into the decode's
staging slots, one descriptor per page, and the decode copies them into place; without it, one
descriptor per token. Rounds interleave the cases; medians and min-max spread. CPU: this
process's, per GB moved.

The machine's limit for a staged write, measured in the same rounds: staging adds a copy of
every byte (the prefill's gather, or the decode's scatter) to the write, and here both are CPU
copies on the same two cores (CMA copies inside the posting thread). Equal TP already keeps both
cores copying, so a staged write can at best take the equal-TP time plus the gather's: ceiling =
1 / (1/E + 1/G), with E the equal-TP GB/s and G the GB/s of gathering the same slices on two
threads (as the rank's two build threads do; the scatter is the same strided copy the other way).
On a GPU host the gather runs on the GPU and the NIC copies, so the ceiling there is equal TP
itself.

``--mamba``: a hybrid model, each layer also a mamba state entry (32 heads of 64 x 64 x 2 bytes at
TP1, split by heads: 256 KiB a request and layer, 8 MiB a request beside its 64 MiB of KV), sent
with the last chunk; equal TP and TP2 -> TP1 only (results/hetero_tp_mamba.json).

``--mixed``: a decode fed by prefills at two TPs, the other one registering and serving a room
first: TP4 -> TP1 beside a TP2 prefill, and TP2 -> TP1 beside a TP4 one (until 2026-12-07 the
first TP shaped the slots to its own slice and the second went per token: TP2 after TP4 did not
fit), each against per token (results/hetero_tp_mixed.json).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import pathlib
import statistics
import sys
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from asynckv import BootstrapServer, Config, KVManager, KVPoll, Mode
from asynckv.layout import KVArgs

from ._common import write_result

HEADS, HEAD_DIM, PAGE_SIZE = 8, 128, 16
DECODE_STAGING = 256 * 2**20
CASES = [("TP1 -> TP1", 1, 1, {}), ("TP1 -> TP2, staged", 1, 2, {}),
         ("TP1 -> TP2, per token (staging off)", 1, 2, {"staging_bytes": 0}),
         ("TP2 -> TP1, staged on decode", 2, 1, {"decode_staging_bytes": DECODE_STAGING}),
         ("TP2 -> TP1, per token (decode staging off)", 2, 1, {"decode_staging_bytes": 0})]
MIXED = [("TP1 -> TP1", 1, 1, {}),
         ("TP4 -> TP1, staged beside a TP2 prefill that registered first", 4, 1,
          {"decode_staging_bytes": DECODE_STAGING, "shaper": 2}),
         ("TP2 -> TP1, staged beside a TP4 prefill that registered first", 2, 1,
          {"decode_staging_bytes": DECODE_STAGING, "shaper": 4}),
         ("TP4 -> TP1, per token (decode staging off)", 4, 1, {"decode_staging_bytes": 0}),
         ("TP2 -> TP1, per token (decode staging off)", 2, 1, {"decode_staging_bytes": 0})]


MAMBA_HEADS, MAMBA_ROW = 32, 64 * 64 * 2
"""The ``--mamba`` state: heads per layer at TP1, and bytes of one head's state."""


def _rank(layers: int, pages: int, tp_size: int, tp: int, mamba: int = 0) -> tuple[KVArgs, list[np.ndarray]]:
    """``mamba``: request slots of mamba state (0: none)."""
    heads = HEADS // tp_size
    kv = [np.ones((pages, PAGE_SIZE, heads, HEAD_DIM), dtype=np.uint16) for _ in range(2 * layers)]
    state: dict[str, Any] = {}
    if mamba:
        dim = MAMBA_HEADS // tp_size
        state = dict(state=[np.ones((mamba, 1, dim, MAMBA_ROW), dtype=np.uint8) for _ in range(layers)],
                     state_type="mamba", state_dim_per_tensor=[dim] * layers, state_outer=[1] * layers,
                     state_layer_ids=list(range(layers)))
    args = KVArgs.from_arrays(kv, page_size=PAGE_SIZE, aux=[np.zeros((8, 64), dtype=np.uint8)], engine_rank=tp,
                              tp_size=tp_size, kv_head_num=heads, total_kv_head_num=HEADS,
                              kv_layer_ids=[layer for _ in range(2) for layer in range(layers)], **state)
    return args, kv


@contextlib.asynccontextmanager
async def _cluster(layers: int, pages: int, tp_p: int, tp_d: int, mamba: int = 0, shaper: int = 0,
                   **config: Any) -> AsyncIterator[tuple[list[KVManager], list[KVManager], str]]:
    """``shaper``: the TP of a second prefill that serves the decode one room first (0: none)."""
    cfg = Config(host_bootstrap=False, **config)
    async with BootstrapServer("127.0.0.1", 0) as server, BootstrapServer("127.0.0.1", 0) as other, \
            contextlib.AsyncExitStack() as stack:
        prefill = [KVManager(Mode.PREFILL, _rank(layers, pages, tp_p, r, mamba)[0], bootstrap_addr=server.addr,
                             config=cfg) for r in range(tp_p)]
        first = [KVManager(Mode.PREFILL, _rank(layers, pages, shaper, r, mamba)[0], bootstrap_addr=other.addr,
                           config=cfg) for r in range(shaper)]
        decode = [KVManager(Mode.DECODE, _rank(layers, pages, tp_d, r, mamba)[0], config=cfg) for r in range(tp_d)]
        for m in prefill + first + decode:
            await stack.enter_async_context(m)
        if first:
            await _room(first, decode, other.addr, 20_000, np.arange(pages // 2))
        yield prefill, decode, server.addr


async def _room(prefill: list[KVManager], decode: list[KVManager], addr: str, room: int, pages: np.ndarray,
                state: np.ndarray | None = None) -> None:
    receivers = [d.receiver(addr, room) for d in decode]
    for r in receivers:
        await r.init(pages, room % 8, state)
    senders = [p.sender(room) for p in prefill]
    for s in senders:
        await s.wait_ready()
        s.init(len(pages), room % 8)
        await s.send(pages, state)
    for r in receivers:
        if await r.wait() != KVPoll.Success:
            raise RuntimeError(r.failure_reason)
    for s in senders:
        if await s.wait() != KVPoll.Success:
            raise RuntimeError(s.failure_reason)
        s.clear()
    for r in receivers:
        r.clear()


def gather_gbps(layers: int, requests: int, pages: int, inflight: int, threads: int = 2) -> float:
    """GB/s of gathering TP1 -> TP2's head slices (both decode ranks' halves, so every byte once)
    of ``requests`` x ``pages`` pages into a staging area as large as ``inflight`` requests, the
    requests' pages and staging runs taken in turn as the cases' are; entries split over ``threads``."""
    half = HEADS * HEAD_DIM // 2
    kv = [np.ones((inflight * pages, PAGE_SIZE, HEADS * HEAD_DIM), dtype=np.uint16) for _ in range(2 * layers)]
    area = np.ones((inflight, 2, 2 * layers, pages, PAGE_SIZE, half), dtype=np.uint16)

    def gather(k: int, entries: range) -> None:
        for e in entries:
            for r in (0, 1):
                np.copyto(area[k, r, e], kv[e][k * pages:(k + 1) * pages, :, r * half:(r + 1) * half])

    step = -(-len(kv) // threads)
    parts = [range(i, min(i + step, len(kv))) for i in range(0, len(kv), step)]
    with ThreadPoolExecutor(threads) as pool:
        t = time.perf_counter()
        for q in range(requests):
            list(pool.map(gather, [q % inflight] * len(parts), parts))
        elapsed = time.perf_counter() - t
    return requests * pages * len(kv) * PAGE_SIZE * HEADS * HEAD_DIM * 2 / elapsed / 1e9


async def run_case(tp_p: int, tp_d: int, config: dict[str, Any], layers: int, requests: int, pages: int,
                   inflight: int, mamba: bool = False) -> dict[str, float]:
    async with _cluster(layers, inflight * pages, tp_p, tp_d, inflight if mamba else 0, **config) as (
            prefill, decode, addr):
        gate = asyncio.Semaphore(inflight)
        free = list(range(inflight))

        def state(k: int) -> np.ndarray | None:
            return np.array([k]) if mamba else None
        # First contact and a first pass through the staging area (its pages are touched on first
        # use), outside the timing: the steady state a long-running rank is in.
        await asyncio.gather(*(_room(prefill, decode, addr, 10_000 + k, np.arange(pages) + k * pages, state(k))
                               for k in range(inflight)))
        staged = {p.name: d._svc.core.registrations[p.name].staged for d in decode for p in prefill}  # type: ignore
        if staged and all(staged.values()) is not bool(config.get("decode_staging_bytes")) and tp_p > tp_d:
            raise RuntimeError(f"decode staging was not what the case says: {staged}")

        async def one(room: int) -> None:
            async with gate:
                k = free.pop()
                await _room(prefill, decode, addr, room, np.arange(pages) + k * pages, state(k))
                free.append(k)

        c0, t0 = os.times(), time.perf_counter()
        await asyncio.gather(*(one(room) for room in range(requests)))
        elapsed, c1 = time.perf_counter() - t0, os.times()
    nbytes = requests * pages * 2 * layers * PAGE_SIZE * HEADS * HEAD_DIM * 2
    nbytes += requests * layers * MAMBA_HEADS * MAMBA_ROW if mamba else 0
    cpu = c1.user + c1.system - c0.user - c0.system
    return {"gbps": nbytes / elapsed / 1e9, "cpu_s_per_gb": cpu / (nbytes / 1e9)}


def main(argv: list[str] | None = None, out_dir: pathlib.Path | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--pages", type=int, default=32)
    parser.add_argument("--inflight", type=int, default=4)
    parser.add_argument("--mamba", action="store_true", help="a hybrid model with mamba state (see above)")
    parser.add_argument("--mixed", action="store_true", help="a decode fed by prefills at two TPs (see above)")
    args = parser.parse_args(argv)
    cases = [c for c in CASES if c[1] >= c[2]] if args.mamba else MIXED if args.mixed else CASES
    print(f"Heterogeneous TP, {args.requests} x {args.pages} pages, {args.inflight} in flight, same bytes"
          f"{', mamba state' if args.mamba else ''}{', prefills at two TPs' if args.mixed else ''}:", flush=True)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name, *_ in cases}
    gathers: list[float] = []
    for r in range(args.rounds):
        gathers.append(gather_gbps(args.layers, args.requests, args.pages, args.inflight))
        print(f"  round {r + 1} gather of the same slices on two threads: {gathers[-1]:5.2f} GB/s", flush=True)
        for name, tp_p, tp_d, config in (cases if r % 2 == 0 else cases[::-1]):
            run = asyncio.run(run_case(tp_p, tp_d, config, args.layers, args.requests, args.pages, args.inflight,
                                       args.mamba))
            runs[name].append(run)
            print(f"  round {r + 1} {name:38s}: {run['gbps']:5.2f} GB/s, {run['cpu_s_per_gb']:.2f} CPU s/GB",
                  flush=True)
    equal = statistics.median(x["gbps"] for x in runs[cases[0][0]])
    gather = statistics.median(gathers)
    ceiling = 1 / (1 / equal + 1 / gather)
    rows = []
    for name, tp_p, tp_d, config in cases:
        gbps = [x["gbps"] for x in runs[name]]
        staged = config.get("staging_bytes") != 0 if tp_p < tp_d else bool(config.get("decode_staging_bytes"))
        rows.append({"case": name, "tp_prefill": tp_p, "tp_decode": tp_d, "staging": staged,
                     "gbps": statistics.median(gbps), "gbps_spread": [min(gbps), max(gbps)],
                     "cpu_s_per_gb": statistics.median(x["cpu_s_per_gb"] for x in runs[name]),
                     "ratio_vs_equal_tp": statistics.median(gbps) / equal,
                     **({"staged_ceiling_gbps": ceiling, "ratio_vs_staged_ceiling": statistics.median(gbps) / ceiling}
                        if tp_p != tp_d and staged else {})})
    print(f"  staged ceiling 1/(1/{equal:.2f} + 1/{gather:.2f}) = {ceiling:.2f} GB/s "
          f"({ceiling / equal:.2f}x equal TP)", flush=True)
    result = {"question": __doc__.strip().splitlines()[0], "rounds": args.rounds, "requests": args.requests,
              "gather_gbps": gather, "gather_gbps_spread": [min(gathers), max(gathers)],
              "pages": args.pages, "inflight": args.inflight, "layers": args.layers, "mamba": args.mamba,
              "mixed": args.mixed, "rows": rows}
    write_result("hetero_tp_mamba" if args.mamba else "hetero_tp_mixed" if args.mixed else "hetero_tp", result,
                 out_dir)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
