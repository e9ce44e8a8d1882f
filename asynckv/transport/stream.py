"""The stream control channel: asynckv's messages over plain TCP, read by the event loop.

Each message is one packed frame (``messages.pack``) behind its length (4 bytes, big-endian). A
channel listens on one port (``stream://host:port``) and opens one connection per peer endpoint it
sends to; nothing is ever sent back on a connection, so each carries one direction.

It keeps the ZMQ channel's promises (``control.py``), with bounds of its own instead of ZMQ's:

- **order**: messages to one endpoint leave in ``send`` order: straight into the connection when it
  is up and not full, else queued behind what waits (at most ``MAX_BACKLOG``; beyond, dropped and
  counted);
- **reconnection**: a connection that fails or is lost is opened again when there is something to
  send, retried with backoff for up to ``send_timeout_s``; then what waited is dropped and counted;
- **no silent stall**: a peer that stops reading (a stopped process) fills the connection; after
  ``send_timeout_s`` without room, the connection is cut and what waited is dropped and counted;
- **nothing silently lost on close**: ``close`` and ``forget`` wait (bounded) for queued messages
  to leave, and a closed connection lingers ``LINGER_S`` at most to hand its last bytes to the peer;
  ``close`` returns once every connection is gone (a message sent to an endpoint after ``forget``
  goes out on a new connection and may overtake what the old one still hands over);
- **fair reads**: ``READ_BATCH`` messages per loop round, up to ``READ_BATCH_MAX`` while the loop's
  rounds are short (``pacing``), across each connection; one with more pauses until its next turn,
  so a flood cannot hold the loop;
- **bounded reads**: ``MAX_INBOUND`` connections (a new one beyond cuts the one heard from
  longest ago), ``INBOUND_BYTES`` of unfinished messages in all (beyond, the connection holding
  the most is cut), and in protected mode one message of ``FOREIGN_MAX_BYTES`` at most from a
  host that is not loopback (it is only read to tell a registration why not; then it is cut);
- replies to endpoints nobody vouched for, protected mode and authentication as in ``channel.py``.

A length beyond the limit cuts the connection that sent it (the stream cannot be resynchronised);
anything else bad in a message drops that message alone.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ipaddress
import socket
from typing import Any

from .channel import TRANSIENT_SOCKETS, ChannelBase, running_in
from .closing import CloseOnce
from .stream_conns import COALESCE_BYTES, HEADER, LINGER_S, MAX_BACKLOG, MAX_INBOUND, Connection, Inbound, Outbound

__all__ = ["LINGER_S", "MAX_BACKLOG", "MAX_INBOUND", "StreamChannel"]


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class StreamChannel(ChannelBase):
    """Receives control messages on one listening TCP port and sends to peers' endpoints, in order."""

    def _setup(self) -> None:
        if not self._one_frame:
            raise ValueError("the stream channel carries asynckv's wire only (one packed frame per message)")
        self._server: asyncio.Server | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._inbound: set[Inbound] = set()
        self._buffered = 0
        """Bytes of unfinished messages held by accepted connections (``INBOUND_BYTES`` at most)."""
        self._peers: dict[str, Outbound] = {}
        self._transient: collections.OrderedDict[str, Outbound] = collections.OrderedDict()
        self._finishing: dict[str, Outbound] = {}
        """Forgotten or evicted, still handing over what was queued (taken back by a new send)."""
        self._lingering: set[Connection] = set()
        self._reading = False
        self._stopped = False
        self._closed = False
        self._closer = CloseOnce(self._close)

    @property
    def reader_alive(self) -> bool:
        return self._reading

    def stop_reader(self) -> None:
        """Stop reading for good: no new connection is accepted and none is read (``/health`` fails)."""
        self._reading, self._stopped = False, True
        loop = self._loop
        if loop is not None and not loop.is_closed() and not running_in(loop):
            loop.call_soon_threadsafe(self.stop_reader)
            return
        if self._server is not None:
            self._server.close()
        for conn in list(self._inbound):
            conn.pause()

    async def start(self) -> str:
        """Listen on a random port; returns the endpoint. Once: a channel is not restarted."""
        if self._server is not None or self._closed:
            raise RuntimeError("control channel already started")
        self._loop = loop = asyncio.get_running_loop()
        self._reading = not self._stopped
        # One address, so one port: a name that resolves to several would get a listener (and a
        # random port) on each, and peers resolving it in another order would miss. Like ZMQ
        # (without its IPv6 option), IPv4 first; a name is advertised as the address bound.
        infos = await loop.getaddrinfo(self._host, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        addresses = [str(info[4][0]) for info in infos]
        address = next((a for a in addresses if ":" not in a), addresses[0])
        self._server = await loop.create_server(lambda: Inbound(self), address, 0)
        port = self._server.sockets[0].getsockname()[1]
        host = self._host if _is_address(self._host) else address
        self.endpoint = f"stream://{f'[{host}]' if ':' in host else host}:{port}"
        return self.endpoint

    def send(self, endpoint: str, msg: Any, transient: bool = False) -> None:
        """Queue ``msg`` for ``endpoint`` behind everything queued for it before; never blocks.
        ``transient``: a reply to an endpoint nobody vouched for (bounded, see ``channel.py``)."""
        if self._closed or self._server is None:
            return
        if not self._speaks(endpoint, "stream", msg):
            return
        frame = self._frames(endpoint, msg)[0]
        data: bytes | tuple[bytes, bytes] = (
            HEADER.pack(len(frame)) + frame if len(frame) <= COALESCE_BYTES else (HEADER.pack(len(frame)), frame))
        if transient and endpoint not in self._peers:
            if not self._reply_allowed(endpoint, type(msg).__name__):
                return
            out = self._transient.pop(endpoint, None) or self._adopt(endpoint)
            self._transient[endpoint] = out
            while len(self._transient) > TRANSIENT_SOCKETS:
                self._finish(self._transient.popitem(last=False)[1])
            out.send(data)
            return
        peer = self._peers.get(endpoint)
        if peer is None:  # (a transient connection to it becomes the peer's: what it sent stays ahead)
            peer = self._transient.pop(endpoint, None) or self._adopt(endpoint)
            self._peers[endpoint] = peer
        peer.send(data)

    def _adopt(self, endpoint: str) -> Outbound:
        """The connection still finishing for ``endpoint`` (what it queued stays ahead), or a new one."""
        out = self._finishing.pop(endpoint, None)
        if out is None:
            return Outbound(self, endpoint)
        out.finishing = False
        return out

    def _finish(self, out: Outbound) -> None:
        out.finishing = True
        if out.backlog or out.connecting is not None:
            self._finishing[out.endpoint] = out
        else:
            out.close()

    def forget(self, endpoint: str) -> None:
        """Close the connection to a peer that went away, once what was queued for it left."""
        out = self._peers.pop(endpoint, None)
        if out is not None:
            self._finish(out)

    async def close(self, flush_s: float = 2.0) -> None:
        """Stop reading, let queued messages leave (at most ``flush_s``), close every connection and
        return once they are gone (lingering ones cut after ``LINGER_S``). It runs once, as a task; one cut short
        starts again and carries on (``CloseOnce``)."""
        self._closed = True
        self.stop_reader()  # (at once: not a round later, when the close's task first runs)
        await self._closer(flush_s)

    async def _close(self, flush_s: float) -> None:  # (after close(): reading stopped)
        outs = [*self._peers.values(), *self._transient.values(), *self._finishing.values()]
        for out in outs:  # (a connect a cancel-all cut left what waits with no connection: it goes now)
            out._ensure_connecting()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + flush_s
        while any(out.busy for out in outs) and loop.time() < deadline:
            await asyncio.sleep(0.005)
        for out in outs:
            if out.backlog:
                self._failed(out.endpoint, f"{len(out.backlog)} queued messages", TimeoutError("closed"))
                out.backlog.clear()
            out.close()
        self._peers.clear()
        self._transient.clear()
        self._finishing.clear()
        for conn in list(self._inbound):
            conn.cut()
        deadline = loop.time() + LINGER_S + 0.1
        while self._lingering and loop.time() < deadline:
            await asyncio.sleep(0.005)
        server, self._server = self._server, None
        if server is not None:
            server.close()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(server.wait_closed(), 1.0)
