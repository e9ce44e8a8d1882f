"""What a NIXL engine keeps, and the part of its work that calls no agent (``nixl_engine.NixlEngine``, built on
this, makes every agent call, on its own thread): the state the loop and the thread share, the rules that refuse
a post its next handle (cancel, peer, lease), the hand-over of results to the loop, and what the thread does when
that loop has closed under an open plane."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from ..errors import PeerUnreachable, TransferTimeout
from .agent import keep_until_exit, nixl_agent
from .base import MemoryLayout, Notified, Settled
from .commands import Cancel, Command, Outbox, PostCmd
from .merging import MERGE_MAX_BYTES, MERGE_MAX_DESCS
from .steer import Steer

__all__ = ["EngineState", "resolve"]

log = logging.getLogger("asynckv.nixl")


def resolve(fut: asyncio.Future[Any], error: BaseException | None, value: Any = None) -> None:
    """On the loop: settle ``fut`` with ``error`` or ``value``, unless it is done already (its waiter gave up)."""
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(value)


class EngineState:
    """The engine's state and its agent-free bookkeeping (see the module)."""

    def __init__(self, name: str, *, backend: str = "UCX", idle_poll_s: float = 0.001, deep_idle_s: float = 0.01,
                 expecting: Callable[[], bool] | None = None,
                 agent_factory: Callable[[str, str], Any] | None = None, loopback_only: bool = False) -> None:
        self.name = name
        self._backend = backend
        self._agent_factory = agent_factory or (lambda n, b: nixl_agent(n, b, loopback_only))  # (tests pass a fake)
        self._idle_poll_s = idle_poll_s
        self._deep_idle_s = max(deep_idle_s, idle_poll_s)
        self._expecting = expecting if expecting is not None else (lambda: True)  # (peers may write to us: poll)
        self.on_settled: Settled = lambda batch: None
        self.on_notified: Notified | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._running = False  # (set as the thread starts, cleared as it ends: cheaper than is_alive())
        self._outbox: Outbox | None = None  # (settled posts and call results, to the loop)
        self._woken: list[Command] = []  # (the command that ended the last wait: the thread's until its next round)
        self._round: tuple[list[Any], list[Any]] = ([], [])  # (this round's commands and results, until delivered)
        self._closed = False
        self._leases: dict[str, float] = {}
        self._cancelled: dict[int, BaseException] = {}  # (set and dropped by the loop, read here: atomic under the GIL)
        self._in_flight: list[PostCmd] = []
        self.settled_in_flight: set[int] = set()  # (added before their settle is delivered: take_in_flight)
        self._notified = False  # (a notification was sent since the last round that settled something)
        self.posts_in_flight = self.rounds = self.merged = 0  # (merged: posts that went in a merged handle)
        self.merge_limits = (MERGE_MAX_BYTES, MERGE_MAX_DESCS)  # (bytes, descriptors) of a merged handle at most
        self.thread_error: BaseException | None = None
        self.steer = Steer(enabled=False)  # (lanes.py turns it on: a relayed part wakes us off the waker's CPU)
        # engine-thread state
        self._agent: Any = None
        self._memory: MemoryLayout | None = None
        self._reg_handles: list[Any] = []
        self._local_dlist: Any = None
        self._parked: list[tuple[str, Any]] = []  # ((peer, handle) in flight after their post settled, until done)
        self._retired: dict[str, list[Any]] = {}  # (forgotten peers' dlists and agents, until nothing is parked)
        self._remote: dict[str, Any] = {}
        """Connected peers and their prepared destination dlists (None when not prepared)."""

    def _refusal(self, post: PostCmd, now: float) -> BaseException | None:
        """Why ``post`` may start no further handle, or None."""
        reason = self._cancelled.get(post.post_id)
        if reason is not None:
            return reason
        if post.peer not in self._remote:
            return PeerUnreachable(f"{post.label}: peer {post.peer[:8]} is not connected")
        if post.leased and now >= self._leases.get(post.peer, float("-inf")):
            return TransferTimeout(f"{post.label}: the write lease on the peer expired (unheard for too long)")
        return None

    def _apply_cancel(self, cmd: Cancel, done: list[Any]) -> None:
        for post in self._in_flight:  # (their handles cannot be stopped: they settle when done; the first stop wins)
            for m in post.members or (post,):
                if m.post_id in self._cancelled:
                    m.stop = m.stop or post.stop or cmd.reason

    def _notify(self, notifs: dict[str, list[bytes]]) -> None:
        if notifs and self._loop is not None and self.on_notified is not None:  # (otherwise dropped)
            batch = [(str(agent), bytes(msg)) for agent, msgs in notifs.items() for msg in msgs]
            with contextlib.suppress(RuntimeError):  # (a closed loop: dropped, as Outbox.put drops)
                self._loop.call_soon_threadsafe(self.on_notified, batch)

    def _deliver(self, done: list[Any]) -> None:
        if self._outbox is not None and done:  # (set by start(), on the loop)
            self._outbox.put(done)

    def _left_open(self) -> None:
        """The loop closed with the plane still open (a manager never closed, or its close cut short): stop the
        thread here, keeping the agent, its registrations and the memory with its owners until the process exits.
        No fence can run any more, so a peer may still hold a lease to write into that memory (and over CMA a
        deregistered range still takes its writes), and our own handles may still be in flight."""
        log.warning("data plane %s: its event loop closed with the plane open (a KVManager not closed, or its close "
                    "cut short): its NIXL agent and memory are kept until the process exits", self.name)
        keep_until_exit(self._agent, self._memory, self._reg_handles, self._local_dlist, self._remote, self._retired,
                        self._parked, self._in_flight)
