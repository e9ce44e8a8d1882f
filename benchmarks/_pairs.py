"""In-process prefill/decode pairs and a minimal raw-NIXL loop: the two sides of most comparisons."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

from asynckv import Config, KVManager, KVPoll, Mode
from asynckv.testing import KVPool


@contextlib.asynccontextmanager
async def pair(entries: int, pages: int, item: int, **config: Any) -> AsyncIterator[tuple[KVManager, KVManager]]:
    ppool, dpool = KVPool(entries, pages, item, aux_rows=8), KVPool(entries, pages, item, aux_rows=8)
    ppool.kv.fill(1)
    dpool.kv.fill(0)  # fault the pages in before timing
    cfg = Config(**config)
    async with KVManager(Mode.PREFILL, ppool.kv_args(), bootstrap_addr="127.0.0.1:0", config=cfg) as p, \
            KVManager(Mode.DECODE, dpool.kv_args(), config=cfg) as d:
        p._bench_pools = (ppool, dpool)  # type: ignore[attr-defined]
        yield p, d


async def room(p: KVManager, d: KVManager, room_id: int, src: np.ndarray, dst: np.ndarray,
               chunk: int | None = None) -> float:
    """One request end to end; seconds from receiver.init() to receiver.wait() resolving."""
    t0 = time.perf_counter()
    receiver = d.receiver(p.bootstrap_addr or "", room_id)
    await receiver.init(dst)
    sender = p.sender(room_id)
    await sender.wait_ready()
    sender.init(len(src))
    step = chunk or max(len(src), 1)
    for i in range(0, max(len(src), 1), step):
        await sender.send(src[i:i + step])
    result = await receiver.wait()
    elapsed = time.perf_counter() - t0
    if result != KVPoll.Success or await sender.wait() != KVPoll.Success:
        raise RuntimeError(f"room {room_id} failed: {receiver.failure_reason} / {sender.failure_reason}")
    sender.clear()
    receiver.clear()
    return elapsed


class RawNixl:
    """Two bare NIXL agents over the same buffers: prepared dlists, one WRITE per request,
    the target progressed from the same thread. The floor asynckv is measured against."""

    def __init__(self, src: KVPool, dst: KVPool) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        cfg = nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        self.a, self.b = nixl_agent("raw-a", cfg), nixl_agent("raw-b", cfg)
        self.regs = [(self.a, self.a.register_memory(self._regions(src), "DRAM")),
                     (self.b, self.b.register_memory(self._regions(dst), "DRAM"))]
        self.a.add_remote_agent(self.b.get_agent_metadata())
        self.local = self.a.prep_xfer_dlist("", self._rows(src), "DRAM")
        self.remote = self.a.prep_xfer_dlist("raw-b", self._rows(dst), "DRAM")
        self.pages, self.entries = src.num_pages, src.entries
        self.write(np.arange(1), np.arange(1))  # warm-up, as asynckv does on first contact

    @staticmethod
    def _regions(pool: KVPool) -> list[tuple[int, int, int, str]]:
        return [(int(pool.kv[e].ctypes.data), int(pool.kv[e].nbytes), 0, "") for e in range(pool.entries)]

    @staticmethod
    def _rows(pool: KVPool) -> np.ndarray:
        rows = np.empty((pool.entries * pool.num_pages, 3), dtype=np.uint64)
        base = np.array([pool.kv[e].ctypes.data for e in range(pool.entries)], dtype=np.uint64)
        rows[:, 0] = (base[:, None] + np.uint64(pool.item_bytes) * np.arange(pool.num_pages, dtype=np.uint64)).ravel()
        rows[:, 1] = pool.item_bytes
        rows[:, 2] = 0
        return rows

    def _idx(self, pages: np.ndarray) -> np.ndarray:
        return (np.arange(self.entries)[:, None] * self.pages + pages[None, :]).astype(np.int32).ravel()

    def write(self, src: np.ndarray, dst: np.ndarray, notif: bytes = b"") -> float:
        """Seconds for one WRITE (plus its notification reaching the target when ``notif``)."""
        t0 = time.perf_counter()
        h = self.a.make_prepped_xfer("WRITE", self.local, self._idx(src), self.remote, self._idx(dst), notif)
        state = self.a.transfer(h)
        arrived = not notif
        while state != "DONE" or not arrived:
            arrived = bool(self.b.get_new_notifs()) or arrived  # the target must progress too
            if state != "DONE":
                state = self.a.check_xfer_state(h)
        elapsed = time.perf_counter() - t0
        self.a.release_xfer_handle(h)
        return elapsed

    def close(self) -> None:
        self.a.release_dlist_handle(self.local)
        self.a.release_dlist_handle(self.remote)
        self.a.remove_remote_agent("raw-b")
        for agent, reg in self.regs:
            agent.deregister_memory(reg)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


@contextlib.asynccontextmanager
async def decode_against_prefill_process(spec: Any, output: list[str] | None = None) -> AsyncIterator[
        tuple[KVManager, Any, Any]]:
    """A decode manager here and a demo prefill worker in a child process serving ``spec``'s
    rooms; yields (decode manager, spec with its bootstrap address, decode pool) and checks
    that the prefill process exited cleanly (its printed lines are added to ``output``)."""
    import dataclasses

    from asynckv import BootstrapServer
    from asynckv.testing import PeerProcess

    pool = spec.pool()
    async with BootstrapServer("127.0.0.1", 0) as server:
        spec = dataclasses.replace(spec, bootstrap=server.addr)
        async with PeerProcess.start_ctx("prefill", spec) as prefill:
            async with KVManager(Mode.DECODE, pool.kv_args(spec.page_size), config=Config()) as d:
                await d.prefill_instance(server.addr)
                yield d, spec, pool
            code = await prefill.wait(60)
            printed = await prefill.output()
            if code != 0:
                raise RuntimeError(printed)
            if output is not None:
                output.extend(printed.splitlines())


async def receive_plan(d: KVManager, spec: Any, dst_for: Any) -> tuple[list[float], float]:
    """Receive every room of ``spec`` with ``spec.inflight`` in flight; slot k's pages are
    ``dst_for(k)``. Returns each room's init-to-Success latency and the total seconds."""
    gate = asyncio.Semaphore(spec.inflight)
    free = list(range(spec.inflight))
    latencies: list[float] = []

    async def one(room_id: int) -> None:
        async with gate:
            k = free.pop()
            receiver = d.receiver(spec.bootstrap, room_id)
            t = time.perf_counter()
            await receiver.init(dst_for(k), k)
            if await receiver.wait() != KVPoll.Success:
                raise RuntimeError(receiver.failure_reason)
            latencies.append(time.perf_counter() - t)
            receiver.clear()
            free.append(k)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(r.room) for r in spec.plan()))
    return latencies, time.perf_counter() - t0
