"""The NIXL data plane: one engine thread owns every call into one NIXL agent.

Measured on this kind of machine (see ../shared/reference/nixl-notes.md):

- two threads touching one agent in the default sync mode segfault, so exactly one
  thread, this one, calls into the agent, and needs no locks;
- ``transfer()`` of DRAM on one host performs the whole copy inside the call, and
  ``add_remote_agent`` takes ~20 ms, so none of it may run on the event loop;
- the stock progress thread spins a core, so it is off and this thread drives progress:
  tightly (``sleep(0)``) while transfers are in flight, backing off to
  ``idle_poll_s`` when idle; a target that stops progressing stalls its initiators;
- a stopped peer leaves a handle in ``PROC`` forever, so every post has a deadline.

The loop hands commands over a queue; results come back in one
``call_soon_threadsafe`` per progress round.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from ..errors import ClosedError, PeerUnreachable, TransferTimeout, TransportError

__all__ = ["NixlEngine", "map_nixl_error"]

log = logging.getLogger("asynckv.engine")

_MIN_IDLE_WAIT_S = 20e-6
_MAX_BUSY_WAIT_S = 250e-6


def map_nixl_error(exc: BaseException, what: str) -> BaseException:
    """Translate a nixl binding exception into asynckv's tree (keeps ours as they are)."""
    from ..errors import AsyncKVError

    if isinstance(exc, AsyncKVError):
        return exc
    name = type(exc).__name__
    if name == "nixlRemoteDisconnectError":
        err: BaseException = PeerUnreachable(f"{what}: peer disconnected ({name})")
    else:
        err = TransportError(f"{what}: {name}: {exc}")
    err.__cause__ = exc
    return err


@dataclasses.dataclass(slots=True)
class _Call:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    fut: asyncio.Future[Any]


@dataclasses.dataclass(slots=True)
class _Post:
    """A group of transfer handles that succeed or fail together."""

    build: Callable[[Any], list[Any]]
    """Runs on the engine thread: creates the (unposted) handles."""
    fut: asyncio.Future[Any]
    timeout_s: float
    what: str
    peer: str | None = None
    """Remote agent name, so every post to a dead peer can be cancelled at once."""
    may_write: Callable[[], bool] | None = None
    """Checked on this thread before every post and while in flight (the peer's write lease)."""
    handles: list[Any] = dataclasses.field(default_factory=list)
    pending: list[Any] = dataclasses.field(default_factory=list)
    deadline: float = 0.0


