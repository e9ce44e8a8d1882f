"""The NIXL data plane: one engine thread owns every call into one NIXL agent.

This is the only module that calls NIXL. Measured on this kind of machine (2-core VM,
UCX over loopback, DRAM):

- two threads touching one agent in its default sync mode segfaulted (4 of 4 runs), so
  exactly one thread, this one, calls into the agent and needs no locks;
- on one host ``transfer()`` performs the whole DRAM copy inside the call (256 MiB took
  about 50 ms) and ``add_remote_agent`` takes about 20 ms: none of it may run on the event loop;
- the stock progress thread spins a whole core, so it is off and this thread drives
  progress: tightly while transfers are in flight, backing off to ``idle_poll_s`` when idle;
  a target that stops progressing stalls its initiators;
- a stopped peer leaves a handle in ``PROC`` forever (20 s and more seen): every post has a
  deadline; releasing a ``PROC`` handle cancels it.

The loop hands commands over a queue; settled posts come back in one
``call_soon_threadsafe`` per progress round. Each post is a series of handles; before each
handle starts, the post's write lease and the cancel set are checked, so a cancelled or
lease-lapsed post lands at most the handle already copying. A peer is forgotten, and the
plane closed, in one sequence on this thread: release every handle, then the prepared
dlists, then remove the remote agents, then deregister memory.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..errors import ClosedError, PeerUnreachable, RemoteProtocolError, TransferTimeout, TransportError
from .base import U64, DescPiece, MemoryLayout, PreppedPiece, Settled, Write
from .commands import Call, Cancel, Command, Forget, PostCmd, map_nixl_error

__all__ = ["NixlDataPlane", "map_nixl_error"]

log = logging.getLogger("asynckv.nixl")

_MIN_IDLE_WAIT_S = 20e-6
_MAX_BUSY_WAIT_S = 250e-6


def _nixl_agent(name: str, backend: str) -> Any:
    from nixl._api import nixl_agent, nixl_agent_config

    cfg = nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=[backend])
    return nixl_agent(name, cfg)


class NixlDataPlane:
    """A NIXL agent plus the thread that owns it (implements ``transport.base.DataPlane``)."""

    def __init__(self, name: str, *, backend: str = "UCX", idle_poll_s: float = 0.001, deep_idle_s: float = 0.01,
                 expecting: Callable[[], bool] | None = None,
                 agent_factory: Callable[[str, str], Any] | None = None) -> None:
        self.name = name
        self._backend = backend
        self._agent_factory = agent_factory or _nixl_agent
        """(name, backend) -> agent, called on the engine thread (tests pass a recording fake)."""
        self._idle_poll_s = idle_poll_s
        self._deep_idle_s = max(deep_idle_s, idle_poll_s)
        self._expecting = expecting
        """True while peers may write to us (decode rooms waiting): keep the target progressing every
        ``idle_poll_s``; otherwise back off to ``deep_idle_s`` (our own commands wake us)."""
        self.on_settled: Settled = lambda batch: None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._leases: dict[str, float] = {}
        self._cancelled: dict[int, BaseException] = {}
        """Posts the loop cancelled; read between handles (a dict update is atomic under the GIL)."""
        self._in_flight: list[PostCmd] = []
        self.posts_in_flight = 0
        self.rounds = 0
        self.thread_error: BaseException | None = None
        # engine-thread state
        self._agent: Any = None
        self._memory: MemoryLayout | None = None
        self._reg_handles: list[Any] = []
        self._local_dlist: Any = None
        self._remote: dict[str, Any] = {}
        """Connected peers and their prepared destination dlists (None when not prepared)."""

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._closed

    # -- loop side -----------------------------------------------------------------------

    async def start(self, memory: MemoryLayout) -> bytes:
        self._loop = asyncio.get_running_loop()
        ready: asyncio.Future[None] = self._loop.create_future()
        self._thread = threading.Thread(target=self._run, args=(ready,), name=f"asynckv-nixl-{self.name[:8]}",
                                        daemon=True)
        self._thread.start()
        await ready
        return bytes(await self._call(self._register, memory))

    async def connect_peer(self, peer: str, metadata: bytes, rows: U64 | None, mem_kind: str) -> None:
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
        self._put(PostCmd(post_id, peer, write, timeout_s))

    def cancel(self, post_ids: Sequence[int], reason: BaseException) -> None:
        for post_id in post_ids:
            self._cancelled[post_id] = reason
        self._put(Cancel(tuple(post_ids), reason))

    def set_lease(self, peer: str, until: float) -> None:
        self._leases[peer] = until

    def forget_peer(self, peer: str) -> None:
        self._leases.pop(peer, None)  # here, not on the engine thread: a later session's lease is set after
        self._put(Forget(peer))

    async def close(self) -> None:
        """Release every handle, dlist and remote agent, deregister memory, stop the thread."""
        if self._closed or self._thread is None:
            self._closed = True
            return
        try:
            await self._call(self._shutdown)
        except Exception:
            log.exception("data plane %s: shutdown failed", self.name)
        self._closed = True
        self._commands.put(None)
        self._wake.set()
        thread = self._thread
        await asyncio.get_running_loop().run_in_executor(None, thread.join, 10.0)

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
        return self._loop.create_future()

    def _put(self, cmd: Command) -> None:
        self._commands.put(cmd)
        self._wake.set()

    def _settle_soon(self, batch: list[tuple[int, BaseException | None]]) -> None:
        if self._loop is not None:
            self._loop.call_soon(self.on_settled, batch)

    # -- engine thread: set-up and teardown ---------------------------------------------------

    def _run(self, ready: asyncio.Future[None]) -> None:
        loop = self._loop
        if loop is None:
            return
        try:
            self._agent = self._agent_factory(self.name, self._backend)
        except BaseException as exc:
            err = TransportError(f"cannot create NIXL agent ({self._backend}): {exc}")
            err.__cause__ = exc
            loop.call_soon_threadsafe(ready.set_exception, err)
            return
        loop.call_soon_threadsafe(ready.set_result, None)
        try:
            self._progress_loop(loop)
        except BaseException as exc:
            self.thread_error = exc
            log.exception("data plane %s: engine thread died", self.name)
            raise

    def _register(self, memory: MemoryLayout) -> bytes:
        agent = self._agent
        self._memory = memory
        for kind, rows in memory.regions:
            if len(rows):
                self._reg_handles.append(agent.register_memory(np.ascontiguousarray(rows), kind))
        if memory.local_rows is not None and len(memory.local_rows):
            self._local_dlist = agent.prep_xfer_dlist("", np.ascontiguousarray(memory.local_rows), memory.local_kind)
        return bytes(agent.get_agent_metadata())

    def _connect(self, peer: str, metadata: bytes, rows: U64 | None, mem_kind: str) -> None:
        agent = self._agent
        if peer in self._remote:
            raise RemoteProtocolError(f"peer {peer[:8]} is connected already")
        name = agent.add_remote_agent(metadata)
        name = name.decode() if isinstance(name, bytes) else str(name)
        if name != peer:
            agent.remove_remote_agent(name)
            raise RemoteProtocolError(f"agent metadata names {name!r}, registration says {peer!r}")
        dlist = None
        try:
            if rows is not None and len(rows):
                dlist = agent.prep_xfer_dlist(name, np.ascontiguousarray(rows), mem_kind)
        except BaseException:
            agent.remove_remote_agent(name)
            raise
        self._remote[peer] = dlist

    def _forget(self, peer: str, done: list[Any]) -> None:
        """Cancel the peer's posts, release its dlist, remove its agent: in that order."""
        reason = PeerUnreachable(f"peer {peer[:8]} forgotten")
        still = []
        for post in self._in_flight:
            if post.peer == peer:
                self._finish(post, reason, done)
            else:
                still.append(post)
        self._in_flight = still
        if peer not in self._remote:
            return
        dlist = self._remote.pop(peer)
        if dlist is not None:
            self._agent.release_dlist_handle(dlist)
        try:
            self._agent.remove_remote_agent(peer)
        except Exception:
            log.debug("remove_remote_agent(%s) failed", peer, exc_info=True)

    def _shutdown(self) -> None:
        done: list[Any] = []
        for post in self._in_flight:
            self._finish(post, ClosedError("data plane closed"), done)
        self._in_flight = []
        for peer in list(self._remote):
            self._forget(peer, done)
        if self._local_dlist is not None:
            self._agent.release_dlist_handle(self._local_dlist)
            self._local_dlist = None
        for handle in self._reg_handles:
            self._agent.deregister_memory(handle)
        self._reg_handles.clear()
        self._deliver(done)

    # -- engine thread: progress --------------------------------------------------------------

    def _progress_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        agent = self._agent
        idle_wait = _MIN_IDLE_WAIT_S
        while True:
            done: list[Any] = []
            commands: list[Command] = []
            while True:
                try:
                    commands.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            stop = False
            for cmd in commands:
                if cmd is None:
                    stop = True
                elif isinstance(cmd, PostCmd):
                    self._start(cmd, done)
                elif isinstance(cmd, Cancel):
                    self._apply_cancel(cmd, done)
                elif isinstance(cmd, Forget):
                    self._forget(cmd.peer, done)
                else:
                    try:
                        done.append((cmd.fut, cmd.fn(*cmd.args), None))
                    except BaseException as exc:
                        done.append((cmd.fut, None, map_nixl_error(exc, getattr(cmd.fn, "__name__", "call"))))
            if self._in_flight:
                self._check_in_flight(time.monotonic(), done)
            try:
                agent.get_new_notifs()  # drives UCX progress: there is no progress thread
            except Exception:
                log.debug("get_new_notifs failed", exc_info=True)
            self.posts_in_flight = len(self._in_flight)
            self.rounds += 1
            if done:
                self._deliver(done)
            if stop:
                return
            if done:
                idle_wait = _MIN_IDLE_WAIT_S
                time.sleep(0)  # progress was made: go again at once, but yield the GIL
            elif self._in_flight:
                # Waiting on transfers: back off a little so a spinning poller does not take the
                # CPU that the copy (CMA runs in the kernel) and the peer need.
                self._wake.wait(idle_wait)
                self._wake.clear()
                idle_wait = min(idle_wait * 2, _MAX_BUSY_WAIT_S)
            else:
                self._wake.wait(idle_wait)
                self._wake.clear()
                expecting = self._expecting is None or self._expecting()
                idle_wait = min(idle_wait * 2, self._idle_poll_s if expecting else self._deep_idle_s)

    def _refusal(self, post: PostCmd, now: float) -> BaseException | None:
        """Why ``post`` may start no further handle, or None."""
        reason = self._cancelled.get(post.post_id)
        if reason is not None:
            return reason
        if post.peer not in self._remote:
            return PeerUnreachable(f"post {post.post_id}: peer {post.peer[:8]} is not connected")
        if post.leased and now >= self._leases.get(post.peer, float("-inf")):
            return TransferTimeout(f"post {post.post_id}: the write lease on the peer expired "
                                   f"(unheard for too long)")
        return None

    def _start(self, post: PostCmd, done: list[Any]) -> None:
        """Create and post the handles one by one, checking the lease and cancel set before each."""
        agent = self._agent
        post.deadline = time.monotonic() + post.timeout_s
        try:
            for piece in post.write.pieces:
                refusal = self._refusal(post, time.monotonic())
                if refusal is not None:
                    raise refusal
                handle = self._handle(post.peer, piece)
                post.handles.append(handle)
                if agent.transfer(handle) == "DONE":  # CMA: the copy happened inside the call
                    post.handles.pop()
                    agent.release_xfer_handle(handle)
        except BaseException as exc:
            self._finish(post, map_nixl_error(exc, f"post {post.post_id}"), done)
            return
        if post.handles:
            self._in_flight.append(post)
        else:
            self._finish(post, None, done)

    def _handle(self, peer: str, piece: PreppedPiece | DescPiece) -> Any:
        agent = self._agent
        if isinstance(piece, PreppedPiece):
            remote = self._remote.get(peer)
            if self._local_dlist is None or remote is None:
                raise TransportError(f"no prepared dlists for {peer[:8]}")
            return agent.make_prepped_xfer("WRITE", self._local_dlist, piece.src_idx, remote, piece.dst_idx)
        return agent.initialize_xfer("WRITE", agent.get_xfer_descs(piece.src, piece.src_kind),
                                     agent.get_xfer_descs(piece.dst, piece.dst_kind), peer)

    def _apply_cancel(self, cmd: Cancel, done: list[Any]) -> None:
        still = []
        for post in self._in_flight:
            if post.post_id in self._cancelled:
                self._finish(post, cmd.reason, done)
            else:
                still.append(post)
        self._in_flight = still
        for post_id in cmd.post_ids:  # cancels of posts that settled meanwhile
            if not any(p.post_id == post_id for p in still):
                self._cancelled.pop(post_id, None)

    def _check_in_flight(self, now: float, done: list[Any]) -> None:
        agent = self._agent
        still = []
        for post in self._in_flight:
            try:
                refusal = self._refusal(post, now)
                if refusal is not None:
                    raise refusal
                post.handles = [h for h in post.handles if self._pending(agent, h)]
            except BaseException as exc:
                self._finish(post, map_nixl_error(exc, f"post {post.post_id}"), done)
                continue
            if not post.handles:
                self._finish(post, None, done)
            elif now > post.deadline:
                self._finish(post, TransferTimeout(
                    f"post {post.post_id}: not done after {post.timeout_s:.1f}s (peer stopped?)"), done)
            else:
                still.append(post)
        self._in_flight = still

    @staticmethod
    def _pending(agent: Any, handle: Any) -> bool:
        if agent.check_xfer_state(handle) != "DONE":
            return True
        agent.release_xfer_handle(handle)
        return False

    def _finish(self, post: PostCmd, error: BaseException | None, done: list[Any]) -> None:
        """Release whatever the post still holds (cancelling what is PROC) and report it once."""
        for handle in post.handles:
            try:
                self._agent.release_xfer_handle(handle)
            except Exception:
                log.warning("release_xfer_handle failed", exc_info=True)
        post.handles = []
        self._cancelled.pop(post.post_id, None)
        done.append((post.fut, None if post.fut is not None else post.post_id, error))

    def _deliver(self, done: list[Any]) -> None:
        loop = self._loop
        if loop is not None and done:
            loop.call_soon_threadsafe(self._on_loop, done)

    def _on_loop(self, done: list[tuple[Any, Any, BaseException | None]]) -> None:
        settled = []
        for fut, value, error in done:
            if fut is None:
                settled.append((value, error))
            elif not fut.done():
                if error is not None:
                    fut.set_exception(error)
                else:
                    fut.set_result(value)
        if settled:
            self.on_settled(settled)
