"""The connections of the stream control channel (``stream.py``, where its promises are): an
``Inbound`` for each connection a peer opened to us, an ``Outbound`` for each peer endpoint we
send to, and a ``Connection`` for each connection an ``Outbound`` opens (a new one each time)."""

from __future__ import annotations

import asyncio
import collections
import itertools
import struct
from typing import TYPE_CHECKING, cast

from ..proto.auth import is_loopback
from ..proto.endpoints import endpoint_address
from .channel import MAX_MESSAGE_BYTES, READ_BATCH, READ_BATCH_MAX, log
from .pacing import Pacer

if TYPE_CHECKING:
    from .stream import StreamChannel

__all__ = ["COALESCE_BYTES", "HEADER", "LINGER_S", "MAX_BACKLOG", "MAX_INBOUND", "Connection", "Inbound",
           "Outbound"]

HEADER = struct.Struct("!I")
MAX_BACKLOG = 10_000
"""Messages waiting for one endpoint at most (ZMQ's send queue held as many)."""
WRITE_HIGH_WATER = 4 * 2**20
"""Bytes a connection buffers before it counts as full (and ``send_timeout_s`` starts to run)."""
LINGER_S = 1.0
"""How long a closed connection keeps handing its last bytes to a peer before it is cut."""
MAX_INBOUND = 2048
"""Connections open at once at most (a rank's peers open one each); a new one beyond cuts the one
heard from longest ago (a live peer pings every heartbeat interval)."""
INBOUND_BYTES = 2 * MAX_MESSAGE_BYTES
"""Bytes of unfinished messages held across all accepted connections at most; beyond, the
connection holding the most is cut (whoever sent the last bytes)."""
FOREIGN_MAX_BYTES = 4 * 2**20
"""Protected mode: the largest message read from a host that is not loopback (a registration)."""
COALESCE_BYTES = 64 * 1024
"""A message up to this size goes out with its length in one write (one segment); a larger one in
two writes (no copy of a large body)."""
_HEARD = itertools.count()
"""Orders the events that make a connection heard from (accepted, bytes read): a clock would tie
(uvloop's reads a millisecond that is the same for a whole loop round), an order cannot."""


class Inbound(asyncio.Protocol):
    """One connection a peer opened to us: split into messages, handed on a few per loop round."""

    def __init__(self, channel: StreamChannel) -> None:
        self._ch = channel
        self._buf = bytearray()
        self._transport: asyncio.Transport | None = None
        self._origin: str | None = None
        self._foreign = False
        """Protected mode, a peer not on loopback: one message of ``FOREIGN_MAX_BYTES`` at most is
        read (to tell a registration why not), then the connection is cut."""
        self._turn: asyncio.Handle | None = None
        self._pacer = Pacer(READ_BATCH, READ_BATCH_MAX)
        self._loop = asyncio.get_running_loop()
        self.last_heard = next(_HEARD)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # (create_server's TCP transports are)
        ch = self._ch
        if not ch._reading:
            transport.abort()
            return
        if len(ch._inbound) >= MAX_INBOUND:  # the one heard from longest ago goes, not the newcomer
            victim = min(ch._inbound, key=lambda conn: conn.last_heard)
            ch.dropped["connections_evicted"] += 1
            ch._rl.warning("inbound", "control: %d connections are open: cut the one from %s, silent longest",
                           MAX_INBOUND, victim._origin or "a peer")
            victim.cut()
        self._transport = transport
        if ch._loopback_only:
            peer = transport.get_extra_info("peername")
            self._origin = str(peer[0]) if peer else "unknown"
            self._foreign = not is_loopback(self._origin)
        ch._inbound.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._release()

    def data_received(self, data: bytes) -> None:
        ch = self._ch
        if not ch._reading:  # (stopped: what a transport still delivers is not read)
            self.pause()
            return
        self.last_heard = next(_HEARD)
        self._buf += data
        ch._buffered += len(data)
        if ch._buffered > INBOUND_BYTES:  # the connection holding most goes, not the one that came last
            victim = max(ch._inbound, key=lambda conn: len(conn._buf))
            ch.dropped["inbound_limit"] += 1
            ch._rl.warning("inbound", "control: cut a connection from %s holding %d bytes of unfinished messages "
                           "(over %d in all)", victim._origin or "a peer", len(victim._buf), INBOUND_BYTES)
            victim.cut()
            if victim is self:
                return
        if self._turn is None:
            try:
                self._read()
            except (SystemExit, KeyboardInterrupt):
                raise
            except BaseException:  # (past _handle's own boundary: a bug, or a BaseException from a handler.
                # Out of data_received it would make the transport drop the connection and the
                # messages behind; _read's next turn is scheduled already, as the ZMQ reader goes on)
                log.exception("control: reading a connection from %s failed", self._origin or "a peer")

    def pause(self) -> None:
        if self._transport is not None and self._transport.is_reading():
            self._transport.pause_reading()

    def cut(self) -> None:
        """Drop the connection and what it holds, now."""
        transport = self._transport
        self._release()
        if transport is not None:
            transport.abort()

    def _release(self) -> None:
        self._ch._inbound.discard(self)
        self._ch._buffered -= len(self._buf)
        self._buf.clear()
        self._transport = None
        if self._turn is not None:
            self._turn.cancel()
            self._turn = None

    def _read(self) -> None:
        """Hand on a few complete messages (``READ_BATCH``, more while the loop's rounds are short:
        ``pacing``); come back next round if more are in."""
        self._turn = None
        ch, buf, pos, handled, most = self._ch, self._buf, 0, 0, self._pacer.take()
        limit = FOREIGN_MAX_BYTES if self._foreign else MAX_MESSAGE_BYTES
        escaped = True
        try:
            while handled < most and ch._reading and len(buf) - pos >= HEADER.size:
                (size,) = HEADER.unpack_from(buf, pos)
                if size > limit:
                    ch.dropped["malformed"] += 1
                    ch._rl.warning("oversize", "control: cut a connection from %s: a %d-byte message is over "
                                   "the %d-byte limit", self._origin or "a peer", size, limit)
                    self.cut()
                    return
                if len(buf) - pos - HEADER.size < size:
                    break
                frame = bytes(buf[pos + HEADER.size:pos + HEADER.size + size])
                pos += HEADER.size + size
                handled += 1
                ch.received += 1
                ch._handle([frame], self._origin)
                if self._foreign:  # (heard once, refused: it gets no more of our memory)
                    self.cut()
                    return
            escaped = False
        finally:  # (whatever escaped a message's handling, the ones behind it are not stranded)
            done = min(pos, len(buf))  # (a cut buffer was released whole)
            del buf[:done]
            ch._buffered -= done
            self._next_turn(escaped or handled == most)

    def _next_turn(self, more: bool) -> None:
        """After a turn: come back next round if it may have left complete messages (``more``), with the
        connection paused meanwhile; else read from the connection again."""
        transport = self._transport
        if not self._ch._reading or transport is None:
            return
        if more and len(self._buf) >= HEADER.size:  # maybe more complete ones: after the others
            self.pause()
            self._pacer.scheduled()
            self._turn = self._loop.call_soon(self._read)
        elif not transport.is_reading():
            transport.resume_reading()


