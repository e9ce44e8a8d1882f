"""Q7: the deterministic simulator at scale: how many seeded schedules of faults, rooms and
restarts run over the real protocol cores, and how many break an invariant (target: none).

Each schedule draws a cluster (1-2 prefill and 1-2 decode instances, TP 1 or 2), a fault
mix (message delay, loss, duplication; writes that fail, stall or crawl; failed first
contacts; a tiny in-flight byte budget), process faults (stops beyond the heartbeat bound,
kills, close() mid-transfer, restarts) and 4-14 rooms (either side first, aborts, clears
mid-transfer, reused ids), then checks I1-I5 after every step. Runs on every core.
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing
import pathlib
import re
import sys
import time
from typing import Any

from asynckv.testing.schedule import run_seed

from ._common import write_result

CHUNK = 500


def _run_chunk(first: int) -> dict[str, Any]:
    totals: collections.Counter[str] = collections.Counter()
    violations: dict[int, str] = {}
    for seed in range(first, first + CHUNK):
        out = run_seed(seed)
        totals.update(rooms=out.rooms, succeeded=out.succeeded, failed=out.failed, steps=out.steps,
                      sim_seconds=int(out.sim_seconds))
        for fault in re.findall(r"(?:^|, )(\w+)=", out.faults):  # "delay_ms=(0.05, 30.0), dup=0.02"
            totals[f"mix:{fault}"] += 1
        if out.violations:
            violations[seed] = out.violations[0]
    return {"totals": dict(totals), "violations": violations}


def main(argv: list[str] | None = None, out_dir: pathlib.Path | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seeds", type=int, default=100_000)
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--procs", type=int, default=multiprocessing.cpu_count())
    args = parser.parse_args(argv)
    seeds = max(CHUNK, args.seeds // CHUNK * CHUNK)
    print(f"Q7 simulator: {seeds} schedules on {args.procs} processes", flush=True)
    t = time.perf_counter()
    totals: collections.Counter[str] = collections.Counter()
    violations: dict[int, str] = {}
    starts = range(args.start, args.start + seeds, CHUNK)
    with multiprocessing.get_context("spawn").Pool(args.procs) as pool:
        for done, part in enumerate(pool.imap_unordered(_run_chunk, starts), 1):
            totals.update(part["totals"])
            violations.update({int(k): v for k, v in part["violations"].items()})
            if done % 10 == 0 or done == len(starts):
                print(f"  {done * CHUNK}/{seeds} schedules, {len(violations)} with violations, "
                      f"{time.perf_counter() - t:.0f} s", flush=True)
    elapsed = time.perf_counter() - t
    mix = {k.removeprefix("mix:"): v for k, v in sorted(totals.items()) if k.startswith("mix:")}
    result = {"question": __doc__.strip().splitlines()[0], "schedules": seeds, "first_seed": args.start,
              "seconds": round(elapsed, 1), "schedules_per_s": round(seeds / elapsed, 1),
              "violations": len(violations), "violating_seeds": dict(sorted(violations.items())[:20]),
              "rooms": totals["rooms"], "rooms_succeeded": totals["succeeded"], "rooms_failed": totals["failed"],
              "steps": totals["steps"], "simulated_hours": round(totals["sim_seconds"] / 3600, 1),
              "schedules_with_fault": mix}
    print(f"  {seeds} schedules in {elapsed:.0f} s: {len(violations)} with violations; "
          f"{totals['rooms']} rooms, {totals['steps']} steps", flush=True)
    write_result("simulator", result, out_dir)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
