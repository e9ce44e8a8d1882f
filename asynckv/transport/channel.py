"""What every control channel does whatever carries its bytes: open, check and hand on a message.

Two channels carry asynckv's control messages: ``ControlChannel`` over ZMQ (the default, and the
only one for SGLang's wire) and ``StreamChannel`` over plain TCP streams read by the event loop.
They differ in how bytes move; they share, here, what a message goes through once its bytes are
in (origin check, authentication, decoding, one error boundary per message) and before they go
out (encoding, sealing, packing), the counters ``/metrics`` reads, and the rate limit on replies to
endpoints nobody vouched for.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from typing import Any

from ..errors import RemoteProtocolError
from ..proto.auth import PROTECTED_MODE_REASON, Authenticator, AuthError, is_loopback
from ..proto.endpoints import transport_of
from ..proto.messages import Message, VersionMismatch, decode, encode, encode_frame, pack, unpack
from .ratelimit import RateLimitedLog

__all__ = ["MAX_MESSAGE_BYTES", "READ_BATCH", "READ_BATCH_MAX", "TRANSIENT_PER_S", "TRANSIENT_SOCKETS", "ChannelBase",
           "running_in"]

log = logging.getLogger("asynckv.control")

MAX_MESSAGE_BYTES = 129 * 1024 * 1024
"""The largest message (one frame) a channel reads; a peer sending more is cut off. The largest a
peer may send is a destination with two 64 MiB page arrays (messages.py caps each part by type)."""
READ_BATCH = 2
"""A reader hands the event loop back after this many messages in a row at the least (it reads what
is queued without waiting: a flood would otherwise hold the loop for seconds). Each message can
wake a waiting task, and the loop runs all of them in its next round, so this bounds how much
work one round of reads starts. With 1,000 rooms in flight (Q3, uvloop, interleaved runs): 16 -> 4
took decode's loop lag p99 from 12.1 to 4.4 ms and prefill's from 35 to 21 ms; with settles also
taken a few per round (``Outbox``), 4 -> 2 took them from 4.5 to 2.6 ms and 9.2 to 6.7 ms
(medians of 10 runs each), rooms/s 0.96x (1,485 -> 1,425): within the noise, as two identical
configurations interleaved the same way differed by 5-24% in their medians. 1 had cost 18% (a
loop round per message). A reader reads more, up to ``READ_BATCH_MAX``, while the loop's rounds
are short (``pacing.Pacer``)."""
READ_BATCH_MAX = 4
"""Messages a reader takes in a row at the most, while the loop's rounds are short (``pacing``). That
bounds a turn; a ZMQ reader can run two turns in a round (one it scheduled, which emptied the socket,
then the callback of ZMQ's fd, already due), so over ZMQ a round reads up to twice this."""
TRANSIENT_SOCKETS = 32
"""Connections kept open for replies to endpoints nobody vouched for (the least recently used goes)."""
TRANSIENT_PER_S = 50.0
"""Such replies per second at most (a burst of as many): beyond, they are dropped and counted, so
messages naming made-up endpoints cannot open sockets (file descriptors) without bound."""


def running_in(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether ``loop`` is the loop running in this thread."""
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


class ChannelBase:
    """The transport-neutral half of a control channel (see the module docstring)."""

    def __init__(self, host: str, on_message: Callable[[Any], None],
                 on_version_mismatch: Callable[[VersionMismatch], None] | None = None,
                 send_timeout_s: float = 5.0, auth: Authenticator | None = None, loopback_only: bool = False,
                 on_refused: Callable[[Message, str], None] | None = None,
                 codec: tuple[Callable[[list[bytes]], Any], Callable[[Any], list[bytes]]] = (decode, encode),
                 one_frame: bool = True) -> None:
        self._host = host
        self._decode, self._encode = codec
        """Frames to a message and back: asynckv's own wire, or another one (SGLang's)."""
        self._encode_frame = encode_frame if codec[1] is encode and auth is None and one_frame else None
        """Message to its one packed frame in one call (the native wire with nothing to seal)."""
        self._one_frame = one_frame
        """Send each message as one frame (``messages.pack``: asynckv's wire); else as a multipart
        message, one frame per part (SGLang's). Either is read."""
        self._on_message = on_message
        self._on_version_mismatch = on_version_mismatch
        self._send_timeout_s = send_timeout_s
        self._auth = auth
        self._loopback_only = loopback_only
        """Protected mode: drop whatever does not come from loopback."""
        self._on_refused = on_refused
        """Told of a decodable message refused for its origin (with the origin address)."""
        self._reply_tokens = TRANSIENT_PER_S
        self._reply_refill = time.monotonic()
        self.endpoint = ""
        self.received = 0
        self.dropped: collections.Counter[str] = collections.Counter()
        self.send_failures = 0
        self._rl = RateLimitedLog(log)
        self._setup()

    def _setup(self) -> None:
        """The transport's own state (each channel sets it up here, after the shared part)."""

    # -- in --------------------------------------------------------------------------------

    def _handle(self, frames: list[bytes], origin: str | None = None) -> None:
        """Open, decode and hand on one message; ``origin``: its TCP peer address, when it matters."""
        if origin is not None and not is_loopback(origin):
            self.dropped["not_loopback"] += 1
            self._rl.warning("not_loopback", "control: refused message from %s: %s", origin, PROTECTED_MODE_REASON)
            self._refused(frames, origin)
            return
        if self._auth is not None:
            if self._one_frame and len(frames) == 1:  # (the trailer is a part: open needs the parts; the
                try:                                  # codec's decode takes a packed frame as it is)
                    frames = unpack(frames[0])
                except RemoteProtocolError as exc:
                    self.dropped["malformed"] += 1
                    self._rl.warning("malformed", "control: dropped malformed message: %s", exc)
                    return
            try:
                # Freshness needs a clock shared across hosts: the one wall-clock read (see proto.auth).
                frames = self._auth.open(frames, self.endpoint, time.time_ns())
            except AuthError as exc:
                self.dropped[f"auth_{exc.kind}"] += 1
                self._rl.warning("auth", "control: refused message: %s", exc)
                return
        try:
            msg = self._decode(frames)
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

    def _refused(self, frames: list[bytes], origin: str) -> None:
        if self._on_refused is None:
            return
        try:
            msg = self._decode(frames)
        except Exception:
            return
        try:
            self._on_refused(msg, origin)
        except Exception:
            log.exception("control: refusal handler failed for %s", type(msg).__name__)

    # -- out -------------------------------------------------------------------------------

    def _frames(self, endpoint: str, msg: Any) -> list[bytes]:
        """``msg`` as the frames that go out to ``endpoint``: encoded, sealed, packed."""
        if self._encode_frame is not None:
            return [self._encode_frame(msg)]
        frames = self._encode(msg)
        if self._auth is not None:
            frames = self._auth.seal(frames, endpoint, time.time_ns())
        if self._one_frame:
            frames = [pack(frames)]
        return frames

    def _speaks(self, endpoint: str, transport: str, msg: Any) -> bool:
        """Whether ``endpoint`` names this channel's transport; if not, the message is dropped, counted
        and the reason logged (both sides of a pair must use the same one)."""
        if transport_of(endpoint) == transport:
            return True
        self._failed(endpoint, type(msg).__name__, ValueError(
            f"that endpoint is not a {transport} endpoint: both sides must use the same control_transport"))
        return False

    def _reply_allowed(self, endpoint: str, what: str) -> bool:
        """Take a token for a reply to an endpoint nobody vouched for (``TRANSIENT_PER_S``), or count
        and log the drop."""
        now = time.monotonic()
        self._reply_tokens = min(TRANSIENT_PER_S, self._reply_tokens + (now - self._reply_refill) * TRANSIENT_PER_S)
        self._reply_refill = now
        if self._reply_tokens < 1:
            self.dropped["reply_limited"] += 1
            self._rl.warning("reply_limited", "control: dropped a %s reply to %s (replies to unknown "
                             "endpoints are rate limited)", what, endpoint)
            return False
        self._reply_tokens -= 1
        return True

    def _failed(self, endpoint: str, what: str, exc: BaseException) -> None:
        self.send_failures += 1
        self.dropped["send_failed"] += 1
        self._rl.warning("send", "control: could not send %s to %s: %r", what, endpoint, exc)
