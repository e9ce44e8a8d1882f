"""``asynckv demo``: a bootstrap server, a prefill process and a decode process on 127.0.0.1.

The prefill process fills the pages of each request with a pattern keyed by (room, entry,
page position), sends them in chunks; the decode process receives them into shuffled
pre-allocated pages and checks every byte of every page and aux row. Exit status 0 only
if every byte matched.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

import numpy as np

from .config import Config
from .proto.states import KVPoll
from .service.bootstrap import BootstrapServer
from .service.manager import KVManager, Mode
from .testing.workload import KVPool, Request, fill_aux, fill_pages, make_plan, verify_aux, verify_pages

T = TypeVar("T")

__all__ = ["DemoSpec", "run_demo", "run_worker"]


@dataclasses.dataclass(frozen=True)
class DemoSpec:
    """The model geometry and the request stream of one demo run."""

    layers: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype_bytes: int = 2
    page_size: int = 16
    mla: bool = False
    mla_latent_dim: int = 576
    requests: int = 64
    min_pages: int = 1
    max_pages: int = 64
    chunk_pages: int = 16
    inflight: int = 8
    seed: int = 0
    bootstrap: str = ""
    chunk_delay_s: float = 0.0
    """Prefill sleeps this long between chunks (fault tests keep rooms in flight with it)."""
    heartbeat_interval_s: float = 0.5
    fill: bool = True
    """Prefill writes each request's pattern into its pages (benchmarks turn it off)."""
    report_loop_lag: bool = False
    """Prefill measures its event loop's lag (how late 1 ms sleeps wake) and prints it at the end."""
    warmup: int = 0
    """The plan's first ``warmup`` requests warm the pair up (first contact): a benchmark's decode
    receives them before it starts timing, and prefill counts serving CPU from the first destination
    of a later request."""

    @property
    def entries(self) -> int:
        return self.layers if self.mla else 2 * self.layers

    @property
    def item_bytes(self) -> int:
        per_token = self.mla_latent_dim if self.mla else self.kv_heads * self.head_dim
        return self.page_size * per_token * self.dtype_bytes

    @property
    def pool_pages(self) -> int:
        return self.inflight * self.max_pages

    def pool(self) -> KVPool:
        pool = KVPool(self.entries, self.pool_pages, self.item_bytes, aux_rows=self.inflight)
        pool.kv.fill(0)  # fault the pages in now, not during the first transfers
        return pool

    def plan(self) -> list[Request]:
        return make_plan(self.seed, self.requests, self.min_pages, self.max_pages)

    def describe(self) -> str:
        kind = "MLA" if self.mla else "MHA"
        return (f"{kind}, {self.layers} layers, {self.entries} buffers x {self.item_bytes // 1024} KiB pages "
                f"({self.page_size} tokens, {self.entries * self.item_bytes / 2**20:.1f} MiB per page)")


class _Slots:
    """Pages and aux rows of a pool, handed out per request."""

    def __init__(self, num_pages: int, rows: int, shuffle_seed: int | None) -> None:
        pages = np.arange(num_pages)
        if shuffle_seed is not None:
            np.random.default_rng(shuffle_seed).shuffle(pages)
        self.pages: collections.deque[int] = collections.deque(pages.tolist())
        """Free pages, oldest freed first (a list sliced per request cost O(pool) per room)."""
        self.rows = list(range(rows))

    def take(self, n: int) -> tuple[np.ndarray, int]:
        taken = [self.pages.popleft() for _ in range(n)]
        return np.asarray(taken, dtype=np.int64), self.rows.pop()

    def give(self, pages: np.ndarray, row: int) -> None:
        self.pages.extend(pages.tolist())
        self.rows.append(row)


async def bounded(items: Iterable[T], limit: int, fn: Callable[[T], Awaitable[object]]) -> None:
    """``fn(item)`` for every item, at most ``limit`` at once, started in order: ``limit`` workers
    pull from one iterator. (A task per item behind a semaphore parked thousands of tasks, and
    Python 3.11's semaphore scans its waiters on each release: 1M ``Future.done`` calls for
    5,000 rooms.)"""
    it = iter(items)

    async def worker() -> None:
        for item in it:
            await fn(item)

    await asyncio.gather(*(worker() for _ in range(max(1, limit))))


def _emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


