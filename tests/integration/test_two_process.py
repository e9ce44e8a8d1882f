"""Prefill and decode in different processes: the demo's workers, and decode driven from the test."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest

from asynckv import BootstrapServer, Config, KVManager, KVPoll, Mode
from asynckv.demo import DemoSpec
from asynckv.testing import verify_aux, verify_pages

from .conftest import CONTROL

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("extra", [[], ["--mla"]], ids=["mha", "mla"])
def test_demo_moves_and_verifies_every_byte(extra: list[str]) -> None:
    out = subprocess.run([sys.executable, "-m", "asynckv", "demo", "--requests", "12", "--layers", "4",
                          "--max-pages", "8", "--chunk-pages", "3", "--inflight", "4", *extra],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    summary = [line for line in out.stdout.splitlines() if line.startswith("summary:")]
    assert len(summary) == 1 and "12 requests" in summary[0] and "every byte verified" in summary[0]
    # The prefill rank's own /metrics, scraped during the demo, has per-peer series with real values.
    kv_bytes = [line for line in out.stdout.splitlines() if "asynckv_transfer_bytes_total{" in line
                and 'kind="kv"' in line and 'mode="prefill"' in line and 'peer="' in line]
    assert kv_bytes and float(kv_bytes[0].split()[-1]) > 0, out.stdout


async def test_decode_in_this_process_receives_from_a_prefill_process() -> None:
    spec = DemoSpec(layers=2, kv_heads=2, head_dim=16, page_size=4, requests=40, min_pages=1, max_pages=6,
                    chunk_pages=2, inflight=5, seed=3)
    async with BootstrapServer("127.0.0.1", 0) as server:
        spec = dataclasses.replace(spec, bootstrap=server.addr)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "asynckv", "_worker", "prefill", json.dumps(dataclasses.asdict(spec)),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        try:
            pool = spec.pool()
            rng = np.random.default_rng(0)
            async with KVManager(Mode.DECODE, pool.kv_args(spec.page_size),
                                 config=Config(**CONTROL, waiting_timeout_s=30)) as d:
                sem = asyncio.Semaphore(spec.inflight)
                free_rows = list(range(spec.inflight))
                free_pages = [int(p) for p in rng.permutation(spec.pool_pages)]  # shuffled destinations

                async def receive(room: int, n: int) -> None:
                    async with sem:
                        row = free_rows.pop()
                        pages = np.array([free_pages.pop() for _ in range(n)])
                        receiver = d.receiver(server.addr, room)
                        await receiver.init(pages, row)
                        assert await receiver.wait() == KVPoll.Success, receiver.failure_reason
                        assert verify_pages(pool, room, pages) == 0
                        assert verify_aux(pool, room, row) == 0
                        receiver.clear()
                        free_rows.append(row)
                        free_pages.extend(int(p) for p in pages)

                await asyncio.gather(*(receive(r.room, r.num_pages) for r in spec.plan()))
                assert all(v == 0 for v in d.room_counts().values())
            assert await asyncio.wait_for(proc.wait(), 30) == 0
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
