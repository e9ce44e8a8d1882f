"""The prefill pump: runs a ``PrefillCore``'s actions against the data plane and the senders."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable
from typing import Any

from ..config import Config
from ..errors import AsyncKVError, ClosedError
from ..proto import actions as act
from ..proto.destinations import CheckDestination
from ..proto.prefill import PrefillCore
from ..proto.sender import DecodePeer, PeerPhase, SenderRoom
from ..transport.base import ControlPlane, DataPlane, Write
from . import metrics
from .pump import Pump, wait_out
from .sender import KVSender
from .writes import GATHER_INLINE_BYTES, WriteBuilder

__all__ = ["PrefillService"]

log = logging.getLogger("asynckv.prefill")


class PrefillService(Pump):
    mode = "prefill"

    def __init__(self, core: PrefillCore, control: ControlPlane, data: DataPlane, builder: WriteBuilder,
                 config: Config, labels: tuple[str, str], clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(core, control, labels, clock)
        self.core: PrefillCore = core
        self.data = data
        self.builder = builder
        self.config = config
        self.views: dict[SenderRoom, KVSender] = {}
        self._building: dict[int, BaseException | None] = {}
        """Posts whose descriptors are being built off the loop (-> the cancel that came meanwhile)."""
        self._posted: dict[int, tuple[str, str, int, float, bool]] = {}
        """post id -> (peer, kind, bytes, monotonic time handed to the data plane, carries the aux row),
        for metrics."""
        self._build_pool = concurrent.futures.ThreadPoolExecutor(config.build_threads, "asynckv-build")
        """Where large writes are built (descriptor math, staging gathers): at most ``build_threads`` at once."""
        self._connect_slots = asyncio.Semaphore(config.max_connecting_peers)
        """Registrations that build their destination rows and connect at once; the rest wait, in order."""
        data.on_settled = self._on_settled
        self.handlers.update({
            act.Post: self._on_post, act.CancelPosts: self._on_cancel, act.SetLease: self._on_lease,
            act.ConnectPeer: self._on_connect, act.DisconnectPeer: self._on_disconnect,
            act.RoomReady: self._on_ready, act.ChunkPosted: self._on_chunk, act.Finished: self._on_finished,
            CheckDestination: self._on_check,
        })

    def use_data_plane(self, data: DataPlane) -> None:
        self.data = data
        data.on_settled = self._on_settled

    def open(self, room: int) -> KVSender:
        sender = KVSender(self, self.feed("open_sender", room))
        self.views[sender.state] = sender
        return sender

    def forget_view(self, sender: KVSender) -> None:
        self.views.pop(sender.state, None)

    # -- writes --------------------------------------------------------------------------

    def _on_post(self, a: act.Post) -> None:
        b = self.builder
        if b.descriptor_count(a) < self.config.offload_min_descs and b.gather_bytes(a) <= GATHER_INLINE_BYTES:
            try:
                write = self.builder.build(a)
            except Exception as exc:
                self.feed("post_settled", a.post_id, exc)
                return
            self._submit(a, write)
            return
        self._building[a.post_id] = None  # large: its descriptor math runs on a worker thread
        self.spawn(self._build_off_loop(a), "asynckv-build", lambda: self._build_cancelled(a))

    def _build_cancelled(self, a: act.Post) -> None:
        """Never posted: it settles failed (the thread building it had ended, ``_build_off_loop``)."""
        self._building.pop(a.post_id, None)
        self.builder.release(a.post_id)
        self.feed("post_settled", a.post_id, ClosedError("the write was cancelled while its descriptors were built"))

    async def _build_off_loop(self, a: act.Post) -> None:
        try:  # (a pool already shut down, the service closing, refuses the build: it settles failed)
            building = self.loop.run_in_executor(self._build_pool, self.builder.build, a)
            write: Write | None = await asyncio.shield(building)
            error: BaseException | None = None
        except asyncio.CancelledError:  # (close, a cancel-all) a thread cannot be stopped: wait until it no
            await wait_out(building)  # longer reads our KV, whose owner may free it once close returns
            self.builder.release(a.post_id)
            raise
        except Exception as exc:
            write, error = None, exc
        cancelled = self._building.pop(a.post_id, None)
        if cancelled is not None or write is None:  # cancelled while it was being built: never posted
            self.builder.release(a.post_id)
            self.feed("post_settled", a.post_id, cancelled or error)
            return
        self._submit(a, write)

    def _submit(self, a: act.Post, write: Write) -> None:
        self._posted[a.post_id] = (a.peer, a.kind, write.nbytes, self.clock(), a.aux is not None)
        metrics.child(metrics.DESCRIPTORS, *self.labels, a.peer[:8]).observe(write.descriptors)
        self.data.post(a.post_id, a.peer, write, a.timeout_s)

    def _on_cancel(self, a: act.CancelPosts) -> None:
        handed = []
        for post_id in a.post_ids:
            if post_id in self._building:
                self._building[post_id] = a.reason
            else:
                handed.append(post_id)
        if handed:
            self.data.cancel(handed, a.reason)

    def _on_settled(self, batch: list[tuple[int, BaseException | None]]) -> None:
        now = self.clock()
        for post_id, error in batch:
            self.builder.release(post_id, self.data.take_in_flight(post_id))
            info = self._posted.pop(post_id, None)
            if info is None:
                continue
            peer, kind, nbytes, started, with_aux = info
            labels = (*self.labels, peer[:8])
            if error is None:
                metrics.child(metrics.TRANSFER_SECONDS, *labels).observe(now - started)
                if with_aux:  # (an aux row that rode on a KV post still counts as an aux write)
                    nbytes -= self.builder.aux_row_bytes
                    metrics.child(metrics.TRANSFER_BYTES, *labels, "aux").inc(self.builder.aux_row_bytes)
                    metrics.child(metrics.TRANSFERS, *labels, "aux").inc()
                metrics.child(metrics.TRANSFER_BYTES, *labels, kind).inc(nbytes)
                metrics.child(metrics.TRANSFERS, *labels, kind).inc()
            else:
                metrics.child(metrics.TRANSFER_FAILURES, *labels, type(error).__name__).inc()
        self.feed_each("post_settled", batch)

    def _on_lease(self, a: act.SetLease) -> None:
        self.data.set_lease(a.peer, a.until)

    async def close(self, timeout_s: float) -> None:
        try:
            await super().close(timeout_s)
        finally:  # (also when the close is cancelled: a build still running then ends its thread after it)
            self._build_pool.shutdown(wait=False)

    # -- destinations ----------------------------------------------------------------------

    def _on_check(self, a: CheckDestination) -> None:
        self.spawn(self._check_off_loop(a), "asynckv-check",
                   lambda: self.feed("destination_checked", a.token, "its destination check was cancelled"))

    async def _check_off_loop(self, a: CheckDestination) -> None:
        """A large destination's index check, on a worker thread (the core holds that peer's later
        messages until it answers, so their order is kept)."""
        try:
            reason = await asyncio.to_thread(a.run)
        except Exception as exc:  # a bug must not wedge the peer: its messages wait for this answer
            log.exception("checking a destination of room %d failed", a.info.room)
            reason = f"destination check failed: {exc!r}"
        self.feed("destination_checked", a.token, reason)

    # -- peers ---------------------------------------------------------------------------

    def _on_connect(self, a: act.ConnectPeer) -> None:
        self.spawn(self._connect(a.peer), f"asynckv-connect-{a.peer.name[:8]}", lambda: self._connect_cancelled(a.peer))

    def _connect_cancelled(self, peer: DecodePeer) -> None:
        """Refused as a failed connect is (the thread preparing its rows had ended, ``_connect``)."""
        self.builder.remove_peer(peer.name)
        self.data.forget_peer(peer.name)  # (a connect the engine took goes on: this undoes it after)
        self.feed("peer_connected", peer, ClosedError(f"connecting decode peer {peer.name[:8]} was cancelled"))

    async def _connect(self, peer: DecodePeer) -> None:
        """Import the peer and prepare its destination (off the loop, at most
        ``max_connecting_peers`` at once: the rows are the memory a registration costs), then warm
        the connection up."""
        reg = peer.reg
        try:
            async with self._connect_slots:  # FIFO: registrations connect in the order they came
                if peer.phase is PeerPhase.DRAINING:  # dropped while it waited: build nothing
                    raise ClosedError(f"decode peer {peer.name[:8]} dropped before it connected")
                adding = self.loop.run_in_executor(None, self.builder.add_peer, peer)  # (a future: no cancel-all
                try:  # reaches it)
                    rows = await asyncio.shield(adding)
                except asyncio.CancelledError:  # the thread goes on: let it end, or its rows would be added
                    await wait_out(adding)  # after the answer for this cancel removed the peer's
                    raise
                await self.data.connect_peer(peer.name, reg.agent_metadata, rows, reg.mem_kind)
                del rows
            try:
                if reg.scratch_len:  # (a stock SGLang decode registers no scratch area: its first write warms up)
                    await self.data.warm_up(peer.name, (reg.scratch_ptr, reg.scratch_len),
                                            self.config.handshake_timeout_s)
            except BaseException:
                self.data.forget_peer(peer.name)
                raise
        except Exception as exc:  # any failure refuses this peer; it never kills the manager
            if not isinstance(exc, AsyncKVError):
                log.exception("setting up decode peer %s failed", peer.name[:8])
            self.builder.remove_peer(peer.name)
            # Its traceback's frames hold the rows (hundreds of MiB for a large claim): the core needs the reason.
            self.feed("peer_connected", peer, exc.with_traceback(None))
            return
        self.feed("peer_connected", peer, None)

    def _on_disconnect(self, a: act.DisconnectPeer) -> None:
        self.builder.remove_peer(a.peer)
        self.data.forget_peer(a.peer)

    # -- rooms ---------------------------------------------------------------------------

    def _view(self, room: SenderRoom) -> KVSender | None:
        return self.views.get(room)

    def _on_ready(self, a: act.RoomReady) -> None:
        view = self._view(a.room)
        if view is not None:
            view.ready_changed()

    def _on_chunk(self, a: act.ChunkPosted) -> None:
        view = self._view(a.room)
        if view is not None:
            view.chunk_posted(a.chunk)

    def _on_finished(self, a: act.Finished) -> None:
        room = a.room
        if isinstance(room, SenderRoom):
            peer = next(iter(room.destinations), "")[:8]
            self.room_finished(room, peer)
            view = self._view(room)
            if view is not None:
                view.finished()

    # -- introspection -------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        snap = self.core.snapshot(self.clock())
        snap["tables"]["building"] = len(self._building)
        staging = self.builder.staging
        if staging is not None:
            snap["staging"] = {"capacity_bytes": staging.capacity, "held_bytes": staging.capacity - staging.free_bytes}
        return snap
