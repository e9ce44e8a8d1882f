"""The bare pair: the least a connector must do per room on this host, as Q3's baseline.

Two processes on uvloop, as Q3's decode and prefill: per room, decode sends one small control
message over a TCP stream (room id and its page ids), prefill posts one NIXL WRITE of the room's
pages (prepared dlists, as asynckv posts them) and, once it is DONE, sends one small message back,
and decode resolves the room's future. No registration sessions, leases, fencing, validation,
metrics, timers, API objects or engine threads: NIXL is called from the loop thread. Both sides
count their CPU seconds the way Q3 does (process time over the timed rooms).

``python -m benchmarks._bare prefill PORT`` is the prefill process; ``run_decode`` the decode side.
"""

from __future__ import annotations

import asyncio
import json
import struct
import subprocess
import sys
import time
from typing import Any

import numpy as np

from asynckv.testing import KVPool

ROOM = struct.Struct("<Q4i")
"""Decode -> prefill, per room: the room id and its 4 decode pages."""
DONE = struct.Struct("<Q")
"""Prefill -> decode, per room: the room id, every byte written."""
HELLO = struct.Struct("<III")
"""Decode -> prefill, once: metadata length, pages per entry, entries; then the metadata and the
decode's entry base addresses (u64 each)."""
PAGES = 4


def _pool(inflight: int, fill: int) -> KVPool:
    pool = KVPool(2, inflight * PAGES, 32 * 1024, aux_rows=1)  # Q3's geometry: 1 layer, K and V, 32 KiB pages
    pool.kv.fill(fill)  # (also faults the pages in before the timed rooms)
    return pool


def _agent(name: str) -> Any:
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False,
                                              backends=["UCX"]))


def _rows(bases: list[int], pages: int, item: int) -> np.ndarray:
    rows = np.empty((len(bases) * pages, 3), dtype=np.uint64)
    base = np.asarray(bases, dtype=np.uint64)
    rows[:, 0] = (base[:, None] + np.uint64(item) * np.arange(pages, dtype=np.uint64)).ravel()
    rows[:, 1] = item
    rows[:, 2] = 0
    return rows


class _Prefill(asyncio.Protocol):
    def __init__(self, pool: KVPool, done: asyncio.Future[None]) -> None:
        self.pool, self.done = pool, done
        self.agent = _agent("bare-prefill")
        self.agent.register_memory([(int(pool.kv[e].ctypes.data), int(pool.kv[e].nbytes), 0, "")
                                    for e in range(pool.entries)], "DRAM")
        self.local = self.agent.prep_xfer_dlist("", _rows([int(pool.kv[e].ctypes.data) for e in range(pool.entries)],
                                                          pool.num_pages, pool.item_bytes), "DRAM")
        self.buf = bytearray()
        self.remote: Any = None
        self.bases = np.arange(pool.entries, dtype=np.int32)[:, None] * pool.num_pages
        self.pending: list[tuple[Any, int]] = []
        self.polling = False
        self.cpu0 = 0.0

    def connection_made(self, transport: Any) -> None:
        self.t = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self.remote is None and not self._hello():
            return
        out = []
        n = len(self.buf) // ROOM.size * ROOM.size
        for room, *pages in ROOM.iter_unpack(memoryview(self.buf)[:n]):
            idx = (self.bases + np.asarray(pages, dtype=np.int32)[None, :]).ravel()
            h = self.agent.make_prepped_xfer("WRITE", self.local, idx, self.remote, idx, b"")
            if self.agent.transfer(h) == "DONE":
                self.agent.release_xfer_handle(h)
                out.append(DONE.pack(room))
            else:
                self.pending.append((h, room))
        del self.buf[:n]
        if out:
            self.t.write(b"".join(out))
        if self.pending and not self.polling:
            self.polling = True
            asyncio.get_running_loop().call_soon(self._poll)

    def _hello(self) -> bool:
        if len(self.buf) < HELLO.size:
            return False
        size, pages, entries = HELLO.unpack_from(self.buf)
        end = HELLO.size + size + 8 * entries
        if len(self.buf) < end:
            return False
        meta = bytes(self.buf[HELLO.size:HELLO.size + size])
        bases = list(struct.unpack_from(f"<{entries}Q", self.buf, HELLO.size + size))
        name = self.agent.add_remote_agent(meta)
        self.remote = self.agent.prep_xfer_dlist(name, _rows(bases, pages, self.pool.item_bytes), "DRAM")
        del self.buf[:end]
        self.t.write(b"R")
        self.cpu0 = time.process_time()
        return True

    def _poll(self) -> None:
        out, keep = [], []
        for h, room in self.pending:
            state = self.agent.check_xfer_state(h)
            if state == "DONE":
                self.agent.release_xfer_handle(h)
                out.append(DONE.pack(room))
            elif state == "ERR":
                raise RuntimeError(f"bare pair: the write of room {room} failed")
            else:
                keep.append((h, room))
        self.pending = keep
        if out:
            self.t.write(b"".join(out))
        if keep:
            asyncio.get_running_loop().call_soon(self._poll)
        else:
            self.polling = False

    def connection_lost(self, exc: BaseException | None) -> None:
        if not self.done.done():
            self.done.set_result(None)


