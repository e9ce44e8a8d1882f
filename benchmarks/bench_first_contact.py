"""Q6 first contact: registration plus warm-up time to a new peer (target under 100 ms
median here).

A prefill manager is up; each round starts a fresh decode manager (new NIXL agent) and
times its first room's ``receiver.init()``: topology lookup, registration (prefill imports
the agent metadata and prepares its dlist), the warm-up write, and the destination sent.
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


def main(argv: list[str] | None = None, out_dir: pathlib.Path | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args(argv)
    print("Q6 first contact (64 KV entries registered):")
    ms = np.asarray(asyncio.run(measure(args.rounds))) * 1e3
    print(f"  median {np.median(ms):.1f} ms, p90 {np.percentile(ms, 90):.1f} ms, min {ms.min():.1f} ms", flush=True)
    result = {"question": __doc__.strip().splitlines()[0], "samples_ms": ms.tolist(),
              "median_ms": float(np.median(ms)), "p90_ms": float(np.percentile(ms, 90))}
    write_result("first_contact", result, out_dir)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
