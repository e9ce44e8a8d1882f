"""Q5 idle cost: CPU used by an idle prefill/decode pair with its peers loaded (target
under 5% of one core), and by one with 1,000 idle rooms waiting.

One pair in one process (both managers, both engine threads, heartbeats on); CPU time of
the whole process over a few seconds of wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import sys
import time

import numpy as np

from ._common import write_result
from ._pairs import pair, room


async def measure(seconds: float, rooms: int) -> dict[str, float]:
    async with pair(2, 64, 4096) as (p, d):
        await room(p, d, 1, np.arange(2), np.arange(2))  # peers registered and warmed up

        async def cpu_share() -> float:
            t, c = time.perf_counter(), os.times()
            await asyncio.sleep(seconds)
            c2 = os.times()
            return (c2.user + c2.system - c.user - c.system) / (time.perf_counter() - t)

        idle = await cpu_share()
        receivers = [d.receiver(p.bootstrap_addr or "", 100 + i) for i in range(rooms)]
        for i, r in enumerate(receivers):
            await r.init([i % 64])
        senders = [p.sender(100 + i) for i in range(rooms)]
        await asyncio.sleep(0.5)
        waiting = await cpu_share()
        for s in senders:
            s.clear()
        for r in receivers:
            await r.abort("benchmark over")
            r.clear()
    return {"idle_pair_cpu_pct": idle * 100, "rooms_waiting": rooms, "waiting_rooms_cpu_pct": waiting * 100}


def main(argv: list[str] | None = None, out_dir: pathlib.Path | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rooms", type=int, default=1000)
    args = parser.parse_args(argv)
    print("Q5 idle cost:")
    row = asyncio.run(measure(args.seconds, args.rooms))
    print(f"  idle pair: {row['idle_pair_cpu_pct']:.1f}% of one core; with {args.rooms} rooms waiting: "
          f"{row['waiting_rooms_cpu_pct']:.1f}%", flush=True)
    result = {"question": __doc__.strip().splitlines()[0], **row}
    write_result("idle", result, out_dir)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