async def _serve(port: int, inflight: int) -> None:
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    pool = _pool(inflight, 7)
    protos: list[_Prefill] = []

    def make() -> _Prefill:
        protos.append(_Prefill(pool, done))
        return protos[-1]

    server = await loop.create_server(make, "127.0.0.1", port)
    print("LISTENING", server.sockets[0].getsockname()[1], flush=True)
    await done
    print("CPU " + json.dumps({"prefill_process_cpu_s": time.process_time() - protos[0].cpu0}), flush=True)
    server.close()


class _Decode(asyncio.Protocol):
    def __init__(self, waiting: dict[int, asyncio.Future[None]], ready: asyncio.Future[None]) -> None:
        self.waiting, self.ready, self.buf = waiting, ready, bytearray()

    def connection_made(self, transport: Any) -> None:
        self.t = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if not self.ready.done():
            if self.buf[:1] != b"R":
                return
            del self.buf[:1]
            self.ready.set_result(None)
        n = len(self.buf) // DONE.size * DONE.size
        for (room,) in DONE.iter_unpack(memoryview(self.buf)[:n]):
            self.waiting.pop(room).set_result(None)
        del self.buf[:n]


async def run_decode(rooms: int, inflight: int) -> dict[str, float]:
    """Q3's load over the bare pair: ``rooms`` rooms, ``inflight`` at once; rooms/s and CPU per room."""
    import uvloop  # noqa: F401  (the caller installed it)

    loop = asyncio.get_running_loop()
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks._bare", "prefill", "0", str(inflight)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = await loop.run_in_executor(None, proc.stdout.readline)
        port = int(line.split()[1])
        pool = _pool(inflight, 0)
        agent = _agent("bare-decode")
        agent.register_memory([(int(pool.kv[e].ctypes.data), int(pool.kv[e].nbytes), 0, "")
                               for e in range(pool.entries)], "DRAM")
        meta = agent.get_agent_metadata()
        waiting: dict[int, asyncio.Future[None]] = {}
        ready: asyncio.Future[None] = loop.create_future()
        transport, _ = await loop.create_connection(lambda: _Decode(waiting, ready), "127.0.0.1", port)
        transport.write(HELLO.pack(len(meta), pool.num_pages, pool.entries) + meta
                        + struct.pack(f"<{pool.entries}Q", *(int(pool.kv[e].ctypes.data) for e in range(pool.entries))))
        await ready
        slots = [np.arange(PAGES, dtype=np.int32) + PAGES * k for k in range(inflight)]
        progress = loop.call_later(0.001, lambda: None)

        def progress_target() -> None:  # the target's agent is progressed as asynckv's decode engine does (1 ms)
            nonlocal progress
            agent.get_new_notifs()
            progress = loop.call_later(0.001, progress_target)

        progress_target()
        it = iter(range(1, rooms + 1))

        async def worker(k: int) -> None:
            for room in it:
                fut = waiting[room] = loop.create_future()
                transport.write(ROOM.pack(room, *slots[k].tolist()))
                await fut

        cpu0, t0 = time.process_time(), time.perf_counter()
        await asyncio.gather(*(worker(k) for k in range(inflight)))
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        progress.cancel()
        transport.close()
        out, _ = await loop.run_in_executor(None, proc.communicate)
        prefill = json.loads(next(x for x in out.splitlines() if x.startswith("CPU "))[4:])
        if not (pool.kv[:, :min(rooms, inflight) * PAGES] == 7).all():  # every slot used was written
            raise RuntimeError("bare pair: some decode pages were never written")
        return {"rooms": rooms, "inflight": inflight, "rooms_per_s": rooms / elapsed,
                "decode_process_cpu_ms_per_room": cpu / rooms * 1e3,
                "prefill_process_cpu_ms_per_room": prefill["prefill_process_cpu_s"] / rooms * 1e3}
    finally:
        if proc.poll() is None:
            proc.kill()


if __name__ == "__main__":
    if sys.argv[1] == "prefill":
        import uvloop

        uvloop.install()
        asyncio.run(_serve(int(sys.argv[2]), int(sys.argv[3])))
