"""The commands the event loop hands the NIXL engine thread, the outbox that hands results back, and
NIXL's errors in asynckv's tree."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import time
from collections.abc import Callable
from typing import Any

from ..errors import AsyncKVError, PeerUnreachable, TransportError
from .base import Write
from .pacing import Pacer

__all__ = ["Call", "Cancel", "Command", "DRAIN_BATCH", "DRAIN_BATCH_MAX", "Forget", "Outbox", "PostCmd", "Relay",
           "hand_on", "map_nixl_error"]


def map_nixl_error(exc: BaseException, what: str) -> BaseException:
    """Translate a nixl binding exception into asynckv's tree (keeps ours as they are)."""
    if isinstance(exc, AsyncKVError):
        return exc
    name = type(exc).__name__
    if name == "nixlRemoteDisconnectError":
        err: BaseException = PeerUnreachable(f"{what}: peer disconnected ({name})")
    else:
        err = TransportError(f"{what}: {name}: {exc}")
    err.__cause__ = exc
    return err


@dataclasses.dataclass(slots=True, eq=False)
class PostCmd:
    post_id: int
    peer: str
    write: Write
    timeout_s: float
    leased: bool = True
    """Checked against the peer's write lease (the warm-up write into scratch is not)."""
    fut: asyncio.Future[None] | None = None
    """Set for internal posts the loop awaits (warm-up); others report through on_settled."""
    handle: Any = None
    """The handle in flight (NIXL cannot stop it: the post settles when it finishes)."""
    next_piece: int = 0
    """Index in ``write.pieces`` of the next handle to start."""
    deadline: float = 0.0
    stop: BaseException | None = None
    """Why the post may start nothing more and will settle with an error (cancel, lease, peer, failure)."""
    members: tuple[PostCmd, ...] = ()
    """The posts this one moves in one handle (the engine merged them: ``merging``); it settles each, never itself."""

    @property
    def label(self) -> str:
        """How error texts name it: ``post 7``, or a merged one by its members, ``posts 7..12 (4 merged)``."""
        if not self.members:
            return f"post {self.post_id}"
        return f"posts {self.members[0].post_id}..{self.members[-1].post_id} ({len(self.members)} merged)"


@dataclasses.dataclass(slots=True)
class Call:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    fut: asyncio.Future[Any]


@dataclasses.dataclass(slots=True)
class Cancel:
    post_ids: tuple[int, ...]
    reason: BaseException


@dataclasses.dataclass(slots=True)
class Forget:
    peer: str


@dataclasses.dataclass(slots=True)
class Relay:
    """Commands for other engines, which the engine thread that takes this one hands on at once, in
    order (``lanes.py``: a thread woken by a running engine thread rather than by the loop finds a
    free core). Each target's ``accept`` takes its command from any thread."""
    items: tuple[tuple[Any, Command], ...]
    """(target engine, command) pairs."""


Command = Call | PostCmd | Cancel | Forget | Relay | None


def hand_on(relay: Relay) -> None:
    """Give each of ``relay``'s commands to its engine, in order (from any thread)."""
    for target, cmd in relay.items:
        target.accept(cmd)


DRAIN_BATCH = 4
"""Settled posts the loop takes per round at the least (the rest wait for its next poll). Each can
wake a task, which the loop runs in its next round, so this bounds a round's work. Q3 (1,000 rooms
in flight, uvloop, interleaved runs): prefill loop lag p99 12-19 ms when each engine round's settles
came in one call, about 9 ms at 4 (8 runs), rooms/s 0.94-0.99x in two A/Bs (within the noise:
identical configurations differed by 5-24%); 8 gave 8.2 ms where 3 gave 6.4; 1 gave 5.7 ms where 3
gave 7.3 in another A/B, but took 20% more CPU per room in each of its 3 runs. The drain takes more,
up to ``DRAIN_BATCH_MAX``, while the loop's rounds are short (``pacing.Pacer``)."""
DRAIN_BATCH_MAX = 16
"""Settled posts the loop takes per round at the most, while its rounds are short (``pacing``)."""


class Outbox:
    """What a thread hands an event loop, taken on the loop a bounded number of items per loop round.

    ``put`` (any thread) wakes the loop only when no drain is due: one wake-up serves every put
    made before the loop drains. The flag is cleared before draining, so an item put meanwhile is
    taken now or schedules its own drain; none is stranded. What is left after a round's take waits
    for the loop's next poll, so the work one round starts stays bounded (each item can wake a task,
    which runs in the next round): ``batch`` items, or up to ``most`` while the loop's rounds are
    short (``pacing.Pacer``). ``flush`` takes the rest at once (close, after the thread ended).
    """

    __slots__ = ("_due", "_items", "_loop", "_take", "pacer")

    def __init__(self, loop: asyncio.AbstractEventLoop, take: Callable[[list[Any]], None], batch: int,
                 most: int | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self._loop, self._take = loop, take
        self.pacer = Pacer(batch, batch if most is None else most, clock)
        self._items: collections.deque[Any] = collections.deque()
        self._due = False

    def put(self, items: list[Any]) -> None:
        """Queue ``items`` for the loop (any thread). Once the loop is closed they are dropped: nothing
        can take them any more (a manager left open as its loop ended), and the thread must not die of it."""
        self._items.extend(items)
        if not self._due:
            self._due = True
            try:
                self._loop.call_soon_threadsafe(self._drain)
            except RuntimeError:
                if not self._loop.is_closed():
                    raise
                self._due = False
                self._items.clear()

    def _drain(self) -> None:
        self._due = False
        items = self._items
        taken = [items.popleft() for _ in range(min(len(items), self.pacer.take()))]
        if items and not self._due:
            self._due = True
            self.pacer.scheduled()
            self._loop.call_soon(self._drain)
        if taken:
            self._take(taken)

    def flush(self) -> None:
        """On the loop: take everything queued now (a drain still due then finds nothing; a put
        racing this is taken here or by the drain it schedules)."""
        items, taken = self._items, []
        while items:
            taken.append(items.popleft())
        if taken:
            self._take(taken)