class NixlEngine:
    """One NIXL agent plus the thread that owns it."""

    def __init__(self, name: str, *, backend: str = "UCX", idle_poll_s: float = 0.001,
                 deep_idle_s: float = 0.01, expecting: Callable[[], bool] | None = None) -> None:
        self.name = name
        self._backend = backend
        self._idle_poll_s = idle_poll_s
        self._deep_idle_s = max(deep_idle_s, idle_poll_s)
        self._expecting = expecting
        """True while peers may write to us (decode rooms waiting): keep the target progressing
        every ``idle_poll_s``; otherwise back off to ``deep_idle_s`` (our own posts wake us)."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._commands: queue.SimpleQueue[_Call | _Post | None] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.agent: Any = None
        self.posts_in_flight = 0
        self.rounds = 0
        self.thread_error: BaseException | None = None
        self.faults: Any = None
        """A fault injector (asynckv.testing.FaultInjector) consulted before every post; tests only."""
        self._cancelled: dict[str, BaseException] = {}

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._closed

    async def start(self) -> None:
        """Create the agent on a new engine thread."""
        self._loop = asyncio.get_running_loop()
        ready: asyncio.Future[None] = self._loop.create_future()
        self._thread = threading.Thread(target=self._run, args=(ready,), name=f"asynckv-nixl-{self.name[:8]}",
                                        daemon=True)
        self._thread.start()
        await ready

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(agent, *args)`` on the engine thread and return its result."""
        fut = self._submit_future()
        self._put(_Call(fn, args, fut))
        return await fut

    def post(self, build: Callable[[Any], list[Any]], *, timeout_s: float, what: str, peer: str | None = None,
             may_write: Callable[[], bool] | None = None) -> asyncio.Future[Any]:
        """Create handles with ``build(agent)`` on the engine thread, post them, and return a
        future that resolves when all are DONE (or fails with the first error, the deadline,
        a revoked lease or a cancelled peer). Handles are released either way."""
        fut = self._submit_future()
        self._put(_Post(build, fut, timeout_s, what, peer, may_write))
        return fut

    def cancel_peer(self, peer: str, exc: BaseException) -> None:
        """Fail (and release) every post to ``peer``, in flight or queued, with ``exc``."""
        if len(self._cancelled) > 4096:
            self._cancelled.clear()
        self._cancelled[peer] = exc
        self._wake.set()

    def _refusal(self, post: _Post) -> BaseException | None:
        """Why ``post`` may not (or no longer) write, or None."""
        if post.peer is not None and post.peer in self._cancelled:
            return self._cancelled[post.peer]
        if post.may_write is not None and not post.may_write():
            return TransferTimeout(f"{post.what}: the write lease on the peer expired (unheard for too long)")
        return None

    async def close(self, cleanup: Callable[[Any], None] | None = None) -> None:
        """Run ``cleanup(agent)`` on the engine thread, then stop it."""
        if self._closed or self._thread is None:
            self._closed = True
            return
        if cleanup is not None:
            try:
                await self.call(cleanup)
            except Exception:
                log.exception("engine %s: cleanup failed", self.name)
        self._closed = True
        self._commands.put(None)
        self._wake.set()
        thread = self._thread
        await asyncio.get_running_loop().run_in_executor(None, thread.join, 10.0)

    # -- loop side -----------------------------------------------------------------

    def _submit_future(self) -> asyncio.Future[Any]:
        if self._closed or self._loop is None:
            raise ClosedError(f"NIXL engine {self.name} is closed")
        return self._loop.create_future()

    def _put(self, cmd: _Call | _Post) -> None:
        self._commands.put(cmd)
        self._wake.set()

    @staticmethod
    def _deliver(batch: list[tuple[asyncio.Future[Any], Any, BaseException | None]]) -> None:
        for fut, result, exc in batch:
            if fut.done():
                continue  # the awaiting task was cancelled; the handles were still settled
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(result)

    # -- engine thread -----------------------------------------------------------------

    def _run(self, ready: asyncio.Future[None]) -> None:
        loop = self._loop
        if loop is None:  # start() sets it before the thread exists
            return
        try:
            from nixl._api import nixl_agent, nixl_agent_config

            cfg = nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False,
                                    backends=[self._backend])
            self.agent = nixl_agent(self.name, cfg)
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
            log.exception("engine %s: progress thread died", self.name)
            raise

    def _progress_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        agent = self.agent
        in_flight: list[_Post] = []
        idle_wait = _MIN_IDLE_WAIT_S
        while True:
            done: list[tuple[asyncio.Future[Any], Any, BaseException | None]] = []
            stop = False
            while True:
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    break
                if cmd is None:
                    stop = True
                    break
                if isinstance(cmd, _Call):
                    try:
                        done.append((cmd.fut, cmd.fn(agent, *cmd.args), None))
                    except BaseException as exc:
                        done.append((cmd.fut, None, map_nixl_error(exc, getattr(cmd.fn, "__name__", "call"))))
                else:
                    if self._start_post(agent, cmd, done):
                        in_flight.append(cmd)
            if in_flight:
                now = time.monotonic()
                still: list[_Post] = []
                for post in in_flight:
                    if self._check_post(agent, post, now, done):
                        still.append(post)
                in_flight = still
            try:
                agent.get_new_notifs()  # drives UCX progress: we run no progress thread
            except Exception:
                log.debug("get_new_notifs failed", exc_info=True)
            self.posts_in_flight = len(in_flight)
            self.rounds += 1
            if done:
                loop.call_soon_threadsafe(self._deliver, done)
            if stop:
                closed: list[tuple[asyncio.Future[Any], Any, BaseException | None]] = []
                for post in in_flight:
                    self._release(agent, post)
                    closed.append((post.fut, None, ClosedError("engine closed")))
                if closed:
                    loop.call_soon_threadsafe(self._deliver, closed)
                return
            if done:
                idle_wait = _MIN_IDLE_WAIT_S
                time.sleep(0)  # progress was made: go again at once, but yield the GIL
            elif in_flight:
                # Waiting on transfers: back off a little so a spinning poller does not take
                # the CPU that the copy (CMA runs in the kernel) and the peer need.
                self._wake.wait(idle_wait)
                self._wake.clear()
                idle_wait = min(idle_wait * 2, _MAX_BUSY_WAIT_S)
            else:
                self._wake.wait(idle_wait)
                self._wake.clear()
                expecting = self._expecting is None or self._expecting()
                idle_wait = min(idle_wait * 2, self._idle_poll_s if expecting else self._deep_idle_s)

    def _start_post(self, agent: Any, post: _Post, done: list[Any]) -> bool:
        """Create and post the handles; returns whether any is still in flight."""
        post.deadline = time.monotonic() + post.timeout_s
        try:
            refusal = self._refusal(post)
            if refusal is not None:
                raise refusal
            if self.faults is not None and self.faults.before_post(post.what):
                post.pending.append(None)  # stalled by the fault injector: only a deadline or cancel ends it
                return True
            post.handles = post.build(agent)
            for h in post.handles:
                refusal = self._refusal(post)  # the lease may run out between handles
                if refusal is not None:
                    raise refusal
                if agent.transfer(h) != "DONE":
                    post.pending.append(h)
        except BaseException as exc:
            self._release(agent, post)
            done.append((post.fut, None, map_nixl_error(exc, post.what)))
            return False
        if not post.pending:
            self._release(agent, post)
            done.append((post.fut, len(post.handles), None))
            return False
        return True

    def _check_post(self, agent: Any, post: _Post, now: float, done: list[Any]) -> bool:
        """Poll a post's handles; returns whether it is still in flight."""
        try:
            post.pending = [h for h in post.pending if agent.check_xfer_state(h) != "DONE"]
        except BaseException as exc:
            self._release(agent, post)
            done.append((post.fut, None, map_nixl_error(exc, post.what)))
            return False
        if not post.pending:
            self._release(agent, post)
            done.append((post.fut, len(post.handles), None))
            return False
        if now > post.deadline:
            self._release(agent, post)  # cancels what is still PROC
            done.append((post.fut, None, TransferTimeout(
                f"{post.what}: not done after {post.timeout_s:.1f}s (peer stopped?)")))
            return False
        return True

    @staticmethod
    def _release(agent: Any, post: _Post) -> None:
        for h in post.handles:
            try:
                agent.release_xfer_handle(h)
            except Exception:
                log.warning("release_xfer_handle failed", exc_info=True)
        post.handles = []
        post.pending = []
