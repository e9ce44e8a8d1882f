"""Q2 per-request overhead: latency p50/p99 and requests per second for small requests
(1 to 16 pages), asynckv against raw NIXL doing one WRITE plus a notification per request.

One request at a time, in one process, 32 KiB pages in two entries. asynckv's latency is
a whole room: destination sent, WRITE, status back, both waits resolved. Target: median
added latency at most 1 ms on this 2-core machine.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import numpy as np

from ._common import write_result
from ._pairs import RawNixl, pair, room, run

ITEM = 32 * 1024


async def measure(page_counts: list[int], reps: int) -> list[dict[str, object]]:
    rows = []
    async with pair(2, 64, ITEM) as (p, d):
        ppool, dpool = p._bench_pools  # type: ignore[attr-defined]
        raw = RawNixl(ppool, dpool)
        room_id = 1
        try:
            for n in page_counts:
                src, dst = np.arange(n), np.arange(n)[::-1].copy() + 20
                for _ in range(20):  # warm-up
                    await room(p, d, room_id, src, dst)
                    room_id += 1
                kv, rw = [], []
                t_kv = time.perf_counter()
                for _ in range(reps):
                    kv.append(await room(p, d, room_id, src, dst))
                    room_id += 1
                t_kv = time.perf_counter() - t_kv
                t_rw = time.perf_counter()
                for _ in range(reps):
                    rw.append(raw.write(src, dst, notif=b"done"))
                t_rw = time.perf_counter() - t_rw
                k50, k99 = np.percentile(kv, [50, 99]) * 1e3
                r50, r99 = np.percentile(rw, [50, 99]) * 1e3
                rows.append({"pages": n, "asynckv_p50_ms": k50, "asynckv_p99_ms": k99, "raw_p50_ms": r50,
                             "raw_p99_ms": r99, "added_p50_ms": k50 - r50, "asynckv_rps": reps / t_kv,
                             "raw_rps": reps / t_rw})
                print(f"  {n:3d} pages: asynckv p50 {k50:6.3f} ms p99 {k99:6.3f} ms ({reps / t_kv:6.0f} req/s); "
                      f"raw WRITE+notif p50 {r50:6.3f} ms p99 {r99:6.3f} ms; added {k50 - r50:+.3f} ms", flush=True)
        finally:
            raw.close()
    return rows


def main(argv: list[str] | None = None, out_dir: pathlib.Path | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pages", type=int, nargs="*", default=[1, 4, 16])
    parser.add_argument("--reps", type=int, default=300)
    args = parser.parse_args(argv)
    print("Q2 small-request latency (asynckv room vs raw WRITE + notification):")
    rows = run(measure(args.pages, args.reps))
    result = {"question": __doc__.strip().splitlines()[0], "rows": rows,
              "max_added_p50_ms": max(float(r["added_p50_ms"]) for r in rows)}  # type: ignore[arg-type]
    write_result("small_requests", result, out_dir)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
