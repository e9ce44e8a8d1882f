"""The NIXL engine thread: the only code that calls into a NIXL agent. Measured on this kind of
machine (2-core VM, UCX over loopback, DRAM):

- two threads touching one agent in its default sync mode segfaulted (4 of 4 runs), so exactly one
  thread, this one, calls into the agent and needs no locks;
- on one host ``transfer()`` performs the whole DRAM copy inside the call (256 MiB took about 50 ms) and
  ``add_remote_agent`` takes about 20 ms: none of it may run on the event loop;
- the stock progress thread spins a whole core, so it is off and this thread drives progress: tightly while
  transfers are in flight, else every ``idle_poll_s`` while peers may write to us (a target that stops progressing
  stalls its initiators), else every ``deep_idle_s``; a stopped peer leaves a handle in ``PROC`` forever (20 s and
  more seen): every post has a deadline.

The loop hands commands over a queue; settled posts come back through an ``Outbox`` that the loop drains a few per
round, each as soon as it settled (1-page rooms, 32 in flight: 6.7 ms from copy to settle, p50, when a round's
settles went together; 2.7 ms one by one). Posts queued together may move as one handle (``merging``). A post is a
series of handles, one in flight at a time; its write lease and the cancel set are checked before each starts, so a
cancelled or lease-lapsed post lands at most the handle already in flight (posting every handle at once let a slow
TCP post land bytes for seconds past its lease in the simulator).

NIXL cannot cancel a transfer in flight: releasing a ``PROC`` handle lets UCX finish it into freed memory, and tearing
an agent down under requests queued to a stopped peer aborted the process (docs/failures.md). So a post that is
cancelled, loses its lease or its peer *stops*: it starts no further handle and settles (with the error) once the
handle already in flight completed or failed. Only a post unfinished at its deadline, or at close, settles with a
handle in flight: the handle is *parked*, polled each round and released once it completes or fails. Forgetting a peer
and closing run as one sequence on this thread; if handles are still parked at close (a peer stopped for good, or the
thread died), the agent and its registrations are kept until the process exits, whatever step of the close raised.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import time
from typing import Any

import numpy as np

from ..errors import ClosedError, PeerUnreachable, RemoteProtocolError, TransferTimeout, TransportError
from ..proto.topology import check_metadata_name
from .agent import keep_until_exit
from .base import U64, DescPiece, MemoryLayout, PreppedPiece
from .commands import Cancel, Forget, PostCmd, Relay, hand_on, map_nixl_error
from .engine_state import EngineState, resolve
from .merging import members, merge_run

__all__ = ["NixlEngine"]

log = logging.getLogger("asynckv.nixl")

SETTLE_AT_CLOSE_S = 0.1  # how long close drives the UCX worker so parked transfers can complete
_MIN_IDLE_WAIT_S, _MAX_BUSY_WAIT_S = 20e-6, 250e-6


class NixlEngine(EngineState):
    """The engine-thread half of ``NixlDataPlane``: the thread, the agent, and every call into it."""

    def _run(self, ready: asyncio.Future[None]) -> None:
        loop = self._loop
        try:
            if loop is None:
                return
            err: BaseException | None = None
            try:
                self._agent = self._agent_factory(self.name, self._backend)
            except BaseException as exc:
                err = TransportError(f"cannot create NIXL agent ({self._backend}): {exc}")
                err.__cause__ = exc
            with contextlib.suppress(RuntimeError):  # (a closed loop: the progress loop sees it)
                loop.call_soon_threadsafe(resolve, ready, err)  # (a start() cancelled meanwhile: dropped)
            if err is None:
                self._progress_loop(loop)
        except BaseException as exc:
            self.thread_error = exc
            log.exception("data plane %s: engine thread died", self.name)
            raise
        finally:
            self._running = False

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
        # The name is read before loading: metadata naming another agent would merge into (and the
        # undo would remove) that agent's connection, and a name that is not UTF-8 could not be undone.
        check_metadata_name(metadata, peer)
        loaded = agent.add_remote_agent(metadata)
        name = loaded.decode("utf-8", "replace") if isinstance(loaded, bytes) else str(loaded)
        if name != peer:  # (cannot happen after the check; never undo what another peer loaded)
            if name not in self._remote and name not in self._retired:
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
        """Settle the peer's posts, then release its dlist and remove its agent once its parked handles drained."""
        reason = PeerUnreachable(f"peer {peer[:8]} forgotten")
        for post in self._in_flight:
            if post.peer == peer:
                post.stop = post.stop or reason
        if peer not in self._remote:
            return
        self._retired.setdefault(peer, []).append(self._remote.pop(peer))
        self._retire_drained()

    def _retire_drained(self) -> None:
        """Release the dlists and remove the agents of forgotten peers with nothing in flight or parked."""
        busy = {peer for peer, _ in self._parked} | {post.peer for post in self._in_flight}
        for peer in [p for p in self._retired if p not in busy]:
            calls = [(self._agent.release_dlist_handle, d) for d in self._retired.pop(peer) if d is not None]
            if peer not in self._remote:  # (not connected again meanwhile under the same name)
                calls.append((self._agent.remove_remote_agent, peer))
            for fn, arg in calls:  # (a failure must not end the thread mid-round, with settles in hand)
                try:
                    fn(arg)
                except Exception:
                    log.warning("%s for %s failed", getattr(fn, "__name__", "call"), peer[:8], exc_info=True)

    def _poll_parked(self) -> None:
        still = []
        for peer, handle in self._parked:
            try:
                state = self._agent.check_xfer_state(handle)
            except Exception:
                state = "ERR"  # failed: it no longer holds anything in UCX
            if state == "PROC":
                still.append((peer, handle))
            else:
                self._release(handle)
        self._parked = still
        if self._retired:
            self._retire_drained()

    def _shutdown(self, settle_s: float = SETTLE_AT_CLOSE_S) -> None:
        done: list[Any] = []
        try:  # (what settled here is handed over whatever a later step raises)
            for post in self._in_flight:
                post.stop = post.stop or ClosedError("data plane closed")
            for peer in list(self._remote):
                self._forget(peer, done)
            deadline = time.monotonic() + (settle_s if self._parked or self._in_flight else 0.0)
            while (self._parked or self._in_flight) and time.monotonic() < deadline:
                with contextlib.suppress(Exception):  # (as in the progress loop)
                    self._agent.get_new_notifs()
                self._check_in_flight(time.monotonic(), done)
                self._poll_parked()
                time.sleep(0.001)
            if self._park_the_rest(done):  # a peer stopped for good: tearing down under its transfers would crash
                log.warning("data plane %s: %d transfers still in flight to stopped peers at close; keeping the NIXL "
                            "agent and its registrations until the process exits", self.name, len(self._parked))
                self._reg_handles = []
                return
            if self._local_dlist is not None:
                self._agent.release_dlist_handle(self._local_dlist)
                self._local_dlist = None
            for handle in self._reg_handles:
                self._agent.deregister_memory(handle)
            self._reg_handles.clear()
            self._memory = None  # (its rows, and what owns the memory: ours no longer)
        except BaseException:  # a step raised: park what is still in flight and keep the agent for it
            self._park_the_rest(done)
            raise
        finally:
            self._deliver(done)

    def _park_the_rest(self, done: list[Any]) -> bool:
        """Settle the posts still in flight, parking their handles; if any is parked, keep the agent until exit."""
        for post in self._in_flight:
            self._finish(post, post.stop or ClosedError("data plane closed"), done)
        self._in_flight = []
        if not self._parked:
            return False
        keep_until_exit(self._agent, self._parked, self._retired, self._local_dlist, self._reg_handles, self._memory)
        return True

    # -- engine thread: progress --------------------------------------------------------------

    def _progress_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        agent = self._agent
        idle_wait = _MIN_IDLE_WAIT_S
        while True:
            if loop.is_closed():  # (a manager left open as its loop ended: nothing takes a result, fences or closes)
                return self._left_open()
            self.steer.back()  # (placed by its wake-up: its own CPU mask again)
            done: list[Any] = []
            commands, self._woken = self._woken, []
            self._round = (commands, done)  # (a thread that dies mid-round leaves them to the loop)
            while True:
                try:
                    commands.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            stop = False
            while commands:
                cmd = commands[0]
                if cmd is None:
                    stop = True
                elif isinstance(cmd, PostCmd):  # (with the posts queued behind it to the same peer, when they merge)
                    run = merge_run(commands, self._refusal, time.monotonic(), *self.merge_limits)
                    self._start(run or cmd, done)
                    self.merged += len(run.members) if run else 0
                    del commands[1:len(run.members) if run else 1]
                elif isinstance(cmd, Cancel):
                    self._apply_cancel(cmd, done)
                elif isinstance(cmd, Forget):
                    self._forget(cmd.peer, done)
                elif isinstance(cmd, Relay):
                    hand_on(cmd)
                else:
                    try:
                        done.append((cmd.fut, cmd.fn(*cmd.args), None))
                    except BaseException as exc:
                        done.append((cmd.fut, None, map_nixl_error(exc, getattr(cmd.fn, "__name__", "call"))))
                del commands[0]  # (first: a death from here on finds its result in done, not an orphan)
                if done and commands and isinstance(cmd, PostCmd):  # a copy done, more to come: hand it over now
                    self._deliver(done)
                    done.clear()
            cmd = None
            if self._in_flight:
                self._check_in_flight(time.monotonic(), done)
            if self._parked:
                self._poll_parked()
            try:
                self._notify(agent.get_new_notifs())  # drives UCX progress: there is no progress thread
            except Exception:
                log.debug("get_new_notifs failed", exc_info=True)
            self.posts_in_flight, self.rounds = len(members(self._in_flight)), self.rounds + 1
            if done:  # (after the progress call: handed over before it, 1-page rooms were slower, 0.7 -> 0.9 ms)
                self._deliver(done)
            self._round = ([], [])  # (delivered: nothing of this round is left for the loop to settle)
            if stop:
                return
            if done:  # progress made: go again at once, but yield the GIL; poll soon only if more than our commands
                # (they end any wait) may need us (polls at 20, 40 ... us after each post cost 6-15% of 1-page rooms/s)
                polled = self._in_flight or self._parked or self._notified or self._expecting()
                self._notified = False
                idle_wait = _MIN_IDLE_WAIT_S if polled else self._deep_idle_s
                time.sleep(0)
            else:  # back off: a little while transfers are in flight (spinning takes the copy's CPU), more when idle
                if self._in_flight and idle_wait > _MAX_BUSY_WAIT_S:  # (a post went in flight after an idle wait)
                    idle_wait = _MIN_IDLE_WAIT_S
                with contextlib.suppress(queue.Empty):  # the queue is the wake-up too: a command ends the wait
                    self._woken.append(self._commands.get(timeout=idle_wait))  # (C, unlike Event.wait)
                idle_wait = min(idle_wait * 2, _MAX_BUSY_WAIT_S if self._in_flight else
                                self._idle_poll_s if self._expecting() else self._deep_idle_s)

    def _start(self, post: PostCmd, done: list[Any]) -> None:
        post.deadline = time.monotonic() + post.timeout_s
        self._advance(post, time.monotonic())
        if post.handle is not None:
            self._in_flight.append(post)  # settles when its handle finishes (with post.stop if it stopped)
        else:
            self._finish(post, post.stop, done)

    def _advance(self, post: PostCmd, now: float) -> None:
        """Post the next handles of ``post``, checking the lease and cancel set before each, until one is left in
        flight (TCP) or none is left: a cancelled or lease-lapsed post lands at most that one, on any transport."""
        agent, pieces = self._agent, post.write.pieces
        while post.handle is None and post.stop is None and post.next_piece < len(pieces):
            post.stop = self._refusal(post, now)
            if post.stop is not None:
                return
            piece = pieces[post.next_piece]
            post.next_piece += 1
            try:
                handle = self._handle(post.peer, piece)
            except BaseException as exc:
                post.stop = map_nixl_error(exc, post.label)
                return
            try:
                state = agent.transfer(handle)
            except BaseException as exc:  # it failed: it holds nothing in UCX any more
                post.stop = map_nixl_error(exc, post.label)
                self._release(handle)
                return
            if state == "DONE":  # CMA: the copy happened inside the call
                self._release(handle)
            else:
                post.handle = handle
            now = time.monotonic()

    def _handle(self, peer: str, piece: PreppedPiece | DescPiece) -> Any:
        agent = self._agent
        if isinstance(piece, PreppedPiece):
            remote = self._remote.get(peer)
            if self._local_dlist is None or remote is None:
                raise TransportError(f"no prepared dlists for {peer[:8]}")
            return agent.make_prepped_xfer("WRITE", self._local_dlist, piece.src_idx, remote, piece.dst_idx)
        return agent.initialize_xfer("WRITE", agent.get_xfer_descs(piece.src, piece.src_kind),
                                     agent.get_xfer_descs(piece.dst, piece.dst_kind), peer)

    def _check_in_flight(self, now: float, done: list[Any]) -> None:
        still, posts, i = [], self._in_flight, 0
        try:
            for i, post in enumerate(posts):  # noqa: B007 (read in the finally below)
                post.stop = post.stop or self._refusal(post, now)
                if post.handle is not None and not self._pending(post, post.handle):
                    post.handle = None
                    self._advance(post, now)
                if post.handle is None:
                    self._finish(post, post.stop, done)
                elif now > post.deadline:
                    self._finish(post, TransferTimeout(
                        f"{post.label}: not done after {post.timeout_s:.1f}s (peer stopped?)"), done)
                else:
                    still.append(post)
            i = len(posts)
        finally:  # (raising midway, what it finished is no longer in flight: close settled such a post twice)
            self._in_flight = still + posts[i:]
        if self._retired:
            self._retire_drained()

    def _pending(self, post: PostCmd, handle: Any) -> bool:
        """Whether ``handle`` is still in flight; a finished one is released (a failed one stops the post)."""
        try:
            if self._agent.check_xfer_state(handle) != "DONE":
                return True
        except BaseException as exc:
            post.stop = post.stop or map_nixl_error(exc, post.label)
        self._release(handle)
        return False

    def _release(self, handle: Any) -> None:
        try:
            self._agent.release_xfer_handle(handle)
        except Exception:
            log.warning("release_xfer_handle failed", exc_info=True)

    def _finish(self, post: PostCmd, error: BaseException | None, done: list[Any]) -> None:
        """Report the post once (a merged one: each member). A handle still in flight (deadline, close) is parked."""
        parked = post.handle is not None
        if parked:  # (it may still read the posts' source memory)
            self._parked.append((post.peer, post.handle))
            post.handle = None
            self.settled_in_flight.update(m.post_id for m in members([post]) if m.fut is None)
        if post.members:  # (a member cancelled while the handle flew settles with its own first stop, as a post would)
            for m in post.members:
                self._finish(m, (error if parked else m.stop or error) or self._cancelled.get(m.post_id), done)
            return
        if not parked and error is None and post.write.notif:  # every byte landed: now (never for a write that stopped)
            try:
                self._agent.send_notif(post.peer, post.write.notif)
                self._notified = True  # (UCX may leave it half sent: the next progress calls send the rest)
            except BaseException as exc:
                error = map_nixl_error(exc, f"{post.label}: notification")
        done.append((post.fut, None if post.fut is not None else post.post_id, error))
