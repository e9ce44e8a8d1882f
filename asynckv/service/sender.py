"""KVSender: the prefill side of one room."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from ..errors import (
    Aborted,
    AsyncKVError,
    BootstrapTimeout,
    InvalidArgument,
    LocalProtocolError,
    RemoteProtocolError,
)
from ..kernels import validate_pages
from ..proto.messages import TransferInfo
from ..proto.states import Event, KVPoll, RoomState, Side

if TYPE_CHECKING:
    from .manager import DecodePeer, KVManager

__all__ = ["KVSender"]

log = logging.getLogger("asynckv.sender")


class KVSender:
    """Sends one room's KV pages (in chunks) and aux row to the decode rank(s) that asked.

    Lifecycle: ``await wait_ready()`` → ``init(num_pages, aux_index)`` → ``await send(pages)``
    per chunk (the last chunk is the one that reaches ``num_pages``) → ``await wait()`` →
    ``clear()``.
    """

    def __init__(self, mgr: KVManager, room: int) -> None:
        self._mgr = mgr
        self.room = room
        self._state = RoomState(Side.SENDER)
        self._loop = mgr.loop
        self._done: asyncio.Future[KVPoll] = self._loop.create_future()
        self._ready: asyncio.Future[KVPoll] = self._loop.create_future()
        self._infos: dict[str, TransferInfo] = {}
        self._required: int | None = None
        self._num_pages: int | None = None
        self._aux_index = -1
        self._cursor = 0
        self._last_posted = False
        self._posts: set[asyncio.Future[Any]] = set()
        self._dead: set[str] = set()
        self._failure_to_report = False
        self._concluding = False
        self._cleared = False
        self._started: float | None = None
        self._timer: asyncio.TimerHandle | None = self._loop.call_later(
            mgr.config.bootstrap_timeout_s, self._on_bootstrap_timeout)

    # -- public --------------------------------------------------------------------

    def poll(self) -> KVPoll:
        """Current state, without blocking."""
        return self._state.state

    @property
    def failure_reason(self) -> str | None:
        return self._state.reason

    def failure_exception(self) -> BaseException | None:
        """The exception that failed the room, or None."""
        return self._state.exception

    async def wait_ready(self, timeout: float | None = None) -> KVPoll:
        """Wait until decode's destination is known (WaitingForInput) or the room failed."""
        return await asyncio.wait_for(asyncio.shield(self._ready), timeout)

    def init(self, num_pages: int, aux_index: int = -1) -> None:
        """Declare how many pages the room sends in total and which aux row carries its metadata."""
        if self._num_pages is not None:
            raise LocalProtocolError(f"room {self.room}: init() called twice")
        if type(num_pages) is not int or num_pages < 0:
            raise InvalidArgument(f"num_pages must be an int >= 0, got {num_pages!r}")
        rows = self._mgr.kv_args.num_aux_rows
        if aux_index != -1 and not 0 <= aux_index < rows:
            raise InvalidArgument(f"aux_index {aux_index} outside the registered aux rows [0, {rows})")
        self._num_pages = num_pages
        self._aux_index = int(aux_index)
        if self._state.state == KVPoll.WaitingForInput:
            self._check_destinations()

    @property
    def decode_prefix_len(self) -> int:
        """Tokens decode already holds (known once ready); send only the pages after them."""
        return max((info.decode_prefix_len for info in self._infos.values()), default=0)

    async def send(self, page_indices: Any, state_indices: Any = None) -> None:
        """Post one chunk: prefill page indices, the next slice of decode's destination.

        The chunk that reaches ``num_pages`` is the last; it also writes the aux row and the
        hybrid state (``state_indices``: the request's mamba slot, or its SWA/NSA pages).
        Returns once the chunk is handed to the data plane; ``wait()`` reports the outcome.
        A room that already failed ignores further chunks.
        """
        if self._state.state == KVPoll.Failed:
            return
        if self._num_pages is None:
            raise LocalProtocolError(f"room {self.room}: send() before init()")
        if self._state.state not in (KVPoll.WaitingForInput, KVPoll.Transferring):
            raise LocalProtocolError(f"room {self.room}: send() in state {self._state.state.name}")
        if self._last_posted:
            raise LocalProtocolError(f"room {self.room}: the last chunk was already sent")
        args = self._mgr.kv_args
        pages = validate_pages(page_indices, args.num_pages, "prefill page indices")
        n = len(pages)
        if self._cursor + n > self._num_pages:
            raise InvalidArgument(f"room {self.room}: chunk of {n} pages overruns num_pages={self._num_pages} "
                                  f"(already sent {self._cursor})")
        is_last = self._cursor + n == self._num_pages
        state = None
        if state_indices is not None:
            if not is_last:
                raise InvalidArgument(f"room {self.room}: state_indices go with the last chunk")
            state = validate_pages(state_indices, args.num_state_slots, "prefill state indices")
        start = self._cursor
        if self._started is None:
            self._started = self._loop.time()
        self._cursor += n
        self._last_posted = is_last
        self._state.apply(Event.CHUNK_POSTED)
        try:
            for name, info in self._infos.items():
                if info.is_dummy:
                    continue
                peer = self._mgr.peer(name)
                if peer is None:
                    raise RemoteProtocolError(f"decode peer {name[:8]} is no longer registered")
                if n:
                    await self._post_kv(peer, pages, info.dst_pages[start:start + n].astype(np.int64), start)
                if is_last:
                    await self._post_last(peer, info, state)
        except AsyncKVError as exc:
            self._fail(exc)
            return
        if is_last:
            self._maybe_conclude()

    async def _post_last(self, peer: DecodePeer, info: TransferInfo, state: npt.NDArray[np.int64] | None) -> None:
        """Aux row (one writer per destination) and hybrid state, with the last chunk."""
        if info.write_aux and self._aux_index >= 0 and info.aux_index >= 0:
            self._track(await self._mgr.post_aux(peer, self._aux_index, info.aux_index, f"room {self.room} aux"))
        plan = peer.plan.state
        if plan is None or len(info.dst_state_indices) == 0 or (plan.replicated and not info.write_aux):
            return
        if state is None or len(state) != len(info.dst_state_indices):
            got = "none" if state is None else len(state)
            raise InvalidArgument(f"room {self.room}: decode expects {len(info.dst_state_indices)} state "
                                  f"indices, the last chunk carried {got}")
        built = self._mgr.build_state(peer, state, info.dst_state_indices.astype(np.int64))
        if built is not None:
            build, nbytes, ndescs = built
            self._track(await self._mgr.post(peer, build, nbytes, f"room {self.room} state", kind="state",
                                             ndescs=ndescs))

    async def wait(self, timeout: float | None = None) -> KVPoll:
        """Wait for the room's outcome: Success or Failed (never raises for a failed transfer).

        Cancelling the waiting task does not abort the room.
        """
        if timeout is None:
            return await asyncio.shield(self._done)
        return await asyncio.wait_for(asyncio.shield(self._done), timeout)

    def abort(self, reason: str = "aborted by prefill") -> None:
        """Fail the room and tell decode at once."""
        self._fail(Aborted(reason))

    def clear(self) -> None:
        """Drop every per-room structure; aborts the room first if it is still running."""
        if self._cleared:
            return
        if not self._state.done:
            self.abort("cleared before completion")
        self._cleared = True
        self._cancel_timer()
        self._infos.clear()
        self._mgr._forget_sender(self.room)

    def __repr__(self) -> str:
        total = "?" if self._num_pages is None else self._num_pages
        return f"<KVSender room={self.room} {self._state.state.name} {self._cursor}/{total} pages>"

    # -- driven by the manager ----------------------------------------------------------

    def _on_destination(self, info: TransferInfo) -> None:
        if self._state.done or self._state.state != KVPoll.Bootstrapping:
            self._mgr._drop("late_info", f"room {self.room} destination in {self._state.state.name}")
            return
        peer = self._mgr.peer(info.decode_id)
        if peer is None:
            self._mgr._drop("unknown_peer", f"room {self.room} from unregistered {info.decode_id[:8]}")
            return
        try:
            validate_pages(info.dst_pages, peer.num_pages, "decode destination pages")
            validate_pages(info.dst_state_indices, peer.num_state_slots, "decode state indices")
            if info.aux_index != -1 and not 0 <= info.aux_index < peer.num_aux_rows:
                raise InvalidArgument(f"decode aux_index {info.aux_index} outside [0, {peer.num_aux_rows})")
            if info.required_dst_info_num < 1:
                raise InvalidArgument("required_dst_info_num must be >= 1")
            if info.decode_prefix_len % self._mgr.kv_args.page_size:
                raise InvalidArgument(f"decode_prefix_len {info.decode_prefix_len} is not a multiple of "
                                      f"page_size {self._mgr.kv_args.page_size}")
        except InvalidArgument as exc:
            self._infos[info.decode_id] = info  # so the failure reaches that decode
            self._fail(RemoteProtocolError(f"room {self.room}: {exc}"))
            return
        self._infos[info.decode_id] = info
        self._required = info.required_dst_info_num
        if len(self._infos) >= self._required:
            self._state.apply(Event.DESTINATION_RECEIVED)
            self._cancel_timer()
            if self._num_pages is not None:
                self._check_destinations()
            if not self._ready.done():
                self._ready.set_result(self._state.state)

    def _check_destinations(self) -> None:
        for info in self._infos.values():
            if not info.is_dummy and len(info.dst_pages) != self._num_pages:
                self._fail(InvalidArgument(
                    f"room {self.room}: decode expects {len(info.dst_pages)} pages, prefill will send "
                    f"{self._num_pages}"))
                return

    def _on_abort(self, decode_id: str, reason: str) -> None:
        if self._state.done and not self._posts:  # nothing in flight: confirm to that decode at once
            peer = self._mgr.peer(decode_id)
            if peer is not None:
                self._mgr.send_status(peer.endpoint, self.room, False, f"aborted by decode: {reason}")
            return
        self._fail(Aborted(f"aborted by decode: {reason}"))

    def _on_peer_dead(self, decode_id: str, exc: BaseException) -> None:
        if decode_id in self._infos:
            self._dead.add(decode_id)
            self._fail(exc)

    def _on_bootstrap_timeout(self) -> None:
        self._timer = None
        if self._state.state == KVPoll.Bootstrapping:
            self._fail(BootstrapTimeout(
                f"room {self.room}: no destination from decode after {self._mgr.config.bootstrap_timeout_s:.1f}s "
                f"({len(self._infos)}/{self._required or 1} decode ranks)"))

    # -- internals --------------------------------------------------------------------------

    async def _post_kv(self, peer: DecodePeer, src: npt.NDArray[np.int64], dst: npt.NDArray[np.int64],
                       start: int) -> None:
        mgr = self._mgr
        if len(src) * mgr.kv_args.num_entries >= mgr.config.offload_min_descs:
            build, ndescs = await asyncio.to_thread(mgr.build_kv, peer, src, dst)
        else:
            build, ndescs = mgr.build_kv(peer, src, dst)
        if self._state.done:
            return  # failed or aborted while the descriptors were being built
        self._track(await mgr.post(peer, build, len(src) * mgr.page_bytes,
                                   f"room {self.room} pages {start}..{start + len(src)}", ndescs=ndescs))

    def _track(self, fut: asyncio.Future[Any]) -> None:
        self._posts.add(fut)
        fut.add_done_callback(self._post_done)

    def _post_done(self, fut: asyncio.Future[Any]) -> None:
        self._posts.discard(fut)
        exc = fut.exception()
        if exc is not None:
            self._fail(exc)
        else:
            self._maybe_conclude()
        self._report_failure_when_quiet()

    def _maybe_conclude(self) -> None:
        if self._last_posted and not self._posts and not self._state.done and not self._concluding:
            self._concluding = True
            self._state.apply(Event.TRANSFER_COMPLETED)
            self._finish()
            self._notify(True, "")

    def _fail(self, exc: BaseException) -> None:
        """Fail the room: nothing more is posted, and once every write in flight has settled
        (landed, failed or been cancelled) decode is told, so it may reuse its pages."""
        if not self._state.fail(exc):
            return
        log.info("room %d failed: %s", self.room, self._state.reason)
        self._cancel_timer()
        self._finish()
        self._failure_to_report = True
        self._report_failure_when_quiet()

    def _report_failure_when_quiet(self) -> None:
        if self._failure_to_report and not self._posts:
            self._failure_to_report = False
            self._notify(False, self._state.reason or "failed")

    def _finish(self) -> None:
        seconds = None if self._started is None else self._loop.time() - self._started
        peer = next(iter(self._infos), "")[:8]
        self._mgr.room_finished(self._state.state, self._state.exception, seconds, peer)
        if not self._ready.done():
            self._ready.set_result(self._state.state)
        if not self._done.done():
            self._done.set_result(self._state.state)

    def _notify(self, ok: bool, reason: str) -> None:
        """Status to every decode destination; dummies report failures only (decode counts real senders)."""
        peers = (self._mgr.peer(name) for name, info in self._infos.items()
                 if (not ok or not info.is_dummy) and name not in self._dead)
        for endpoint in {peer.endpoint for peer in peers if peer is not None}:
            if not self._mgr._closed:
                self._mgr.send_status(endpoint, self.room, ok, reason)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
