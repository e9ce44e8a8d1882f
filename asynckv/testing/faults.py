"""Fault injection for the data plane, for faults that cannot be produced for real.

    injector = FaultInjector()
    inject(manager, injector)    # wraps the started manager's data plane
    injector.fail_next(1)        # the next write (or first-contact warm-up) fails with TransportError
    injector.stall_next(1)       # the next write never completes: only a cancel, its lease or deadline end it
    injector.delay_posts(0.05)   # every write waits 50 ms before it reaches the data plane

Real faults (a dead or frozen process) come from ``PeerProcess.kill()`` / ``stop()``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Sequence
from typing import Any

from ..errors import PeerUnreachable, TransferTimeout, TransportError
from ..transport.base import U64, DataPlane, MemoryLayout, Settled, Write

__all__ = ["FaultInjector", "inject"]


@dataclasses.dataclass(eq=False)
class _Held:
    peer: str
    deadline: float
    handle: asyncio.TimerHandle | None = None
    write: Write | None = None
    timeout_s: float = 0.0


class FaultInjector:
    """A ``DataPlane`` wrapper that fails, stalls or delays writes before they reach the real one."""

    def __init__(self) -> None:
        self._inner: DataPlane | None = None
        self._fail = 0
        self._stall = 0
        self._delay_s = 0.0
        self._held: dict[int, _Held] = {}
        self._leases: dict[str, float] = {}
        self.on_settled: Settled = lambda batch: None
        self.seen: list[str] = []

    # -- configuring ----------------------------------------------------------------------

    def fail_next(self, n: int = 1) -> None:
        self._fail += n

    def stall_next(self, n: int = 1) -> None:
        self._stall += n

    def delay_posts(self, seconds: float) -> None:
        self._delay_s = seconds

    def wrap(self, inner: DataPlane) -> FaultInjector:
        self._inner = inner
        inner.on_settled = lambda batch: self.on_settled(batch)
        return self

    @property
    def inner(self) -> DataPlane:
        if self._inner is None:
            raise RuntimeError("FaultInjector wraps no data plane yet (use inject())")
        return self._inner

    # -- DataPlane -------------------------------------------------------------------------

    def take_in_flight(self, post_id: int) -> bool:
        return self.inner.take_in_flight(post_id)

    @property
    def alive(self) -> bool:
        return self.inner.alive

    @property
    def posts_in_flight(self) -> int:
        return self.inner.posts_in_flight + len(self._held)

    async def start(self, memory: MemoryLayout) -> bytes:
        return await self.inner.start(memory)

    async def connect_peer(self, peer: str, metadata: bytes, rows: U64 | None, mem_kind: str) -> None:
        await self.inner.connect_peer(peer, metadata, rows, mem_kind)

    async def warm_up(self, peer: str, dst: tuple[int, int], timeout_s: float) -> None:
        self.seen.append("warm-up")
        if self._fail:
            self._fail -= 1
            raise TransportError("warm-up: injected failure")
        await self.inner.warm_up(peer, dst, timeout_s)

    def post(self, post_id: int, peer: str, write: Write, timeout_s: float) -> None:
        self.seen.append(f"post {post_id}")
        loop = asyncio.get_running_loop()
        if self._fail:
            self._fail -= 1
            failed: list[tuple[int, BaseException | None]] = [(post_id, TransportError(
                f"post {post_id}: injected failure"))]
            loop.call_soon(self.on_settled, failed)
            return
        held = _Held(peer, time.monotonic() + timeout_s)
        if self._stall:  # in flight forever: a cancel, the lease or the deadline settles it
            self._stall -= 1
            self._held[post_id] = held
            held.handle = loop.call_later(0.01, self._check_stalled, post_id)
            return
        if self._delay_s:
            held.write, held.timeout_s = write, timeout_s
            self._held[post_id] = held
            held.handle = loop.call_later(self._delay_s, self._release, post_id)
            return
        self.inner.post(post_id, peer, write, timeout_s)

    def _release(self, post_id: int) -> None:
        held = self._held.pop(post_id, None)
        if held is not None and held.write is not None:
            self.inner.post(post_id, held.peer, held.write, held.timeout_s)

    def _check_stalled(self, post_id: int) -> None:
        held = self._held.get(post_id)
        if held is None:
            return
        now = time.monotonic()
        if now >= self._leases.get(held.peer, float("-inf")):
            self._settle(post_id, TransferTimeout(f"post {post_id}: the write lease on the peer expired"))
        elif now >= held.deadline:
            self._settle(post_id, TransferTimeout(f"post {post_id}: not done (stalled by the fault injector)"))
        else:
            held.handle = asyncio.get_running_loop().call_later(0.01, self._check_stalled, post_id)

    def _settle(self, post_id: int, error: BaseException) -> None:
        held = self._held.pop(post_id, None)
        if held is None:
            return
        if held.handle is not None:
            held.handle.cancel()
        self.on_settled([(post_id, error)])

    def cancel(self, post_ids: Sequence[int], reason: BaseException) -> None:
        rest = []
        for post_id in post_ids:
            if post_id in self._held:
                self._settle(post_id, reason)
            else:
                rest.append(post_id)
        if rest:
            self.inner.cancel(rest, reason)

    def set_lease(self, peer: str, until: float) -> None:
        self._leases[peer] = until
        self.inner.set_lease(peer, until)

    def forget_peer(self, peer: str) -> None:
        for post_id in [i for i, h in self._held.items() if h.peer == peer]:
            self._settle(post_id, PeerUnreachable(f"peer {peer[:8]} forgotten"))
        self._leases.pop(peer, None)
        self.inner.forget_peer(peer)

    async def close(self) -> None:
        for post_id in list(self._held):
            self._settle(post_id, TransportError("data plane closed"))
        await self.inner.close()


def inject(manager: Any, injector: FaultInjector | None) -> None:
    """Wrap a started KVManager's data plane with ``injector`` (None: unwrap it again)."""
    current = manager.data_plane
    if injector is None:
        if isinstance(current, FaultInjector):
            manager.use_data_plane(current.inner)
        return
    manager.use_data_plane(injector.wrap(current))
