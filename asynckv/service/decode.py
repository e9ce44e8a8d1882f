"""The decode pump: runs a ``DecodeCore``'s actions (topology look-ups, receivers' futures)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable
from typing import Any

from ..config import Config
from ..errors import AsyncKVError, ClosedError
from ..proto import actions as act
from ..proto.decode import DecodeCore
from ..proto.receiver import ReceiverRoom
from ..proto.topology import PrefillInstance
from ..transport.base import ControlPlane
from .bootstrap import BootstrapClient
from .decode_staging import SCATTER_INLINE_BYTES, DecodeStaging
from .pump import Pump, wait_out
from .receiver import KVReceiver

__all__ = ["DecodeService", "ReceiverPump"]


class ReceiverPump(Pump):
    """What every decode pump shares: the receivers' views and their futures."""

    mode = "decode"

    def __init__(self, core: Any, control: ControlPlane, labels: tuple[str, str],
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(core, control, labels, clock)
        self.views: dict[ReceiverRoom, KVReceiver] = {}
        self.handlers.update({act.InitDone: self._on_init_done, act.Finished: self._on_finished})

    def open(self, addr: str, room: int) -> KVReceiver:
        receiver = KVReceiver(self, self.feed("open_receiver", addr, room), addr)
        self.views[receiver.state] = receiver
        return receiver

    def forget_view(self, receiver: KVReceiver) -> None:
        self.views.pop(receiver.state, None)

    def _on_init_done(self, a: act.InitDone) -> None:
        view = self.views.get(a.room)
        if view is not None:
            view.init_done()

    def _on_finished(self, a: act.Finished) -> None:
        room = a.room
        if isinstance(room, ReceiverRoom):
            self.room_finished(room, room.addr)
            view = self.views.get(room)
            if view is not None:
                view.finished()

    def snapshot(self) -> dict[str, Any]:
        snap: dict[str, Any] = self.core.snapshot(self.clock())
        return snap


class DecodeService(ReceiverPump):
    def __init__(self, core: DecodeCore, control: ControlPlane, http: BootstrapClient, config: Config,
                 labels: tuple[str, str], clock: Callable[[], float] = time.monotonic,
                 staging: DecodeStaging | None = None) -> None:
        super().__init__(core, control, labels, clock)
        self.core: DecodeCore = core
        self.http = http
        self.config = config
        self.staging = staging
        """The staging area the core's ``Scatter`` actions copy out of (``decode_staging``)."""
        self._scatter_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.handlers.update({act.FetchTopology: self._on_fetch, act.Scatter: self._on_scatter})

    def snapshot(self) -> dict[str, Any]:
        snap = super().snapshot()
        staging = self.staging
        if staging is not None:  # (slots of all entries: bytes held by rooms, those waiting for slots)
            slot = int(staging.slot_items.sum())
            snap["staging"] = {"capacity_bytes": staging.slots * slot or staging.capacity,
                               "held_bytes": (staging.slots - staging.free_slots) * slot,
                               "waiting_rooms": snap["tables"]["waiting_for_staging"]}
        return snap

    async def instance(self, addr: str, connect: bool = False) -> PrefillInstance:
        """The topology of the prefill at ``addr`` (fetched once, then cached by the core); with
        ``connect``, registration with the ranks this rank's rooms write from starts now."""
        instance = self.core.instance(addr)
        if instance is None:
            instance = await self.http.fetch_instance(addr, self.config.handshake_timeout_s)
            if self.core.closing:  # (answered while the manager closed)
                raise ClosedError("KVManager closed during the look-up")
            refused = self.feed("topology_fetched", addr, instance)  # (the core checks it can pair)
            if refused is not None:
                raise refused
        if connect:
            self.feed("preconnect", addr)
        return instance

    def _on_scatter(self, a: act.Scatter) -> None:
        """Copy a room's staged slices into its pages: on the loop when small, else each prefill rank's
        slice on a worker thread (``build_threads`` of them); ``scattered`` either way."""
        staging = self.staging
        if staging is None or staging.nbytes(a.slices) <= SCATTER_INLINE_BYTES:
            error: BaseException | None = None
            try:
                if staging is None:
                    raise RuntimeError("no staging area to copy from")
                staging.scatter(a.room.pages, a.slices)
            except Exception as exc:
                error = exc
            self.feed("scattered", a.room, error)
            return
        if self._scatter_pool is None:
            self._scatter_pool = concurrent.futures.ThreadPoolExecutor(self.config.build_threads, "asynckv-scatter")
        self.spawn(self._scatter(staging, self._scatter_pool, a), "asynckv-scatter",  # (owed: after its copies ended)
                   lambda: self.feed("scattered", a.room, ClosedError("copying its staged slices was cancelled")))

    async def _scatter(self, staging: DecodeStaging, pool: concurrent.futures.Executor, a: act.Scatter) -> None:
        # Each rank's slice is a copy of its own (other bytes of the same pages), so they spread over the
        # threads: TP2 -> TP1 (bench_hetero_tp) went from 3.6-3.8 to 4.35-4.42 GB/s. Every copy ends
        # before the room's outcome (a failed one too: the others still write its pages).
        copying = asyncio.gather(*(self.loop.run_in_executor(pool, staging.scatter, a.room.pages, (part,))
                                   for part in a.slices), return_exceptions=True)
        try:
            results = await asyncio.shield(copying)
        except asyncio.CancelledError:  # (close gave up waiting, a cancel-all) the copies write our pages: they
            await wait_out(copying)  # end first, the room's outcome after
            raise
        error = next((r for r in results if isinstance(r, BaseException)), None)
        self.feed("scattered", a.room, error)

    async def close(self, timeout_s: float) -> None:
        try:
            await super().close(timeout_s)
        finally:
            if self._scatter_pool is not None:
                self._scatter_pool.shutdown(wait=False)

    def _on_fetch(self, a: act.FetchTopology) -> None:
        self.spawn(self._fetch(a.addr), f"asynckv-route-{a.addr}",
                   lambda: self.feed("topology_fetched", a.addr, ClosedError("the topology look-up was cancelled")))

    async def _fetch(self, addr: str) -> None:
        try:
            result: PrefillInstance | BaseException = await self.http.fetch_instance(
                addr, self.config.handshake_timeout_s)
        except AsyncKVError as exc:
            result = exc
        self.feed("topology_fetched", addr, result)
