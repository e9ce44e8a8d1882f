"""Scaling: GB/s and rooms/s of asynckv against write lanes (NIXL engines), pages per request and
rooms in flight, and how the prefill's CPU grows with the request.

The reference workload's geometry (``bench_seed_workload``: a prefill process and a decode
process, 64 buffers of 32 KiB pages = 2 MiB per page, DRAM, UCX over loopback). Each point is
its own pair of processes; rounds repeat the whole sweep and medians with the min-max spread
are reported. Three sweeps:

- write lanes 1..N (``Config.write_lanes``, set in the prefill's environment) on 64-request
  cases of 32 contiguous or scattered pages and on 1-page requests, 8 / 32 in flight;
- pages per request (1 to 256, contiguous, 8 in flight, the default lanes): GB/s, requests/s,
  and prefill CPU seconds per GB and per request;
- rooms in flight (1 to 256, 1-page requests): rooms/s and decode latency.
"""

from __future__ import annotations

import argparse
import functools
import os
import pathlib
import sys
from collections.abc import Callable
from typing import Any

from asynckv import Config

from ._common import medians, write_result
from .bench_seed_workload import measure_case

PAGES = [1, 4, 16, 64, 256]
INFLIGHT = [1, 4, 16, 64, 256]


def _requests(pages: int, budget: int) -> int:
    return max(8, min(400, budget // pages))


def _point(runs: list[dict[str, float]]) -> dict[str, Any]:
    return medians(runs, ("gbps", "rps", "p50_ms", "p99_ms", "cpu_prefill_s", "gb"))


def _with_lanes(lanes: int, fn: Callable[[], dict[str, float]]) -> dict[str, float]:
    old = os.environ.get("ASYNCKV_WRITE_LANES")
    os.environ["ASYNCKV_WRITE_LANES"] = str(lanes)  # read by the prefill process's Config.from_env
    try:
        return fn()
    finally:
        if old is None:
            del os.environ["ASYNCKV_WRITE_LANES"]
        else:
            os.environ["ASYNCKV_WRITE_LANES"] = old


def main(argv: list[str] | None = None, out_dir: pathlib.Path | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--lanes", type=int, nargs="*", default=[1, 2, 3])
    parser.add_argument("--pages", type=int, nargs="*", default=PAGES)
    parser.add_argument("--inflight", type=int, nargs="*", default=INFLIGHT)
    parser.add_argument("--budget-pages", type=int, default=2048, help="pages per point (requests x pages)")
    parser.add_argument("--scale", type=int, default=1, help="divide the layer count (smoke runs)")
    args = parser.parse_args(argv)
    default_lanes = Config().write_lanes
    points: dict[tuple[str, str], list[dict[str, float]]] = {}
    plan: list[tuple[str, str, int, Callable[[], dict[str, float]]]] = []
    for lanes in args.lanes:
        for label, requests, pages, inflight, scattered in (
                ("64 x 32 pages, contiguous", 64, 32, 8, False), ("64 x 32 pages, scattered", 64, 32, 8, True),
                ("400 x 1 page, 32 in flight", 400, 1, 32, False)):
            n = min(requests, _requests(pages, args.budget_pages))
            plan.append(("lanes", f"{label}|{lanes}", lanes,
                         functools.partial(measure_case, n, pages, inflight, scattered, args.scale)))
    for pages in args.pages:
        n = _requests(pages, args.budget_pages)
        plan.append(("pages", str(pages), default_lanes,
                     functools.partial(measure_case, n, pages, min(8, n), False, args.scale)))
    for inflight in args.inflight:
        n = max(400, 2 * inflight)
        plan.append(("inflight", str(inflight), default_lanes,
                     functools.partial(measure_case, n, 1, inflight, False, args.scale)))
    print(f"Scaling, {len(plan)} points x {args.rounds} rounds (each a prefill and a decode process):", flush=True)
    for r in range(args.rounds):
        for sweep, key, lanes, fn in plan:
            run = _with_lanes(lanes, fn)
            points.setdefault((sweep, key), []).append(run)
            print(f"  round {r + 1} {sweep:8s} {key:32s} lanes {lanes}: {run['gbps']:5.2f} GB/s, {run['rps']:7.1f} "
                  f"req/s, p50 {run['p50_ms']:7.1f} ms, prefill CPU {run['cpu_prefill_s']:.2f} s", flush=True)
    lanes_rows = []
    for (sweep, key), runs in points.items():
        if sweep == "lanes":
            label, lanes = key.rsplit("|", 1)
            lanes_rows.append({"case": label, "lanes": int(lanes), **_point(runs)})
    pages_rows = []
    for pages in args.pages:
        p = _point(points[("pages", str(pages))])
        requests = _requests(pages, args.budget_pages)
        p.update(pages=pages, requests=requests, descriptors_per_request=pages * 2 * (32 // args.scale),
                 cpu_s_per_gb=p["cpu_prefill_s"] / p["gb"], cpu_ms_per_request=p["cpu_prefill_s"] / requests * 1e3)
        pages_rows.append(p)
    inflight_rows = [{"inflight": i, **_point(points[("inflight", str(i))])} for i in args.inflight]
    result = {"question": __doc__.strip().splitlines()[0], "rounds": args.rounds, "scale": args.scale,
              "default_lanes": default_lanes, "lanes": lanes_rows, "pages": pages_rows, "inflight": inflight_rows}
    write_result("scaling", result, out_dir)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
