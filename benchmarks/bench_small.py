"""Q2 per-request overhead: latency p50/p99 and requests per second for small requests
(1 to 16 pages), asynckv against raw NIXL doing one WRITE plus a notification per request.

One request at a time, in one process, 32 KiB pages in two entries. asynckv's latency is
a whole room: destination sent, WRITE, status back, both waits resolved; measured with each
control transport (plain TCP streams, the default, and ZMQ), pairs of both alternating in one
run. Target: median added latency at most 1 ms on this 2-core machine.
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import sys
import time

import numpy as np

from ._common import write_result
from ._pairs import RawNixl, pair, room, run

ITEM = 32 * 1024
TRANSPORTS = ("stream", "zmq")


async def session(transport: str, page_counts: list[int], reps: int,
                  samples: dict[tuple[str, int], list[float]], elapsed: dict[tuple[str, int], float]) -> None:
    """One pair on one control transport: ``reps`` rooms per page count, and as many raw WRITEs."""
    async with pair(2, 64, ITEM, control_transport=transport) as (p, d):
        ppool, dpool = p._bench_pools  # type: ignore[attr-defined]
        raw = RawNixl(ppool, dpool)
        room_id = 1
        try:
            for n in page_counts:
                src, dst = np.arange(n), np.arange(n)[::-1].copy() + 20
                for _ in range(20):  # warm-up
                    await room(p, d, room_id, src, dst)
                    room_id += 1
                t = time.perf_counter()
                for _ in range(reps):
                    samples[transport, n].append(await room(p, d, room_id, src, dst))
                    room_id += 1
                elapsed[transport, n] += time.perf_counter() - t
                for _ in range(reps):
                    samples["raw", n].append(raw.write(src, dst, notif=b"done"))
        finally:
            raw.close()


async def measure(page_counts: list[int], reps: int, rounds: int) -> list[dict[str, object]]:
    """Both control transports in turn (``rounds`` pairs each, the first of each round
    alternating), ``reps`` rooms per page count and pair; percentiles over all of a transport's rooms."""
    samples: dict[tuple[str, int], list[float]] = collections.defaultdict(list)
    elapsed: dict[tuple[str, int], float] = collections.defaultdict(float)
    for r in range(rounds):
        for transport in TRANSPORTS[::1 if r % 2 == 0 else -1]:
            await session(transport, page_counts, reps, samples, elapsed)
    rows = []
    for n in page_counts:
        r50, r99 = np.percentile(samples["raw", n], [50, 99]) * 1e3
        row: dict[str, object] = {"pages": n, "raw_p50_ms": r50, "raw_p99_ms": r99}
        line = f"  {n:3d} pages: raw WRITE+notif p50 {r50:6.3f} ms p99 {r99:6.3f} ms"
        for transport in TRANSPORTS:
            k50, k99 = np.percentile(samples[transport, n], [50, 99]) * 1e3
            rps = len(samples[transport, n]) / elapsed[transport, n]
            prefix = "asynckv" if transport == "stream" else transport  # (the default, then ZMQ)
            row.update({f"{prefix}_p50_ms": k50, f"{prefix}_p99_ms": k99, f"{prefix}_rps": rps,
                        f"{'added' if transport == 'stream' else transport + '_added'}_p50_ms": k50 - r50})
            line += f"; {transport} p50 {k50:6.3f} ms p99 {k99:6.3f} ms ({rps:5.0f} req/s, added {k50 - r50:+.3f})"
        rows.append(row)
        print(line, flush=True)
    return rows


def main(argv: list[str] | None = None, out_dir: pathlib.Path | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pages", type=int, nargs="*", default=[1, 4, 16])
    parser.add_argument("--reps", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    print("Q2 small-request latency (asynckv room, stream and ZMQ control, vs raw WRITE + notification):")
    rows = run(measure(args.pages, args.reps, args.rounds))
    result = {"question": __doc__.strip().splitlines()[0], "rows": rows,
              "max_added_p50_ms": max(float(r["added_p50_ms"]) for r in rows),
              "zmq_max_added_p50_ms": max(float(r["zmq_added_p50_ms"]) for r in rows)}
    write_result("small_requests", result, out_dir)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
