"""The ZMQ control channel: one PULL reader per manager, cached PUSH sockets per peer.

The reader never dies: every message is decoded and handled inside its own error
boundary; a bad one is counted, logged (rate limited) and dropped.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable

import zmq
import zmq.asyncio

from ..errors import ClosedError, PeerUnreachable, RemoteProtocolError
from ..proto.auth import Authenticator, AuthError
from ..proto.messages import Message, VersionMismatch, decode, encode

__all__ = ["ControlChannel", "RateLimitedLog"]

log = logging.getLogger("asynckv.control")

MAX_MESSAGE_BYTES = 64 * 1024 * 1024


class RateLimitedLog:
    """Logs at most ``burst`` lines per ``period_s`` per key; counts what it suppressed."""

    def __init__(self, logger: logging.Logger, period_s: float = 10.0, burst: int = 5) -> None:
        self._log = logger
        self._period = period_s
        self._burst = burst
        self._window: dict[str, tuple[float, int]] = {}
        self.suppressed = 0

    def warning(self, key: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        start, count = self._window.get(key, (now, 0))
        if now - start > self._period:
            start, count = now, 0
        if count < self._burst:
            self._log.warning(msg, *args)
        else:
            self.suppressed += 1
        self._window[key] = (start, count + 1)
        if len(self._window) > 1024:
            self._window.clear()


class ControlChannel:
    """Receives control messages on one bound PULL socket and sends to peers' endpoints."""

    def __init__(self, ctx: zmq.asyncio.Context, host: str, on_message: Callable[[Message], None],
                 on_version_mismatch: Callable[[VersionMismatch], None] | None = None,
                 send_timeout_s: float = 5.0, auth: Authenticator | None = None) -> None:
        self._ctx = ctx
        self._host = host
        self._on_message = on_message
        self._on_version_mismatch = on_version_mismatch
        self._send_timeout_s = send_timeout_s
        self._auth = auth
        self._pull: zmq.asyncio.Socket | None = None
        self._push: dict[str, zmq.asyncio.Socket] = {}
        self._reader: asyncio.Task[None] | None = None
        self._closed = False
        self.endpoint = ""
        self.received = 0
        self.dropped: collections.Counter[str] = collections.Counter()
        self._rl = RateLimitedLog(log)

    @property
    def reader_alive(self) -> bool:
        return self._reader is not None and not self._reader.done()

    async def start(self) -> str:
        """Bind the PULL socket on a random port and start the reader; returns the endpoint."""
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
        self._reader = asyncio.get_running_loop().create_task(self._read_loop(), name="asynckv-control-reader")
        return self.endpoint

    async def _read_loop(self) -> None:
        pull = self._pull
        if pull is None:
            return
        while True:
            try:
                frames = await pull.recv_multipart(copy=True)
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError as exc:
                if self._closed:
                    return
                self._rl.warning("recv", "control reader: recv failed: %s", exc)
                await asyncio.sleep(0.01)
                continue
            self.received += 1
            self._handle(frames)

    def _handle(self, frames: list[bytes]) -> None:
        if self._auth is not None:
            try:
                # Freshness needs a clock shared across hosts: the one wall-clock read (see proto.auth).
                frames = self._auth.open(frames, time.time_ns())
            except AuthError as exc:
                self.dropped[f"auth_{exc.kind}"] += 1
                self._rl.warning("auth", "control: refused message: %s", exc)
                return
        try:
            msg = decode(frames)
        except VersionMismatch as exc:
            self.dropped["version"] += 1
            self._rl.warning("version", "control: dropped message: %s", exc)
            if self._on_version_mismatch is not None:
                try:
                    self._on_version_mismatch(exc)
                except Exception:
                    log.exception("control: version-mismatch handler failed")
            return
        except RemoteProtocolError as exc:
            self.dropped["malformed"] += 1
            self._rl.warning("malformed", "control: dropped malformed message: %s", exc)
            return
        except Exception as exc:  # a decoder bug must not kill the reader either
            self.dropped["malformed"] += 1
            self._rl.warning("malformed", "control: dropped undecodable message: %r", exc)
            return
        try:
            self._on_message(msg)
        except Exception:
            self.dropped["handler"] += 1
            log.exception("control: handler failed for %s", type(msg).__name__)

    def try_send(self, endpoint: str, msg: Message) -> bool:
        """Queue ``msg`` without waiting; False if ZMQ's queue to that peer is full (or closed)."""
        if self._closed:
            return False
        try:
            zmq.Socket.send_multipart(self._socket(endpoint), self._frames(msg), flags=zmq.NOBLOCK, copy=False)
        except zmq.ZMQError:
            return False
        return True

    def _frames(self, msg: Message) -> list[bytes]:
        frames = encode(msg)
        if self._auth is not None:
            frames = self._auth.seal(frames, time.time_ns())
        return frames

    def _socket(self, endpoint: str) -> zmq.asyncio.Socket:
        sock = self._push.get(endpoint)
        if sock is None:
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 10000)
            if endpoint.startswith("tcp://["):
                sock.setsockopt(zmq.IPV6, 1)
            sock.connect(endpoint)
            self._push[endpoint] = sock
        return sock

    async def send(self, endpoint: str, msg: Message) -> None:
        """Send ``msg`` to a peer's endpoint; raises PeerUnreachable if ZMQ cannot take it in time."""
        if self._closed:
            raise ClosedError("control channel is closed")
        sock = self._socket(endpoint)
        frames = self._frames(msg)
        try:
            # Fast path: ZMQ queues the message at once unless the peer's queue is full; only
            # then wait (bounded) for room. Saves a task and a timer per message.
            zmq.Socket.send_multipart(sock, frames, flags=zmq.NOBLOCK, copy=False)
            return
        except zmq.Again:
            pass
        except zmq.ZMQError as exc:
            raise PeerUnreachable(f"cannot send {type(msg).__name__} to {endpoint}: {exc!r}") from exc
        try:
            await asyncio.wait_for(sock.send_multipart(frames, copy=False), self._send_timeout_s)
        except (TimeoutError, zmq.ZMQError) as exc:
            raise PeerUnreachable(f"cannot send {type(msg).__name__} to {endpoint}: {exc!r}") from exc

    def forget(self, endpoint: str) -> None:
        """Close the cached PUSH socket of a peer that went away."""
        sock = self._push.pop(endpoint, None)
        if sock is not None:
            sock.close(linger=0)

    async def close(self) -> None:
        self._closed = True
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except (asyncio.CancelledError, Exception):
                pass
        for sock in self._push.values():
            sock.close(linger=0)
        self._push.clear()
        if self._pull is not None:
            self._pull.close(linger=0)
            self._pull = None
