"""The NIXL data plane (``transport.base.DataPlane``): what the event loop calls.

Every call into NIXL itself happens on the engine thread (``transport.nixl_engine``); this
half hands it commands and awaits their results. See ``nixl_engine`` for the measured
facts behind the design (one owning thread, no progress thread, deadlines, parked handles).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..errors import ClosedError, PeerUnreachable, TransportError
from .base import U64, DescPiece, MemoryLayout, Write
from .closing import CloseOnce
from .commands import (
    DRAIN_BATCH,
    DRAIN_BATCH_MAX,
    Call,
    Cancel,
    Command,
    Forget,
    Outbox,
    PostCmd,
    Relay,
    hand_on,
    map_nixl_error,
)
from .engine_state import resolve
from .merging import members
from .nixl_engine import NixlEngine

__all__ = ["NixlDataPlane", "map_nixl_error"]

log = logging.getLogger("asynckv.nixl")


def _result_key(fut: Any, post_id: Any) -> tuple[str, int]:
    """How an engine round's result names its command: by its future, or (a post without one) its id."""
    return ("fut", id(fut)) if fut is not None else ("post", post_id)


class NixlDataPlane(NixlEngine):
    """A NIXL agent plus the thread that owns it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._posted: dict[int, str] = {}
        """Posts handed over and not yet settled (id -> peer), on the loop: only these take a cancel mark
        (one for any other would stay for ever), and forgetting a peer marks its own."""
        self.calls_pending = 0
        """Calls and warm-ups the engine has not answered yet (``lanes.py`` relays through no lane busy with one)."""
        self._closer = CloseOnce(self._close)

    @property
    def alive(self) -> bool:
        return self._running and not self._closed

    # -- loop side -----------------------------------------------------------------------

    async def start(self, memory: MemoryLayout) -> bytes:
        self._loop = asyncio.get_running_loop()
        self._outbox = Outbox(self._loop, self._on_loop, DRAIN_BATCH, DRAIN_BATCH_MAX)
        ready: asyncio.Future[None] = self._loop.create_future()
        self._thread = threading.Thread(target=self._run, args=(ready,), name=f"asynckv-nixl-{self.name[:8]}",
                                        daemon=True)
        self._running = True
        self._thread.start()
        await ready
        return bytes(await self._call(self._register, memory))

    async def connect_peer(self, peer: str, metadata: bytes, rows: U64 | None, mem_kind: str) -> None:
        """Connect ``peer``. Its posts not settled yet were made before this connection: they settle with an
        error and copy nothing into it (a split write's part relayed to this engine may arrive after the connect,
        while its other part was refused as not connected), as ``forget_peer`` marks a forgotten peer's."""
        self._mark_posts(peer, PeerUnreachable(f"peer {peer[:8]} was not connected when the post was made"))
        await self._call(self._connect, peer, metadata, rows, mem_kind)

    async def warm_up(self, peer: str, dst: tuple[int, int], timeout_s: float) -> None:
        memory = self._memory
        if memory is None:
            raise ClosedError("data plane not started")
        n = min(64, dst[1], memory.scratch[1])
        src = np.array([[memory.scratch[0], n, 0]], dtype=np.uint64)
        piece = DescPiece(src, np.array([[dst[0], n, 0]], dtype=np.uint64), "DRAM", "DRAM")
        fut = self._future()
        self._put(PostCmd(-1, peer, Write((piece,), 1, n), timeout_s, leased=False, fut=fut))
        await fut

    def post(self, post_id: int, peer: str, write: Write, timeout_s: float) -> None:
        if self._closed:
            self._settle_soon([(post_id, ClosedError("data plane closed"))])
            return
        if not self.alive:  # its engine thread died: nothing would ever take the post
            self._settle_soon([(post_id, TransportError(f"data plane {self.name[:8]}: engine thread is dead"))])
            return
        self._posted[post_id] = peer
        self._put(PostCmd(post_id, peer, write, timeout_s))

    def relay_post(self, carrier: NixlDataPlane, post_id: int, peer: str, write: Write, timeout_s: float) -> None:
        """``post``, but ``carrier``'s engine thread hands the command over as it takes it (``lanes.py``);
        the caller then posts to ``carrier`` itself. ``carrier`` must be alive (checked on the loop:
        once its thread ends, its last drain hands on what it holds)."""
        if not self.alive:
            self.post(post_id, peer, write, timeout_s)  # (settles at once, with the reason)
            return
        self._posted[post_id] = peer
        carrier._put(Relay(((self, PostCmd(post_id, peer, write, timeout_s)),)))

    def cancel(self, post_ids: Sequence[int], reason: BaseException) -> None:
        """Stop those of ``post_ids`` not yet settled. The mark stays until the post's settle reaches the
        loop, so a post that reaches the engine after its cancel (``relay_post``) is refused there."""
        posted, marked = self._posted, []
        for post_id in post_ids:
            if post_id in posted:
                self._cancelled[post_id] = reason
                marked.append(post_id)
        if marked:
            self._put(Cancel(tuple(marked), reason))

    def accept(self, cmd: Command) -> None:
        """Take ``cmd`` handed on by another engine (``Relay``), from any thread: it runs, or settles
        with the orphans if this engine's thread has ended (or is ending: its last drain may have run
        before the put, so the check comes after it). The thread wakes off the caller's CPU (``steer``)."""
        thread = self._thread
        if self._running and thread is not None:  # (an ended thread's id may name another thread by now)
            self.steer.away(thread.native_id)
        self._commands.put(cmd)
        if not self._running and self._loop is not None:
            with contextlib.suppress(RuntimeError):  # (the loop may be closed already)
                self._loop.call_soon_threadsafe(self._settle_orphans)

    def set_lease(self, peer: str, until: float) -> None:
        self._leases[peer] = until

    def forget_peer(self, peer: str) -> None:
        """Its posts settle with an error; those not started start nothing (one relayed to this engine
        may arrive after the peer has been connected anew: it must not copy into that connection)."""
        self._leases.pop(peer, None)  # here, not on the engine thread: a later session's lease is set after
        self._mark_posts(peer, PeerUnreachable(f"peer {peer[:8]} forgotten"))
        self._put(Forget(peer))

    def _mark_posts(self, peer: str, reason: BaseException) -> None:
        """Mark the unsettled posts to ``peer`` cancelled with ``reason`` (unless marked already): they start
        nothing more, wherever they are (``cancel``)."""
        for post_id, to in self._posted.items():
            if to == peer:
                self._cancelled.setdefault(post_id, reason)

    async def close(self) -> None:
        """Release every handle, dlist and remote agent, deregister memory, stop the thread. The close runs once,
        as a task (``CloseOnce``): a second close waits for the first to finish (its caller may then free the
        registered memory), a caller cancelled meanwhile does not cut it short, and one cut short resumes."""
        await self._closer()

    async def _close(self) -> None:
        if self._thread is None:
            self._closed = True
            return
        if not self._closed:
            if not self._running:  # it died, or is ending: settle what it never took, or took and never finished
                self._closed = True
                self._flush()  # (what it handed over comes first)
                self._settle_orphans()  # (it parked the handles it found in flight)
                self._leases.clear()
                if self._agent is not None:  # the thread's own shutdown, here (no other thread touches the agent
                    try:  # now): with a handle parked, the agent is kept until exit; nothing is polled (polling
                        self._shutdown(settle_s=0.0)  # may be what killed the thread)
                    except Exception:
                        log.exception("data plane %s: shutdown after its engine thread died failed", self.name)
                return
            shutdown = self._call(self._shutdown)
            self._closed = True  # from now, not once it returned: a call queued behind the shutdown would run after
            try:  # it (a connect then left its remote agent and dlist behind); calls and posts are refused from here
                await shutdown
            except Exception:
                log.exception("data plane %s: shutdown failed", self.name)
        # (a close cut short resumes here: the thread runs the shutdown it took to its end before this sentinel)
        self._commands.put(None)
        thread = self._thread
        await asyncio.get_running_loop().run_in_executor(None, thread.join, 10.0)
        self._leases.clear()  # (read by the engine thread until it ended)
        self._flush()  # posts taken during close settled before the thread ended: on_settled sees them now

    def _flush(self) -> None:
        if self._outbox is not None:
            self._outbox.flush()

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(agent, *args)`` on the engine thread (tests and benchmarks inspect the agent this way)."""
        return await self._call(lambda *a: fn(self._agent, *a), *args)

    def _call(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
        fut = self._future()
        self._put(Call(fn, args, fut))
        return fut

    def _future(self) -> asyncio.Future[Any]:
        if self._closed or self._loop is None:
            raise ClosedError(f"data plane {self.name} is closed")
        if not self._running:  # (nothing would take the command: a connect to a dead lane waited for ever)
            raise TransportError(f"data plane {self.name[:8]}: engine thread is dead")
        fut = self._loop.create_future()
        self.calls_pending += 1
        fut.add_done_callback(self._answered)
        return fut

    def _answered(self, fut: asyncio.Future[Any]) -> None:
        self.calls_pending -= 1

    def _put(self, cmd: Command) -> None:
        self._commands.put(cmd)

    def take_in_flight(self, post_id: int) -> bool:
        """Whether settled post ``post_id`` left a handle in flight, which may still read its source
        memory (and land bytes); asked once, on the loop, when its settle arrives."""
        try:
            self.settled_in_flight.remove(post_id)
        except KeyError:
            return False
        return True

    def _run(self, ready: asyncio.Future[None]) -> None:
        try:
            super()._run(ready)
        finally:  # the thread ends, whatever ended it: a call or post it never took still settles (a close
            loop = self._loop  # that queued its shutdown just as a failed start ended the thread waited for ever)
            if loop is not None:
                with contextlib.suppress(RuntimeError):  # (the loop may be closed already)
                    loop.call_soon_threadsafe(self._settle_orphans)

    def _settle_orphans(self) -> None:
        """After the engine thread died: every post it held or never took settles (with the error, or the
        reason it was cancelled with: a split write's parts then agree whichever settles first), every call
        fails, so that no caller waits for ever (the contract: each post settles once)."""
        err = TransportError(f"data plane {self.name[:8]}: engine thread died ({self.thread_error!r})"
                             if self.thread_error is not None else f"data plane {self.name[:8]}: engine thread ended")
        batch: list[tuple[int, BaseException | None]] = []
        commands, done = self._round  # (the round it died in: what finished there was never handed over)
        self._round = ([], [])
        finished = {_result_key(fut, value) for fut, value, _ in done}
        for post in self._in_flight:  # (whatever UCX still does with their handles: parked, close keeps the agent)
            if post.handle is not None:
                self._parked.append((post.peer, post.handle))
                post.handle = None
                self.settled_in_flight.update(m.post_id for m in members([post]) if m.fut is None)
        held = {id(c): c for c in (*members(self._in_flight), *self._woken, *commands) if c is not None}  # (woken: a
        orphans: list[Any] = [c for c in held.values()  # command that woke it just before it died)
                              if _result_key(getattr(c, "fut", None), getattr(c, "post_id", None)) not in finished]
        self._in_flight, self._woken = [], []
        while True:
            try:
                orphans.append(self._commands.get_nowait())
            except queue.Empty:
                break
        for cmd in orphans:
            if isinstance(cmd, Relay):  # (another engine's commands: they go on to it, in order)
                hand_on(cmd)
                continue
            if isinstance(cmd, PostCmd) and cmd.handle is not None:  # (whatever UCX still does with it, as above)
                self._parked.append((cmd.peer, cmd.handle))
                cmd.handle = None
                if cmd.fut is None:
                    self.settled_in_flight.add(cmd.post_id)
            fut = getattr(cmd, "fut", None)
            if fut is not None:
                if not fut.done():
                    fut.set_exception(err)
            elif isinstance(cmd, PostCmd):  # (one cancelled or forgotten: with that reason, as if the thread lived)
                batch.append((cmd.post_id, self._cancelled.get(cmd.post_id) or err))
        if batch:
            self._settle_soon(batch)
        if done:  # last: a settle handler that raises must not hold back the orphans above
            self._on_loop(list(done))  # (they settle as they finished, once)

    def _on_loop(self, done: list[tuple[Any, Any, BaseException | None]]) -> None:
        """On the loop: resolve the calls' futures, hand the posts' settles to ``on_settled``."""
        settled = []
        for fut, value, error in done:
            if fut is None:
                settled.append((value, error))
            else:
                resolve(fut, error, value)
        if settled:
            self._report(settled)

    def _report(self, settled: list[tuple[int, BaseException | None]]) -> None:
        """Hand settles to ``on_settled``, first dropping what the loop kept for those posts (their cancel
        marks are the loop's to drop, whenever the cancel came)."""
        posted, cancelled = self._posted, self._cancelled
        for post_id, _ in settled:
            posted.pop(post_id, None)
            if cancelled:
                cancelled.pop(post_id, None)
        self.on_settled(settled)

    def _settle_soon(self, batch: list[tuple[int, BaseException | None]]) -> None:
        if self._loop is not None:
            self._loop.call_soon(self._report, batch)

    # -- engine thread: set-up and teardown ---------------------------------------------------
