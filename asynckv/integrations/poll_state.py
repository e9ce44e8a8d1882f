"""The poll value a synchronous scheduler reads for one room, moved by two threads.

A serving engine's scheduler thread polls each room every iteration and MIN-reduces the result
across its TP ranks, so the value may only move forward: Bootstrapping, WaitingForInput,
Transferring, then Success or Failed (both final). Both the scheduler (``send()`` marks a room
Transferring, ``abort()`` fails it) and asynckv's loop (callbacks) move it.
"""

from __future__ import annotations

import threading

from ..errors import AsyncKVError
from ..proto.states import KVPoll as Poll

__all__ = ["PollState"]


class PollState:
    """A room's poll value, moved forward only (Failed and Success are final). The scheduler thread
    (``send()``, ``abort()``) and the loop (callbacks) both move it: a read-then-write from one must
    not undo the other's (a failure overwritten by Transferring would leave the room waiting
    forever), so each move holds a lock for a few instructions; ``poll()`` reads without it."""

    __slots__ = ("_lock", "error", "state")

    def __init__(self) -> None:
        self.state = int(Poll.Bootstrapping)
        self.error: BaseException | None = None
        self._lock = threading.Lock()

    def advance(self, state: int, error: BaseException | None = None) -> None:
        with self._lock:
            if self.state in (Poll.Failed, Poll.Success):
                return
            if state == Poll.Failed:
                self.error = error or self.error or AsyncKVError("failed")
                self.state = int(Poll.Failed)
            elif state > self.state:
                self.state = int(state)

    def error_text(self) -> str:
        error = self.error
        return "failed" if error is None else (str(error) or type(error).__name__)

    def failure(self, what: str, error_type: type[Exception] = RuntimeError) -> Exception:
        """``error_type`` with the reason (the room's exception as its cause), for the caller to raise.
        Read it before acting on the room: an abort that lands first would otherwise pose as the reason."""
        error = self.error
        if error is None:  # the MIN over the TP group says Failed before this rank heard of it
            return error_type(f"{what}: not failed on this rank (yet): another TP rank's poll() failed it")
        exc = error_type(f"{what}: {str(error) or type(error).__name__}")
        exc.__cause__ = error
        return exc
