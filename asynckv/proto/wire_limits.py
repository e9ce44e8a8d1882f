"""Size caps of control messages, checked before anything of a message is parsed.

A peer cannot make a reader parse, or a table keep, more than a message of its kind needs:
each type caps its JSON body and each binary frame (a registration's agent metadata, a
destination's page arrays), identifiers have a length cap, and reasons (for people) are cut
when encoded, so every message that carries one stays far under its cap.
"""

from __future__ import annotations

from ..errors import RemoteProtocolError

__all__ = ["MAX_BODY_BYTES", "MAX_FRAME_BYTES", "MAX_REASON_CHARS", "MAX_STR_CHARS", "check_sizes"]

KIB, MIB = 2**10, 2**20
MAX_REASON_CHARS = 4096
"""Reasons longer than this are cut when encoded (4,096 characters are 16 KiB at most)."""
MAX_STR_CHARS = {"decode_id": 128, "prefill_id": 128, "sender_id": 128, "endpoint": 256, "kv_dtype": 32,
                 "mem_kind": 16, "state_type": 16}
"""Length caps of identifier fields (agent names are uuids; the bootstrap server caps them alike)."""

# By message type (messages.py: Register 1, RegisterResult 2, TransferInfo 3, Status 4, Abort 5,
# Ping 6, Pong 7, Bye 8; a test checks that every type has its caps).
MAX_BODY_BYTES: dict[int, int] = {
    1: 1 * MIB,  # Register: a few numbers per KV, aux and state entry (tens of thousands of entries)
    2: 64 * KIB, 4: 64 * KIB, 5: 64 * KIB, 8: 64 * KIB,  # identifiers and a reason
    3: 4 * KIB,  # TransferInfo: identifiers and scalars; its pages travel as binary frames
    6: 1 * KIB, 7: 1 * KIB,  # Ping, Pong
}
MAX_FRAME_BYTES: dict[int, int] = {
    1: 1 * MIB,  # NIXL agent metadata: 452 B plus 44 B per registered region (45 KB for 1,024 regions,
    # measured); a registration waiting to connect keeps it, so the cap is what a flood of them costs
    3: 64 * MIB,  # each page array: 16M int32 entries, more than any context at page_size 1 (also
    # the transport's cap); prefill then refuses one longer than the pages its decode registered
}
_ANY_BODY = max(MAX_BODY_BYTES.values())


def check_sizes(msg_type: int, frames: list[bytes]) -> None:
    """Refuse a message larger than its type allows. A type this version does not know may still be
    a registration in another version: it gets the largest body cap, and is refused as unknown later."""
    known = msg_type in MAX_BODY_BYTES
    cap = MAX_BODY_BYTES.get(msg_type, _ANY_BODY)
    if len(frames[1]) > cap:
        raise RemoteProtocolError(f"message type {msg_type}: body of {len(frames[1])} bytes exceeds its cap of {cap}")
    frame_cap = MAX_FRAME_BYTES.get(msg_type, 0)
    for frame in frames[2:] if known else ():
        if len(frame) > frame_cap:
            raise RemoteProtocolError(f"message type {msg_type}: binary frame of {len(frame)} bytes exceeds its "
                                      f"cap of {frame_cap}")