class Connection(asyncio.Protocol):
    """One connection of an ``Outbound`` (a new one for each reconnection): its events go to the
    owner, which ignores those of a connection it no longer uses."""

    def __init__(self, out: Outbound) -> None:
        self.out = out
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # (create_connection's TCP transports are)
        self.out._made(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.out._lost(self, exc)

    def data_received(self, data: bytes) -> None:  # nothing is ever sent this way: a peer that does is cut
        self.out._ch.dropped["malformed"] += 1
        if self.transport is not None:
            self.transport.abort()

    def pause_writing(self) -> None:
        self.out._full(self, True)

    def resume_writing(self) -> None:
        self.out._full(self, False)


class Outbound:
    """What waits to go to one peer endpoint, and the connection it goes into."""

    def __init__(self, channel: StreamChannel, endpoint: str) -> None:
        self._ch = channel
        self.endpoint = endpoint
        self.conn: Connection | None = None
        self.backlog: collections.deque[bytes | tuple[bytes, bytes]] = collections.deque()
        self.connecting: asyncio.Task[None] | None = None
        self.full = False
        self._stall: asyncio.TimerHandle | None = None
        self.finishing = False
        """Close once what waits has left (``forget``, or evicted as a transient)."""
        self.retired = False
        """Closed for good: a connection that comes up after is cut."""
        self._flush_due: asyncio.Handle | None = None
        """This round's write is done, or what waits goes out at the round's end (``send``)."""

    @property
    def busy(self) -> bool:
        """Something still waits to leave, here or in the connection's buffer."""
        transport = self.conn.transport if self.conn is not None else None
        return bool(self.backlog) or self.connecting is not None or (
            transport is not None and transport.get_write_buffer_size() > 0)

    def send(self, data: bytes | tuple[bytes, bytes]) -> None:
        """The first message of a loop round goes straight into the connection; what follows in the
        same round waits for one write at the round's end (a send on loopback costs 30-65 us of
        CPU here whatever its size: at 1,000 rooms in flight it was the loop's largest cost)."""
        conn = self.conn
        if conn is not None and conn.transport is not None and not self.full and not self.backlog \
                and self._flush_due is None and not conn.transport.is_closing():
            self._write(conn.transport, [data])
            self._flush_due = asyncio.get_running_loop().call_soon(self._flush)
            return
        if len(self.backlog) >= MAX_BACKLOG:
            self._ch._failed(self.endpoint, "a message", OverflowError(f"{MAX_BACKLOG} messages already wait"))
            return
        self.backlog.append(data)
        if conn is None:
            self._ensure_connecting()
        elif not self.full and self._flush_due is None:
            self._flush_due = asyncio.get_running_loop().call_soon(self._flush)

    @staticmethod
    def _write(transport: asyncio.Transport, items: list[bytes | tuple[bytes, bytes]]) -> None:
        """Small messages in one write; a large one as its length and its body (no copy of it)."""
        small: list[bytes] = []
        for data in items:
            if isinstance(data, tuple):
                if small:
                    transport.write(b"".join(small))
                    small.clear()
                transport.write(data[0])
                transport.write(data[1])
            else:
                small.append(data)
        if small:
            transport.write(small[0] if len(small) == 1 else b"".join(small))

    def _ensure_connecting(self) -> None:
        if self.conn is None and self.connecting is None and self.backlog and not self.retired:
            self.connecting = asyncio.get_running_loop().create_task(self._connect(), name="asynckv-stream-connect")

    async def _connect(self) -> None:
        """Open the connection, retrying with backoff for up to ``send_timeout_s``. It is taken, and written
        into, only once ``create_connection`` returned: one cancelled after ``connection_made`` (a cancel-all,
        the wait timing out) has its transport closed by the loop, and uvloop lost what had been written into it
        and never resumed writing (a review lost messages in 3 rounds of 5, large messages, cancelled connects)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._ch._send_timeout_s
        delay = 0.005
        try:
            host, port = endpoint_address(self.endpoint)
            while True:
                try:
                    _, conn = await asyncio.wait_for(loop.create_connection(lambda: Connection(self), host, port),
                                                     max(0.001, deadline - loop.time()))
                except (OSError, asyncio.TimeoutError) as exc:
                    error: BaseException = exc
                else:
                    if conn.transport is not None and not self.retired:
                        self.connecting = None
                        self.conn, self.full = conn, False
                        self._flush()
                        return
                    error = ConnectionResetError("the connection closed as it was opened")
                if self.retired:
                    return
                if loop.time() + delay >= deadline:
                    self._give_up(error)
                    return
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.25)
        except Exception as exc:  # a malformed endpoint, a port out of range: counted, never raised
            if self.connecting is asyncio.current_task():
                self._give_up(exc)
        finally:
            if self.connecting is asyncio.current_task():
                self.connecting = None

    def _give_up(self, exc: BaseException) -> None:
        if self.backlog:
            self._ch._failed(self.endpoint, f"{len(self.backlog)} queued messages", exc)
            self.backlog.clear()
        if self.finishing:
            self.close()

    def _made(self, conn: Connection) -> None:
        """(``_connect`` takes the connection once ``create_connection`` returned.)"""
        transport = conn.transport
        if transport is None:
            return
        if self.retired:  # (closed while it was being opened)
            transport.abort()
            return
        transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)

    def _lost(self, conn: Connection, exc: Exception | None) -> None:
        self._ch._lingering.discard(conn)
        conn.transport = None
        if conn is not self.conn:
            return
        self.conn, self.full = None, False
        self._unstall()
        if exc is not None:
            self._ch._rl.warning("lost", "control: connection to %s lost: %r", self.endpoint, exc)
        if self.finishing and not self.backlog:
            self.close()
        else:
            self._ensure_connecting()

    def _full(self, conn: Connection, full: bool) -> None:
        if conn is not self.conn:
            return
        self.full = full
        if full:
            if self._stall is None:
                self._stall = asyncio.get_running_loop().call_later(self._ch._send_timeout_s, self._stalled)
        else:
            self._unstall()
            self._flush()

    def _unstall(self) -> None:
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None

    def _stalled(self) -> None:
        """The peer took nothing for ``send_timeout_s``: cut the connection, drop what waits."""
        self._stall = None
        self._ch._failed(self.endpoint, f"{len(self.backlog)} queued messages",
                         TimeoutError(f"the peer read nothing for {self._ch._send_timeout_s}s"))
        self.backlog.clear()
        if self.conn is not None and self.conn.transport is not None:
            self.conn.transport.abort()

    def _flush(self) -> None:
        """Hand what waits to the connection, up to ``WRITE_HIGH_WATER`` at a time while it has room."""
        self._flush_due = None
        conn = self.conn  # (not into a transport closing: what waits goes on the next connection)
        while conn is not None and conn.transport is not None and self.backlog and not self.full \
                and not conn.transport.is_closing():
            items, size = [], 0
            while self.backlog and size < WRITE_HIGH_WATER:
                item = self.backlog.popleft()
                items.append(item)
                size += len(item[1]) if isinstance(item, tuple) else len(item)
            self._write(conn.transport, items)
        if self.finishing and not self.backlog:
            self.close()

    def close(self) -> None:
        """Close for good now; the connection hands over its last bytes for ``LINGER_S`` at most."""
        self.retired = True
        if self._flush_due is not None:
            self._flush_due.cancel()
            self._flush_due = None
        if self._ch._finishing.get(self.endpoint) is self:
            del self._ch._finishing[self.endpoint]
        task, self.connecting = self.connecting, None
        if task is not None and task is not asyncio.current_task():  # (not from within it: its give-up closes)
            task.cancel()
        self._unstall()
        conn, self.conn = self.conn, None
        transport = conn.transport if conn is not None else None
        if conn is None or transport is None:
            return
        if transport.get_write_buffer_size():
            self._ch._lingering.add(conn)
            asyncio.get_running_loop().call_later(LINGER_S, transport.abort)
        transport.close()