async def _prefill(spec: DemoSpec) -> int:
    pool = spec.pool()
    slots = _Slots(spec.pool_pages, spec.inflight, None)
    failures = 0

    async with KVManager(Mode.PREFILL, pool.kv_args(spec.page_size, is_mla=spec.mla),
                         bootstrap_addr=spec.bootstrap,
                         config=Config.from_env(host_bootstrap=False, ops_port=0,
                                                heartbeat_interval_s=spec.heartbeat_interval_s)) as mgr:

        serving_since: os.times_result | None = None  # at the first destination: start-up is not serving CPU
        plan = spec.plan()
        warming = {req.room for req in plan[:spec.warmup]}

        async def serve(req: Request) -> None:
            nonlocal failures, serving_since
            pages, row = slots.take(req.num_pages)
            if spec.fill:
                await asyncio.to_thread(fill_pages, pool, req.room, pages)
                fill_aux(pool, req.room, row)
            sender = mgr.sender(req.room)
            if await sender.wait_ready() == KVPoll.WaitingForInput:
                if req.room not in warming:
                    serving_since = serving_since or os.times()
                sender.init(req.num_pages, row)
                for i in range(0, req.num_pages, spec.chunk_pages):
                    if spec.chunk_delay_s and sender.poll() != KVPoll.Failed:
                        await asyncio.sleep(spec.chunk_delay_s)
                    await sender.send(pages[i:i + spec.chunk_pages])
            if await sender.wait() != KVPoll.Success:
                failures += 1
                _emit("failed", room=req.room, reason=sender.failure_reason)
            sender.clear()
            slots.give(pages, row)

        probe = LagProbe() if spec.report_loop_lag else None
        await bounded(plan, spec.inflight, serve)
        if serving_since is not None:
            now = os.times()
            _emit("cpu", serving_s=now.user + now.system - serving_since.user - serving_since.system)
        if probe is not None:
            _emit("loop_lag", **probe.stop())
        if mgr.ops_server is not None:  # what an operator's scrape of this rank shows now
            _emit("metrics", lines=await _scrape(mgr.ops_server.addr))
    return 0 if failures == 0 else 1


class LagProbe:
    """How late 1 ms sleeps on the running loop wake (its lag), and the CPU its thread and the
    process used, until ``stop()``. Create and stop it on the loop's thread."""

    def __init__(self) -> None:
        self.lags: list[tuple[float, float]] = []
        """(when, lag) in seconds."""
        self._cpu = (time.thread_time(), time.process_time())
        self._t0 = time.perf_counter()
        self._task = asyncio.get_running_loop().create_task(self._tick(), name="asynckv-lag-probe")

    async def _tick(self) -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            self.lags.append((t, time.perf_counter() - t - 0.001))

    def stop(self) -> dict[str, float]:
        """p99 and max lag in ms, the p99 after the first 30% of the time (past a start-up burst);
        CPU seconds of the loop's thread and of the whole process."""
        self._task.cancel()
        since = self._t0 + (time.perf_counter() - self._t0) * 0.3
        lags, steady = sorted(lag for _, lag in self.lags) or [0.0], sorted(
            lag for t, lag in self.lags if t > since) or [0.0]
        return {"p99_ms": _p99(lags) * 1e3, "steady_p99_ms": _p99(steady) * 1e3, "max_ms": lags[-1] * 1e3,
                "loop_cpu_s": time.thread_time() - self._cpu[0], "process_cpu_s": time.process_time() - self._cpu[1]}


def _p99(ordered: list[float]) -> float:
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


async def _scrape(addr: str) -> list[str]:
    import aiohttp

    async with aiohttp.ClientSession() as http, http.get(f"http://{addr}/metrics") as resp:
        text = await resp.text()
    wanted = ("asynckv_transfer_bytes_total", "asynckv_transfers_total", "asynckv_peer_up")
    return [line for line in text.splitlines() if line.startswith(wanted)]


async def _decode(spec: DemoSpec) -> int:
    pool = spec.pool()
    slots = _Slots(spec.pool_pages, spec.inflight, spec.seed + 1)
    latencies: list[float] = []
    stats = {"done": 0, "failed": 0, "bad_pages": 0, "bad_aux": 0, "bytes": 0}

    async with KVManager(Mode.DECODE, pool.kv_args(spec.page_size, is_mla=spec.mla),
                         config=Config.from_env(heartbeat_interval_s=spec.heartbeat_interval_s)) as mgr:

        async def receive(req: Request) -> None:
            pages, row = slots.take(req.num_pages)
            receiver = mgr.receiver(spec.bootstrap, req.room)
            t0 = time.perf_counter()
            await receiver.init(pages, row)
            result = await receiver.wait()
            latencies.append(time.perf_counter() - t0)
            if result == KVPoll.Success:
                stats["bad_pages"] += await asyncio.to_thread(verify_pages, pool, req.room, pages)
                stats["bad_aux"] += verify_aux(pool, req.room, row)
                stats["bytes"] += req.num_pages * pool.page_bytes
            else:
                stats["failed"] += 1
                _emit("failed", room=req.room, reason=receiver.failure_reason)
            receiver.clear()
            slots.give(pages, row)  # stale contents cannot pass: patterns are keyed by room
            stats["done"] += 1

        async def report() -> None:
            while True:
                await asyncio.sleep(0.5)
                _emit("progress", **stats, elapsed=time.perf_counter() - start)

        # Wait for the prefill instance before starting the clock: process start-up is not transfer time.
        await mgr.prefill_instance(spec.bootstrap, connect=True)
        start = time.perf_counter()
        reporter = asyncio.create_task(report())
        await bounded(spec.plan(), spec.inflight, receive)
        elapsed = time.perf_counter() - start
        reporter.cancel()
    lat = np.asarray(latencies) * 1e3
    _emit("summary", **stats, elapsed=elapsed, p50_ms=float(np.percentile(lat, 50)),
          p99_ms=float(np.percentile(lat, 99)), requests=spec.requests, leftover=mgr.room_counts())
    ok = stats["failed"] == 0 and stats["bad_pages"] == 0 and stats["bad_aux"] == 0
    return 0 if ok else 1


