"""100,000 rooms through one prefill/decode pair: tables empty at the end, memory flat."""

from __future__ import annotations

import asyncio
import gc
import os
import time

import numpy as np
import pytest

from asynckv import KVPoll
from asynckv.testing import fill_pages, verify_pages

from .conftest import Pair, make_pair

pytestmark = pytest.mark.integration


def rss_mib() -> float:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


async def run_rooms(pair: Pair, first: int, count: int, concurrency: int = 256) -> list[str]:
    """Run rooms; returns the failure reasons (a failed room must still leave nothing behind)."""
    failures: list[str] = []
    slots = asyncio.Queue[int]()
    for k in range(concurrency):
        slots.put_nowait(k)

    async def one(room: int) -> None:
        k = await slots.get()
        try:
            receiver = pair.decode.receiver(pair.addr, room)
            sender = pair.prefill.sender(room)
            await receiver.init([k])
            if await sender.wait_ready() == KVPoll.WaitingForInput:
                sender.init(1)
                await sender.send([k])
            if await sender.wait() != KVPoll.Success or await receiver.wait() != KVPoll.Success:
                failures.append(f"{sender.failure_reason} / {receiver.failure_reason}")
            await receiver.wait()
            sender.clear()
            receiver.clear()
        finally:
            slots.put_nowait(k)

    for start in range(first, first + count, 2 * concurrency):  # batches: the test itself holds nothing
        await asyncio.gather(*(one(room) for room in range(start, min(start + 2 * concurrency, first + count))))
    return failures


@pytest.mark.slow
async def test_100k_rooms_leave_nothing_behind() -> None:
    async with make_pair(entries=2, pages=256, item=64) as pair:
        fill_pages(pair.ppool, 1, np.arange(256))
        await run_rooms(pair, 1, 5_000)  # warm-up: allocator pools, caches
        gc.collect()
        before = rss_mib()
        t = time.perf_counter()
        failures = await run_rooms(pair, 5_001, 95_000)
        elapsed = time.perf_counter() - t
        gc.collect()
        growth = rss_mib() - before
        print(f"95,000 rooms in {elapsed:.1f}s ({95_000 / elapsed:.0f} rooms/s); RSS {before:.1f} MiB, "
              f"growth {growth:+.1f} MiB")
        # A transient UCX disconnect under heavy load fails the rooms in flight (with the reason)
        # and the pair recovers by registering again; anything else is a bug.
        assert len(failures) <= 95, failures[:5]
        assert all("disconnect" in f or "closed" in f or "dead" in f for f in failures), failures[:5]
        pair.assert_no_room_state()
        for mgr in (pair.prefill, pair.decode):
            assert mgr.data_plane.posts_in_flight == 0
        assert len(pair.prefill.snapshot()["peers"]) <= 1
        assert verify_pages(pair.dpool, 1, np.arange(256)) == 0  # page k of every room carried room 1's page k
        assert growth < 32, f"resident memory grew by {growth:.1f} MiB over 95,000 rooms"
