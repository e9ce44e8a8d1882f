"""The ZMQ control channel: one PULL reader per manager, one PUSH socket per peer endpoint.

This module owns the ZMQ context and every socket. Two promises:

- **order**: messages to one endpoint leave in the order ``send`` was called, whatever
  path they take: a message goes straight to ZMQ only when nothing is waiting for that
  endpoint, else it queues behind what is (one drain task per endpoint);
- **nothing silently lost on close**: ``close`` waits (bounded) until each endpoint's
  backlog is handed to ZMQ, then lets ZMQ linger so queued frames still reach connected peers.

The reader never dies of a message: every message is decoded and handled inside its own error
boundary; a bad one is counted, logged (rate limited) and dropped. It stops only when told to, or
when its socket is gone (ZMQ's ETERM or ENOTSOCK), and ``reader_alive`` (``/health``) then says so.

In protected mode (no token, no opt-out: ``Config.protected``) a message whose TCP peer is not
on loopback is dropped unread (``dropped["not_loopback"]``); a registration from such a peer is
answered with the reason, but only to an endpoint on the address it came from (never reflected
to a third host).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
from typing import Any

import zmq
import zmq.asyncio

from .channel import (
    MAX_MESSAGE_BYTES,
    READ_BATCH,
    READ_BATCH_MAX,
    TRANSIENT_PER_S,
    TRANSIENT_SOCKETS,
    ChannelBase,
    log,
    running_in,
)
from .closing import CloseOnce
from .pacing import Pacer
from .ratelimit import RateLimitedLog

__all__ = ["MAX_MESSAGE_BYTES", "READ_BATCH", "READ_BATCH_MAX", "TRANSIENT_PER_S", "TRANSIENT_SOCKETS",
           "ControlChannel", "RateLimitedLog"]

LINGER_MS = 1000
"""How long ZMQ keeps trying to deliver queued frames after a socket is closed."""
_OPEN_CONTEXTS: set[zmq.asyncio.Context] = set()
"""The contexts of channels not closed yet, held here until their close: a context collected as
garbage together with its sockets (a manager left open as its loop closed) blocks for ever in
pyzmq's ``__del__`` -> ``term()``, hanging whichever thread collected it (seen: a left-open decode's gc.collect())."""


@dataclasses.dataclass(eq=False)
class _Peer:
    sock: zmq.asyncio.Socket
    sync: zmq.Socket[bytes]
    """``sock`` without the asyncio wrapper, for the non-blocking fast path (its ``send`` would add a
    future and a loop callback per frame)."""
    backlog: collections.deque[list[bytes]] = dataclasses.field(default_factory=collections.deque)
    drain: asyncio.Task[None] | None = None
    forgotten: bool = False


def _send_now(sock: zmq.Socket[bytes], frames: list[bytes]) -> None:
    """Hand a message to ZMQ without waiting (``zmq.Again`` when its queue is full)."""
    if len(frames) == 1:
        sock.send(frames[0], flags=zmq.NOBLOCK, copy=False)
    else:
        sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)


class ControlChannel(ChannelBase):
    """Receives control messages on one bound PULL socket and sends to peers' endpoints, in order."""

    def _setup(self) -> None:
        self._ctx: zmq.asyncio.Context | None = None
        self._pull: zmq.asyncio.Socket | None = None
        self._peers: dict[str, _Peer] = {}
        self._transient: collections.OrderedDict[str, zmq.asyncio.Socket] = collections.OrderedDict()
        self._sync: zmq.Socket[bytes] | None = None
        """The PULL socket without the asyncio wrapper: the reader reads it directly."""
        self._watch: tuple[asyncio.AbstractEventLoop, int] | None = None
        """The loop that watches the socket's fd, and the fd (kept: reading it again can fail once
        the context is gone)."""
        self._reading = False
        self._resume: asyncio.Handle | None = None
        """The reader's next turn, when it stopped with messages left (ZMQ's fd would not say so)."""
        self._pacer = Pacer(READ_BATCH, READ_BATCH_MAX)
        """Messages the reader takes a turn (``pacing``)."""
        self._closed = False
        self._closer = CloseOnce(self._close)
        self._term: asyncio.Future[None] | None = None

    @property
    def reader_alive(self) -> bool:
        return self._reading

    def stop_reader(self) -> None:
        """Stop reading for good (tests simulate a dead reader with it; ``/health`` then fails). From
        another thread, the fd is unwatched on the loop, in its next round."""
        watch = self._watch
        if watch is not None and not running_in(watch[0]):
            self._reading = False  # (read no more from now on; the loop unwatches the fd next round)
            try:
                watch[0].call_soon_threadsafe(self.stop_reader)
                return
            except RuntimeError:  # (its loop is closed: nothing watches anything any more)
                pass
        if watch is not None:
            watch[0].remove_reader(watch[1])
            self._watch = None  # (the fd number goes back to the OS with the socket: never touch it again)
        self._reading = False  # (only now: a reader stopped halfway would leave the loop spinning on the fd)
        if self._resume is not None:
            self._resume.cancel()
            self._resume = None

    async def start(self) -> str:
        """Bind the PULL socket on a random port and start the reader; returns the endpoint. Once: a
        channel is not restarted."""
        if self._ctx is not None or self._closed:
            raise RuntimeError("control channel already started")
        self._ctx = zmq.asyncio.Context()
        _OPEN_CONTEXTS.add(self._ctx)
        pull = self._ctx.socket(zmq.PULL)
        pull.setsockopt(zmq.LINGER, 0)
        pull.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        if ":" in self._host:
            pull.setsockopt(zmq.IPV6, 1)
            host = f"[{self._host}]"
        else:
            host = self._host
        port = pull.bind_to_random_port(f"tcp://{host}")
        self._pull = pull
        self.endpoint = f"tcp://{host}:{port}"
        sync: zmq.Socket[bytes] = zmq.Socket.shadow(pull.underlying)
        self._sync = sync
        loop = asyncio.get_running_loop()
        self._watch = (loop, sync.FD)
        loop.add_reader(sync.FD, self._on_readable)
        self._reading = True
        self._resume = loop.call_soon(self._read)  # (whatever came before the fd was watched)
        return self.endpoint

    def _on_readable(self) -> None:
        """ZMQ's fd became readable: something changed, maybe a message came (or several)."""
        if self._resume is None:  # (else a turn is already due this round)
            self._read()

    def _read(self) -> None:
        """Read and handle what is queued, ``READ_BATCH`` at most (more while the loop's rounds are
        short: ``pacing``), then come back next round if more may be left. A callback on ZMQ's fd,
        rather than a task awaiting ``recv``: no future, no task step and none of pyzmq's event
        bookkeeping per wake-up. ZMQ's fd only signals a change, so the reader reads until
        ``zmq.Again`` (which also clears the fd) or schedules its next turn."""
        self._resume = None
        sync, watch = self._sync, self._watch
        if not self._reading or sync is None or watch is None:
            return
        loop, fd = watch
        more = True  # (until ZMQ says its queue is empty: the next message then signals the fd)
        retry = False
        try:
            for _ in range(self._pacer.take()):
                if not self._reading:  # (a handler stopped it)
                    return
                frames, origin = self._recv_now(sync)
                self.received += 1
                self._handle(frames, origin)
        except zmq.Again:
            more = False
        except zmq.ZMQError as exc:
            more = False
            if exc.errno in (zmq.ETERM, zmq.ENOTSOCK):  # the socket is gone: the reader is dead (health says so)
                was_reading = self._reading
                self.stop_reader()  # (first: whatever the logging raises, the reader is stopped)
                if was_reading:
                    log.error("control reader: stopped, its socket is gone: %s", exc)
            elif self._reading:
                retry = True
                self._rl.warning("recv", "control reader: recv failed: %s", exc)
        except Exception:  # (``_handle`` has its own boundary: this would be a bug here; keep reading)
            log.exception("control reader: unexpected error")
        finally:  # whatever escapes (a signal handler's exception, say), the reader is never left stalled
            if self._reading and self._resume is None:
                if retry:  # unread, the fd stays readable: the loop would spin on it, so unwatch it a while
                    self._resume = loop.call_later(0.01, self._rewatch)
                    loop.remove_reader(fd)
                elif more:
                    self._pacer.scheduled()
                    self._resume = loop.call_soon(self._read)  # let timers and other callbacks run first

    def _rewatch(self) -> None:
        self._resume = None
        if self._reading and self._watch is not None:
            loop, fd = self._watch
            loop.add_reader(fd, self._on_readable)
            self._read()

    def _recv_now(self, sync: zmq.Socket[bytes]) -> tuple[list[bytes], str | None]:
        """A queued message's frames, and its TCP peer address in protected mode (only ZMQ frame
        objects carry it); raises ``zmq.Again`` when none is queued."""
        first = sync.recv(zmq.NOBLOCK, copy=False)
        frames = [first.bytes]
        if first.more:  # a multipart message (SGLang's wire; asynckv before version 4): its rest is queued
            frames += sync.recv_multipart(zmq.NOBLOCK)
        return frames, str(first.get("Peer-Address")) if self._loopback_only else None

    # -- sending ---------------------------------------------------------------------------

    def send(self, endpoint: str, msg: Any, transient: bool = False) -> None:
        """Queue ``msg`` for ``endpoint`` behind everything queued for it before; never blocks.
        ``transient``: a reply to an endpoint nobody vouched for (see ``_send_transient``)."""
        if self._closed or self._ctx is None:
            return
        if not self._speaks(endpoint, "zmq", msg):
            return
        frames = self._frames(endpoint, msg)
        if transient and endpoint not in self._peers:
            self._send_transient(endpoint, type(msg).__name__, frames)
            return
        peer = self._peer(endpoint)
        if not peer.backlog:
            try:
                _send_now(peer.sync, frames)
                return
            except zmq.Again:
                pass
            except zmq.ZMQError as exc:
                self._failed(endpoint, type(msg).__name__, exc)
                return
        peer.backlog.append(frames)
        if peer.drain is None:
            peer.drain = asyncio.get_running_loop().create_task(self._drain(endpoint, peer),
                                                                name="asynckv-control-drain")

    def _peer(self, endpoint: str) -> _Peer:
        peer = self._peers.get(endpoint)
        if peer is None or peer.forgotten:
            # a transient socket to it becomes the peer's (what it sent stays ahead of what follows)
            sock = self._transient.pop(endpoint, None) or self._connect(endpoint)
            peer = self._peers[endpoint] = _Peer(sock, zmq.Socket.shadow(sock.underlying))
        return peer

    def _connect(self, endpoint: str) -> zmq.asyncio.Socket:
        if self._ctx is None:
            raise RuntimeError("control channel not started")
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, LINGER_MS)
        sock.setsockopt(zmq.SNDHWM, 10000)
        if endpoint.startswith("tcp://["):
            sock.setsockopt(zmq.IPV6, 1)
        sock.connect(endpoint)
        return sock

    def _send_transient(self, endpoint: str, what: str, frames: list[bytes]) -> None:
        """Best effort, bounded: at most ``TRANSIENT_PER_S`` replies a second through at most
        ``TRANSIENT_SOCKETS`` sockets (a ping naming a new made-up endpoint each time opened a
        socket for good: 1,022 of them, then every send failed with 'Too many open files')."""
        if not self._reply_allowed(endpoint, what):
            return
        sock = self._transient.pop(endpoint, None) or self._connect(endpoint)
        self._transient[endpoint] = sock
        while len(self._transient) > TRANSIENT_SOCKETS:
            self._transient.popitem(last=False)[1].close(linger=LINGER_MS)
        try:
            _send_now(zmq.Socket.shadow(sock.underlying), frames)
        except zmq.ZMQError as exc:
            self._failed(endpoint, what, exc)

    async def _drain(self, endpoint: str, peer: _Peer) -> None:
        """Hand the endpoint's backlog to ZMQ in order, waiting (bounded) while its queue is full."""
        try:
            while peer.backlog:
                frames = peer.backlog[0]
                try:
                    await asyncio.wait_for(peer.sock.send_multipart(frames, copy=False), self._send_timeout_s)
                except (TimeoutError, zmq.ZMQError) as exc:
                    self._failed(endpoint, f"{len(peer.backlog)} queued messages", exc)
                    peer.backlog.clear()
                    break
                peer.backlog.popleft()
        finally:
            peer.drain = None
            if peer.forgotten:
                peer.sock.close(linger=LINGER_MS)

    def forget(self, endpoint: str) -> None:
        """Close the socket to a peer that went away, once what was queued for it left."""
        peer = self._peers.pop(endpoint, None)
        if peer is None:
            return
        peer.forgotten = True
        if peer.drain is None:
            peer.sock.close(linger=LINGER_MS)

    async def close(self, flush_s: float = 2.0) -> None:
        """Stop reading, hand every backlog to ZMQ (at most ``flush_s``), close, terminate the context. It runs
        once, as a task; one cut short starts again and carries on (``CloseOnce``)."""
        self._closed = True
        self.stop_reader()  # (at once: not a round later, when the close's task first runs)
        await self._closer(flush_s)

    async def _close(self, flush_s: float) -> None:  # (after close(): reading stopped)
        drains = [p.drain for p in self._peers.values() if p.drain is not None]
        if drains:
            await asyncio.wait(drains, timeout=flush_s)
            for task in drains:
                task.cancel()
        for peer in self._peers.values():
            peer.sock.close(linger=LINGER_MS)
        self._peers.clear()
        for sock in self._transient.values():
            sock.close(linger=LINGER_MS)
        self._transient.clear()
        if self._pull is not None:
            self._pull.close(linger=0)
            self._pull = None
        ctx, self._ctx = self._ctx, None
        if ctx is not None:  # term() waits for lingering frames: not on the event loop; the context stays held
            self._term = asyncio.get_running_loop().run_in_executor(None, ctx.term)  # until it returned
            self._term.add_done_callback(lambda _: _OPEN_CONTEXTS.discard(ctx))
        if self._term is not None:
            await asyncio.shield(self._term)  # (a close cut short waits for that same term)
