"""KVSender: the prefill side of one room, as an awaitable view of a ``SenderRoom``.

It holds the room's futures and forwards calls to the prefill service; every rule about
the room lives in ``asynckv.proto.prefill``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import Aborted
from ..proto.core import Integer
from ..proto.sender import SenderRoom
from ..proto.states import KVPoll, SenderState
from .pump import Outcome, outcome

if TYPE_CHECKING:
    from .prefill import PrefillService

__all__ = ["KVSender"]


class KVSender:
    """Sends one room's KV pages (in chunks) and aux row to the decode rank(s) that asked.

    Lifecycle: ``await wait_ready()`` → ``init(num_pages, aux_index)`` → ``await send(pages)``
    per chunk (the last chunk is the one that reaches ``num_pages``) → ``await wait()`` →
    ``clear()``.
    """

    def __init__(self, service: PrefillService, room: SenderRoom) -> None:
        self._svc = service
        self.state = room
        """The core's record of this room (read-only for callers)."""
        loop = service.loop
        self._ready: Outcome[KVPoll] = Outcome(loop)
        self._done: Outcome[KVPoll] = Outcome(loop)
        self._chunks: dict[int, asyncio.Future[None]] = {}
        self.ready_changed()
        if not room.active:
            self.finished()

    @property
    def room(self) -> int:
        return self.state.room

    def poll(self) -> KVPoll:
        """Current state, without blocking."""
        return self.state.poll()

    @property
    def failure_reason(self) -> str | None:
        return self.state.reason

    def failure_exception(self) -> BaseException | None:
        """The exception that failed the room, or None."""
        return self.state.exception

    @property
    def decode_prefix_len(self) -> int:
        """Tokens decode already holds (known once ready); send only the pages after them."""
        return self.state.decode_prefix_len

    async def wait_ready(self, timeout: float | None = None) -> KVPoll:
        """Wait until decode's destination is known (WaitingForInput) or the room failed."""
        return await self._ready.wait(timeout)

    def init(self, num_pages: Integer, aux_index: Integer = -1) -> None:
        """Declare how many pages the room sends in total and which aux row carries its metadata."""
        self._svc.feed("sender_init", self.state, num_pages, aux_index)

    async def send(self, page_indices: Any, state_indices: Any = None) -> None:
        """Queue one chunk: prefill page indices, written into the next slice of decode's destination.

        The chunk that reaches ``num_pages`` is the last; it also writes the aux row and the
        hybrid state (``state_indices``: the request's mamba slot, or its SWA/NSA pages).
        Returns once the chunk's writes are handed to the data plane (chunks wait here while
        the in-flight byte budget is spent); ``wait()`` reports the outcome. A room that
        already failed ignores further chunks.
        """
        chunk = self.state.chunks
        fut: asyncio.Future[None] = self._svc.loop.create_future()
        self._chunks[chunk] = fut
        try:
            accepted = self._svc.feed("send_chunk", self.state, page_indices, state_indices)
        except BaseException:
            self._chunks.pop(chunk, None)
            raise
        if accepted is None:
            self._chunks.pop(chunk, None)
            return
        if not fut.done() and not self.state.active:
            fut.set_result(None)
        await outcome(fut)

    async def wait(self, timeout: float | None = None) -> KVPoll:
        """Wait for the room's outcome: Success or Failed (never raises for a failed transfer).

        Cancelling the waiting task does not abort the room.
        """
        return await self._done.wait(timeout)

    def send_nowait(self, page_indices: Any, state_indices: Any = None) -> int | None:
        """``send()`` for synchronous callers: queue the chunk (its writes wait for the byte budget
        inside asynckv) and return its number at once, or None when the room already failed."""
        result: int | None = self._svc.feed("send_chunk", self.state, page_indices, state_indices)
        return result

    def on_ready(self, callback: Callable[[KVPoll], None]) -> None:
        """Call ``callback(poll)`` on the loop once the room is ready (WaitingForInput) or failed."""
        self._ready.add_done_callback(callback)

    def on_done(self, callback: Callable[[KVPoll], None]) -> None:
        """Call ``callback(poll)`` on the loop once the room's outcome is decided."""
        self._done.add_done_callback(callback)

    def abort(self, reason: str = "aborted by prefill") -> None:
        """Fail the room; decode is told once none of its writes can still land."""
        self._svc.feed("abort_sender", self.state, Aborted(reason))

    def clear(self) -> None:
        """Drop the room; an unfinished one is aborted first."""
        self._svc.feed("clear_sender", self.state)
        self._svc.forget_view(self)

    def __repr__(self) -> str:
        total = "?" if self.state.num_pages is None else self.state.num_pages
        return f"<KVSender room={self.room} {self.poll().name} {self.state.cursor}/{total} pages>"

    # -- called by the prefill service when the core reports progress ---------------------

    def ready_changed(self) -> None:
        if self.state.state is not SenderState.BOOTSTRAPPING and not self._ready.done():
            self._ready.set_result(self.poll())

    def chunk_posted(self, chunk: int) -> None:
        fut = self._chunks.pop(chunk, None)
        if fut is not None and not fut.done():
            fut.set_result(None)

    def finished(self) -> None:
        self.ready_changed()
        if not self._done.done():
            self._done.set_result(self.poll())
        for fut in self._chunks.values():
            if not fut.done():
                fut.set_result(None)
        self._chunks.clear()
