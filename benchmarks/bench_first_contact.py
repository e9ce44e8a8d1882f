"""Q6 first contact: registration plus warm-up time to a new peer (target under 100 ms
median here).

A prefill manager is up; each round starts a fresh decode manager (new NIXL agent) and
times its first room's ``receiver.init()``: topology lookup, registration (prefill imports
the agent metadata and prepares its dlist), the warm-up write, and the destination sent.

Then, in the same rounds, a fresh decode's first 1-page room end to end (``init()`` to
``wait()`` resolving, prefill sending as soon as it is ready): cold (the topology known, no
registration yet) against preconnected (``prefill_instance(addr, connect=True)`` first, the
room opened once the registration was answered), with a later room on the same pair as the
floor.
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import sys
import time

import numpy as np

from asynckv import Config, KVManager, KVPoll, Mode
from asynckv.testing import KVPool

from ._common import write_result


async def measure(rounds: int) -> list[float]:
    samples = []
    ppool = KVPool(64, 64, 32 * 1024)
    async with KVManager(Mode.PREFILL, ppool.kv_args(), bootstrap_addr="127.0.0.1:0", config=Config()) as p:
        for i in range(rounds):
            dpool = KVPool(64, 64, 32 * 1024)
            async with KVManager(Mode.DECODE, dpool.kv_args(), config=Config()) as d:
                receiver = d.receiver(p.bootstrap_addr or "", i + 1)
                t = time.perf_counter()
                if await receiver.init([0]) != KVPoll.WaitingForInput:
                    raise RuntimeError(receiver.failure_reason)
                samples.append(time.perf_counter() - t)
                await receiver.abort("done")
                receiver.clear()
    return samples


async def one_room(p: KVManager, d: KVManager, room: int) -> float:
    """Seconds from ``receiver.init()`` to ``wait()`` resolving, for a 1-page room."""
    receiver = d.receiver(p.bootstrap_addr or "", room)
    t = time.perf_counter()
    await receiver.init([0])
    sender = p.sender(room)
    await sender.wait_ready()
    sender.init(1)
    await sender.send([0])
    if await receiver.wait() != KVPoll.Success:
        raise RuntimeError(receiver.failure_reason)
    elapsed = time.perf_counter() - t
    sender.clear()
    receiver.clear()
    return elapsed


async def first_rooms(rounds: int) -> dict[str, list[float]]:
    """Cold and preconnected first rooms of fresh decodes, alternating, and a later room of each."""
    out: dict[str, list[float]] = {"cold": [], "preconnected": [], "later": []}
    ppool = KVPool(64, 64, 32 * 1024)
    async with KVManager(Mode.PREFILL, ppool.kv_args(), bootstrap_addr="127.0.0.1:0", config=Config()) as p:
        addr = p.bootstrap_addr or ""
        for i in range(2 * rounds):
            dpool = KVPool(64, 64, 32 * 1024)
            dpool.kv.fill(0)  # (faulted in, as a serving pool is: a first write into untouched pages cost 20-80 ms)
            async with KVManager(Mode.DECODE, dpool.kv_args(), config=Config()) as d:
                connect = i % 2 == 1
                await d.prefill_instance(addr, connect=connect)
                while d.room_counts()["registrations_pending"]:  # (as when the router learnt of it earlier)
                    await asyncio.sleep(0.001)
                out["preconnected" if connect else "cold"].append(await one_room(p, d, 1000 + 2 * i))
                out["later"].append(await one_room(p, d, 1001 + 2 * i))
    return out


def main(argv: list[str] | None = None, out_dir: pathlib.Path | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args(argv)
    print("Q6 first contact (64 KV entries registered):")
    ms = np.asarray(asyncio.run(measure(args.rounds))) * 1e3
    print(f"  median {np.median(ms):.1f} ms, p90 {np.percentile(ms, 90):.1f} ms, min {ms.min():.1f} ms", flush=True)
    rooms = {k: np.asarray(v) * 1e3 for k, v in asyncio.run(first_rooms(args.rounds)).items()}
    print("  first 1-page room, init() to Success, median (min-max): "
          + ", ".join(f"{k} {np.median(v):.1f} ms ({v.min():.1f}-{v.max():.1f})" for k, v in rooms.items()), flush=True)
    result = {"question": __doc__.strip().splitlines()[0], "samples_ms": ms.tolist(),
              "median_ms": float(np.median(ms)), "p90_ms": float(np.percentile(ms, 90)),
              "first_room_ms": {k: {"median": float(np.median(v)), "min": float(v.min()), "max": float(v.max()),
                                    "samples": v.tolist()} for k, v in rooms.items()}}
    write_result("first_contact", result, out_dir)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
