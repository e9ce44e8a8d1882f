"""KVReceiver: the decode side of one room, as an awaitable view of a ``ReceiverRoom``.

It holds the room's futures and forwards calls to the decode service; every rule about the
room (fencing included) lives in ``asynckv.proto.decode``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import Aborted
from ..proto.core import Integer
from ..proto.receiver import ReceiverRoom
from ..proto.states import KVPoll, ReceiverState
from .pump import Outcome

if TYPE_CHECKING:
    from .decode import ReceiverPump

__all__ = ["KVReceiver"]


class KVReceiver:
    """Receives one room's KV pages into pages decode pre-allocated.

    Lifecycle: ``await init(pages, aux_index)`` → ``await wait()`` → ``clear()``.
    ``async with mgr.receiver(addr, room) as r:`` aborts on exit if the room is unfinished.

    Fencing: a room that fails is reported Failed (by ``poll()`` and ``wait()``) only once
    every prefill sender that may have been writing into its pages has confirmed it writes
    no more, or has been declared dead and its write lease has run out; only then may
    decode reuse the pages. Meanwhile ``poll()`` says Transferring.
    """

    def __init__(self, service: ReceiverPump, room: ReceiverRoom, bootstrap_addr: str) -> None:
        self._svc = service
        self.state = room
        """The core's record of this room (read-only for callers)."""
        self.bootstrap_addr = bootstrap_addr
        loop = service.loop
        self._init: Outcome[None] = Outcome(loop)
        self._done: Outcome[KVPoll] = Outcome(loop)

    @property
    def room(self) -> int:
        return self.state.room

    def poll(self) -> KVPoll:
        """Current state, without blocking (Failed only once the room's pages are fenced)."""
        return self.state.poll()

    @property
    def failure_reason(self) -> str | None:
        return self.state.reason

    def failure_exception(self) -> BaseException | None:
        """The exception that failed the room, or None."""
        return self.state.exception

    async def init(self, page_indices: Any, aux_index: Integer = -1, state_indices: Any = None,
                   decode_prefix_len: Integer = 0) -> KVPoll:
        """Send the destination to the prefill rank(s) of this room.

        ``page_indices``: decode pages for the prompt after the first ``decode_prefix_len``
        tokens (which decode already holds; a multiple of page_size). ``aux_index``: the
        metadata row, -1 for none. ``state_indices``: the request's mamba slot, or its
        SWA/NSA state pages, for hybrid models. Invalid input raises ``InvalidArgument``; a
        prefill that cannot be reached or refuses us fails the room (the return value and
        ``wait()`` say Failed, with a reason).
        """
        self._svc.feed("receiver_init", self.state, page_indices, aux_index, state_indices, decode_prefix_len)
        if self.state.state is ReceiverState.RESOLVING:
            await self._init.wait()
        return self.poll()

    def init_nowait(self, page_indices: Any, aux_index: Integer = -1, state_indices: Any = None,
                    decode_prefix_len: Integer = 0) -> None:
        """``init()`` for synchronous callers: validate (bad input raises) and start sending the
        destination without waiting; ``on_done`` reports the outcome."""
        self._svc.feed("receiver_init", self.state, page_indices, aux_index, state_indices, decode_prefix_len)

    def on_done(self, callback: Callable[[KVPoll], None]) -> None:
        """Call ``callback(poll)`` on the loop once the room's outcome is decided (after its fence)."""
        self._done.add_done_callback(callback)

    def abort_nowait(self, reason: str = "aborted by decode") -> None:
        """``abort()`` without waiting for the fence (``on_done`` says when it is reached)."""
        self._svc.feed("abort_receiver", self.state, Aborted(reason))

    async def wait(self, timeout: float | None = None) -> KVPoll:
        """Wait for the outcome: Success or Failed (never raises for a failed transfer).

        Failed is returned once the room's pages are fenced. Cancelling the waiting task
        does not abort the room; ``abort()`` does.
        """
        return await self._done.wait(timeout)

    async def abort(self, reason: str = "aborted by decode") -> KVPoll:
        """Fail the room, tell every prefill rank involved, and return once none of them can
        still write into its pages."""
        self._svc.feed("abort_receiver", self.state, Aborted(reason))
        return await self._done.wait()

    def clear(self) -> None:
        """Drop the room. On an unfinished room this starts an abort but cannot wait for the fence:
        ``await abort()`` first if the pages are to be reused."""
        self._svc.feed("clear_receiver", self.state)
        self._svc.forget_view(self)

    async def __aenter__(self) -> KVReceiver:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if not self.state.terminal:
            await self.abort("receiver context exited before completion")

    def __repr__(self) -> str:
        need = self.state.required_responses if self.state.plan else "?"
        return (f"<KVReceiver room={self.room} {self.poll().name} {len(self.state.responses)}/{need} senders "
                f"from {self.bootstrap_addr}>")

    # -- called by the decode service when the core reports progress ----------------------

    def init_done(self) -> None:
        if not self._init.done():
            self._init.set_result(None)

    def finished(self) -> None:
        self.init_done()
        if not self._done.done():
            self._done.set_result(self.poll())
