"""Shared-secret authentication of control messages and bootstrap requests, sans-IO.

With a token configured, every ZMQ message carries one more frame::

    b"AKV2" | u64 LE sender wall-clock time (ns) | 16-byte nonce | HMAC-SHA256 (32 bytes)

The MAC covers the recipient (the endpoint the message is sent to, as the receiver
advertises it), every other frame (the header names the message type, the body its
sender), the time and the nonce, each length-prefixed, under a key derived from the
token: a message sealed for one rank is refused by every other. A receiver refuses a
message without the frame, with a bad MAC, with a time outside ``window_s`` of its own
clock, or whose nonce it has already seen within the window (a replay). Freshness needs
a clock both hosts share, so it is the only place asynckv reads wall-clock time; deadlines
stay monotonic. Mutating bootstrap requests carry the same proof in an ``X-AsyncKV-Auth``
header over method, path and body.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import hmac
import ipaddress
import os
import struct

from ..errors import RemoteProtocolError

__all__ = ["AUTH_HEADER", "PROTECTED_MODE_REASON", "AuthError", "Authenticator", "is_loopback"]

PROTECTED_MODE_REASON = (
    "asynckv protected mode: no ASYNCKV_AUTH_TOKEN is set, so control traffic is accepted from "
    "loopback only. To run across hosts set the same ASYNCKV_AUTH_TOKEN on every rank and the "
    "bootstrap server (`asynckv gen-token` prints one), or set ASYNCKV_ALLOW_UNAUTHENTICATED=1 "
    "to accept unauthenticated traffic from any host.")


@functools.lru_cache(maxsize=1024)
def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and IPv4-mapped loopback; False for anything else (names too).
    Cached: in protected mode every control message's origin is checked (parsing it was ~3% of a
    busy prefill loop), and origins are few."""
    try:
        addr = ipaddress.ip_address(host.strip("[]").split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback

AUTH_MAGIC = b"AKV2"
AUTH_HEADER = "X-AsyncKV-Auth"
_TRAILER = struct.Struct("<4sQ16s32s")


class AuthError(RemoteProtocolError):
    """A message or request failed authentication; ``kind`` says how (for counters)."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"unauthenticated ({kind}): {detail}")
        self.kind = kind


class Authenticator:
    """Seals and opens messages with one shared secret."""

    def __init__(self, token: str, window_s: float = 30.0, max_nonces: int = 200_000) -> None:
        if not token:
            raise ValueError("auth token must not be empty")
        self._key = hashlib.sha256(b"asynckv-v1:" + token.encode()).digest()
        self._window_ns = int(window_s * 1e9)
        self._max_nonces = max_nonces
        self._seen: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self._floor_ns = 0
        """Messages sent at or before this time are refused: the nonces of that time were forgotten
        (the table was full within the window), so a replay of one could not be told any more."""

    def _mac(self, parts: list[bytes], ts: int, nonce: bytes) -> bytes:
        h = hmac.new(self._key, digestmod=hashlib.sha256)
        for part in parts:
            h.update(struct.pack("<I", len(part)))
            h.update(part)
        h.update(struct.pack("<Q", ts))
        h.update(nonce)
        return h.digest()

    def seal(self, frames: list[bytes], recipient: str, now_ns: int, nonce: bytes | None = None) -> list[bytes]:
        """Append the trailer for a message to ``recipient`` (the endpoint it is sent to)."""
        nonce = os.urandom(16) if nonce is None else nonce
        mac = self._mac([recipient.encode(), *(bytes(f) for f in frames)], now_ns, nonce)
        return [*frames, _TRAILER.pack(AUTH_MAGIC, now_ns, nonce, mac)]

    def open(self, frames: list[bytes], recipient: str, now_ns: int) -> list[bytes]:
        """Verify and strip the trailer of a message to ``recipient`` (our own endpoint); raises AuthError."""
        if not frames or len(frames[-1]) != _TRAILER.size or bytes(frames[-1][:4]) != AUTH_MAGIC:
            raise AuthError("missing", "no authentication frame")
        _, ts, nonce, mac = _TRAILER.unpack(bytes(frames[-1]))
        body = [bytes(f) for f in frames[:-1]]
        self._verify([recipient.encode(), *body], ts, nonce, mac, now_ns)
        return body

    def _verify(self, parts: list[bytes], ts: int, nonce: bytes, mac: bytes, now_ns: int) -> None:
        if not hmac.compare_digest(mac, self._mac(parts, ts, nonce)):
            raise AuthError("bad_mac", "MAC does not match (wrong token, altered, or sealed for another rank)")
        if abs(now_ns - ts) > self._window_ns:
            raise AuthError("stale", f"timestamp {abs(now_ns - ts) / 1e9:.1f}s away from ours")
        while self._seen and (len(self._seen) >= self._max_nonces
                              or next(iter(self._seen.values())) < now_ns - self._window_ns):
            _, forgotten = self._seen.popitem(last=False)
            if forgotten >= now_ns - self._window_ns:  # forgotten early, while still fresh
                self._floor_ns = max(self._floor_ns, forgotten)
        if nonce in self._seen:
            raise AuthError("replayed", "nonce already seen")
        if ts <= self._floor_ns:
            raise AuthError("replayed", "older than the nonces still remembered (more than "
                                        f"{self._max_nonces} messages within the window)")
        self._seen[nonce] = ts

    def http_header(self, method: str, path: str, body: bytes, now_ns: int, nonce: bytes | None = None) -> str:
        nonce = os.urandom(16) if nonce is None else nonce
        mac = self._mac([method.encode(), path.encode(), body], now_ns, nonce)
        return f"{now_ns}.{nonce.hex()}.{mac.hex()}"

    def check_http(self, method: str, path: str, body: bytes, header: str | None, now_ns: int) -> None:
        if not header:
            raise AuthError("missing", f"no {AUTH_HEADER} header")
        try:
            ts_text, nonce_hex, mac_hex = header.split(".")
            ts, nonce, mac = int(ts_text), bytes.fromhex(nonce_hex), bytes.fromhex(mac_hex)
        except ValueError:
            raise AuthError("malformed", f"{AUTH_HEADER} is not ts.nonce.mac") from None
        if not 0 <= ts < 2**64 or len(nonce) != 16 or len(mac) != 32:  # (the MAC packs ts as u64)
            raise AuthError("malformed", f"{AUTH_HEADER}: time, nonce or MAC out of range")
        self._verify([method.encode(), path.encode(), body], ts, nonce, mac, now_ns)