def _install_uvloop() -> None:
    try:
        import uvloop
    except ImportError:
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def run_worker(role: str, spec_json: str) -> int:
    """Entry point of a demo child process (``asynckv _worker prefill|decode SPEC``)."""
    spec = DemoSpec(**json.loads(spec_json))
    _install_uvloop()
    return asyncio.run(_prefill(spec) if role == "prefill" else _decode(spec))


async def _run(spec: DemoSpec, out: Any) -> int:
    async with BootstrapServer("127.0.0.1", 0) as server:
        spec = dataclasses.replace(spec, bootstrap=server.addr)
        print(f"asynckv demo: {spec.requests} requests of {spec.min_pages}-{spec.max_pages} pages "
              f"in chunks of {spec.chunk_pages}, {spec.inflight} in flight; {spec.describe()}", file=out)
        print(f"  bootstrap server on {server.addr}; starting prefill and decode processes", file=out, flush=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        procs = {role: await asyncio.create_subprocess_exec(
            sys.executable, "-m", "asynckv", "_worker", role, json.dumps(dataclasses.asdict(spec)),
            stdout=asyncio.subprocess.PIPE, env=env) for role in ("decode", "prefill")}
        summary: dict[str, Any] = {}

        async def pump(role: str, proc: asyncio.subprocess.Process) -> None:
            if proc.stdout is None:
                return
            async for raw in proc.stdout:
                try:
                    ev = json.loads(raw)
                except ValueError:
                    print(f"  [{role}] {raw.decode(errors='replace').rstrip()}", file=out, flush=True)
                    continue
                if ev["event"] == "progress":
                    rate = ev["bytes"] / max(ev["elapsed"], 1e-9) / 1e9
                    print(f"  [decode] {ev['done']}/{spec.requests} requests verified, "
                          f"{ev['bytes'] / 1e9:.2f} GB, {rate:.2f} GB/s", file=out, flush=True)
                elif ev["event"] == "summary":
                    summary.update(ev)
                elif ev["event"] == "metrics":
                    print(f"  [{role}] GET /metrics (per-peer series):", file=out)
                    for line in ev["lines"]:
                        print(f"    {line}", file=out)
                else:
                    print(f"  [{role}] {ev}", file=out, flush=True)

        try:
            await asyncio.wait_for(asyncio.gather(*(pump(r, p) for r, p in procs.items())), timeout=600)
            codes = {r: await p.wait() for r, p in procs.items()}
        finally:
            for p in procs.values():
                if p.returncode is None:
                    p.kill()
                    await p.wait()
    if not summary:
        print(f"demo FAILED: decode produced no summary (exit codes {codes})", file=out)
        return 1
    gb = summary["bytes"] / 1e9
    verdict = ("every byte verified" if summary["bad_pages"] == 0 and summary["bad_aux"] == 0
               and summary["failed"] == 0 else
               f"FAILED: {summary['failed']} failed rooms, {summary['bad_pages']} bad pages, "
               f"{summary['bad_aux']} bad aux rows")
    print(f"summary: {summary['done']} requests, {gb:.2f} GB moved in {summary['elapsed']:.2f} s "
          f"= {gb / summary['elapsed']:.2f} GB/s, request latency p50 {summary['p50_ms']:.1f} ms "
          f"p99 {summary['p99_ms']:.1f} ms; {verdict}", file=out, flush=True)
    if any(codes.values()) or "FAILED" in verdict:
        print(f"demo FAILED (exit codes {codes})", file=out)
        return 1
    return 0


def run_demo(spec: DemoSpec, out: Any = None) -> int:
    """Run the whole demo; returns the process exit status."""
    _install_uvloop()
    return asyncio.run(_run(spec, out if out is not None else sys.stdout))
