"""In-process prefill/decode pairs and a minimal raw-NIXL loop: the two sides of most comparisons."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np

from asynckv import Config, KVManager, KVPoll, Mode
from asynckv.demo import bounded
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
               chunk: int | None = None, from_send: list[float] | None = None) -> float:
    """One request end to end; seconds from receiver.init() to receiver.wait() resolving. With
    ``from_send``, also appends the seconds from the first send() (the destination known, as when
    it arrived while prefill computed) to receiver.wait() resolving."""
    t0 = time.perf_counter()
    receiver = d.receiver(p.bootstrap_addr or "", room_id)
    await receiver.init(dst)
    sender = p.sender(room_id)
    await sender.wait_ready()
    sender.init(len(src))
    step = chunk or max(len(src), 1)
    t_send = time.perf_counter()
    for i in range(0, max(len(src), 1), step):
        await sender.send(src[i:i + step])
    result = await receiver.wait()
    elapsed = time.perf_counter() - t0
    if from_send is not None:
        from_send.append(time.perf_counter() - t_send)
    if result != KVPoll.Success or await sender.wait() != KVPoll.Success:
        raise RuntimeError(f"room {room_id} failed: {receiver.failure_reason} / {sender.failure_reason}")
    sender.clear()
    receiver.clear()
    return elapsed


class RawNixl:
    """Bare NIXL agents over the same buffers: prepared dlists, one WRITE per request, the
    target progressed from the same thread. The floor asynckv is measured against. With
    ``initiators=2`` a second writing agent (its own registrations and dlists) lets
    ``write_parallel`` post from two threads at once, one agent each: raw NIXL's fastest
    configuration on this kind of host, where the posting thread does the copy."""

    def __init__(self, src: KVPool, dst: KVPool, initiators: int = 1) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        cfg = nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        self.b = nixl_agent("raw-b", cfg)
        self.regs = [(self.b, self.b.register_memory(self._regions(dst), "DRAM"))]
        self.writers: list[tuple[Any, Any, Any]] = []
        """(agent, local dlist, remote dlist) per initiator."""
        for i in range(initiators):
            agent = nixl_agent("raw-a" if i == 0 else f"raw-a{i}", cfg)
            self.regs.append((agent, agent.register_memory(self._regions(src), "DRAM")))
            agent.add_remote_agent(self.b.get_agent_metadata())
            self.writers.append((agent, agent.prep_xfer_dlist("", self._rows(src), "DRAM"),
                                 agent.prep_xfer_dlist("raw-b", self._rows(dst), "DRAM")))
        self.a, self.local, self.remote = self.writers[0]
        self.pages, self.entries = src.num_pages, src.entries
        for i in range(initiators):  # warm-up, as asynckv does on first contact (the target must progress)
            self._post(i, np.arange(1), np.arange(1), progress_target=True)

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
        idx: np.ndarray = (np.arange(self.entries)[:, None] * self.pages + pages[None, :]).astype(np.int32).ravel()
        return idx

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

    def _drain(self, writers: bool = False) -> int:
        """Progress the target (from one thread only), and with ``writers`` every initiator too (only
        while no other thread posts: a notification UCX could not send at once leaves with a later
        progress call of its writer); the notifications the target received."""
        for agent, _, _ in self.writers if writers else ():
            agent.get_new_notifs()
        return sum(len(msgs) for msgs in self.b.get_new_notifs().values())

    def _await_notifs(self, seen: int, expected: int) -> None:
        deadline = time.monotonic() + 30
        while seen < expected:
            if time.monotonic() > deadline:
                raise RuntimeError(f"raw NIXL: {seen} of {expected} notifications arrived in 30 s")
            seen += self._drain(writers=True)

    def _post(self, writer: int, src: np.ndarray, dst: np.ndarray, progress_target: bool = False,
              notif: bytes = b"") -> int:
        """One WRITE (with ``notif`` as its notification, if any) from initiator ``writer`` (its
        thread only; the target is progressed only with ``progress_target``, from one thread:
        connection set-up needs it). Returns the notifications the target received meanwhile."""
        agent, local, remote = self.writers[writer]
        h = agent.make_prepped_xfer("WRITE", local, self._idx(src), remote, self._idx(dst), notif)
        state = agent.transfer(h)
        seen = 0
        while state != "DONE":
            if state == "ERR":
                raise RuntimeError(f"raw NIXL: a WRITE from initiator {writer} failed")
            if progress_target:
                seen += self._drain()
            state = agent.check_xfer_state(h)
        agent.release_xfer_handle(h)
        return seen

    def write_serial(self, sets: list[tuple[np.ndarray, np.ndarray]], notify: bool = False) -> float:
        """Seconds to post ``sets`` back to back from the first initiator, this thread progressing
        the target too, until (with ``notify``) the target has seen every write's notification."""
        t0 = time.perf_counter()
        seen = sum(self._post(0, s, d, progress_target=True, notif=b"n" if notify else b"") for s, d in sets)
        self._await_notifs(seen, len(sets) if notify else 0)
        return time.perf_counter() - t0

    def write_parallel(self, sets: list[tuple[np.ndarray, np.ndarray]], notify: bool = False) -> float:
        """Seconds to post ``sets`` (src, dst) spread over the initiators, one thread each, while
        this thread progresses the target (some transfers stalled without it) every 50 us, until
        (with ``notify``) the target has seen every write's notification. (It used to poll without
        pause: that thread then took a core and the GIL from the posting threads, and 4 x 16 MiB
        scattered ran 2.2-3.1 GB/s against 3.6-4.2 with the pause.)"""
        import threading

        n = len(self.writers)
        notif = b"n" if notify else b""
        threads = [threading.Thread(target=lambda i=i: [self._post(i, s, d, notif=notif) for s, d in sets[i::n]])
                   for i in range(n)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        seen = 0
        while any(t.is_alive() for t in threads):  # the target progresses here, its one thread
            seen += self._drain()
            time.sleep(50e-6)
        for t in threads:
            t.join()
        self._await_notifs(seen, len(sets) if notify else 0)
        return time.perf_counter() - t0

    def close(self) -> None:
        for agent, local, remote in self.writers:
            agent.release_dlist_handle(local)
            agent.release_dlist_handle(remote)
            agent.remove_remote_agent("raw-b")
        for agent, reg in self.regs:
            agent.deregister_memory(reg)


def run(coro: Any, loop: str = "asyncio") -> Any:
    """Run ``coro`` to completion on a fresh event loop: ``"asyncio"``'s own or ``"uvloop"``."""
    if loop == "uvloop":
        import uvloop

        return uvloop.run(coro)
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
            async with KVManager(Mode.DECODE, pool.kv_args(spec.page_size), config=Config.from_env()) as d:
                await d.prefill_instance(server.addr)
                yield d, spec, pool
            code = await prefill.wait(60)
            printed = await prefill.output()
            if code != 0:
                raise RuntimeError(printed)
            if output is not None:
                output.extend(printed.splitlines())


async def receive_plan(d: KVManager, spec: Any, dst_for: Any,
                       started: Callable[[], None] | None = None) -> tuple[list[float], float]:
    """Receive every room of ``spec`` with ``spec.inflight`` in flight; slot k's pages are
    ``dst_for(k)``. Returns each room's init-to-Success latency and the total seconds. The plan's
    first ``spec.warmup`` rooms are received one at a time before the timing starts (``started()``
    is called when it does)."""
    free = list(range(spec.inflight))
    latencies: list[float] = []
    plan = spec.plan()

    async def one(req: Any) -> None:
        k = free.pop()
        receiver = d.receiver(spec.bootstrap, req.room)
        t = time.perf_counter()
        await receiver.init(dst_for(k), k)
        if await receiver.wait() != KVPoll.Success:
            raise RuntimeError(receiver.failure_reason)
        latencies.append(time.perf_counter() - t)
        receiver.clear()
        free.append(k)

    for req in plan[:spec.warmup]:
        await one(req)
    latencies.clear()
    if started is not None:
        started()
    t0 = time.perf_counter()
    await bounded(plan[spec.warmup:], spec.inflight, one)
    return latencies, time.perf_counter() - t0
