"""SGLang 0.5.10's NIXL-connector wire format, sans-IO: its ZMQ frames, its notification strings
and its completion rule (the second wire; see docs/protocol.md, section 10, and docs/interop.md).

Decode → prefill ZMQ messages start with the guard frame ``b"NixlMsgGuard"``; every text frame
is the ASCII ``str()`` of its value:

- registration, 13 frames: guard, ``b"None"``, decode ip, decode port, agent name, NIXL agent
  metadata, KV pointers (packed native u64), aux pointers, state pointers, gpu id, decode
  attention TP size, decode engine rank, ``kv_item_lens[0]``;
- transfer info, 9 frames: guard, room (decimal), decode ip, decode port, agent name,
  destination pages (int32 LE; empty: a dummy rank), aux index, ``required_dst_info_num``,
  state indices (int32 LE, may be empty).

Prefill → decode completion travels as NIXL notifications on the WRITEs themselves:
``{room}_kv_{chunk}_{is_last}_{pp}``, ``{room}_aux``, ``{room}_state_{pp}``. Decode counts the
chunks of each pp rank, in any order, and is done when the aux row and every expected chunk
(and state, when expected) arrived.

Where SGLang asserts or mis-parses (a foreign frame kills its reader thread; an extra or
repeated chunk id leaves a room never done), this codec raises ``RemoteProtocolError`` naming
the field, and ``SglangCompletion`` fails the room instead of waiting for its timeout.
"""

from __future__ import annotations

import dataclasses
import struct

import numpy as np
import numpy.typing as npt

from ..errors import RemoteProtocolError
from .messages import MAX_ROOM, Register
from .wire_limits import MAX_FRAME_BYTES

__all__ = [
    "GUARD",
    "SglangCompletion",
    "SglangNotification",
    "SglangMessage",
    "SglangRegister",
    "SglangTransferInfo",
    "aux_notification",
    "decode_frames",
    "encode_message",
    "kv_notification",
    "parse_notification",
    "state_notification",
]

GUARD = b"NixlMsgGuard"
_MAX_TEXT = 256
"""Longest text frame accepted (an ip, a port, an agent name, a number)."""
_MAX_PTRS = 1 << 16
"""Most pointers in one list (SGLang registers one buffer per layer and K/V: thousands at most)."""


def _text(frames: list[bytes], i: int, field: str) -> str:
    raw = bytes(frames[i])
    if len(raw) > _MAX_TEXT:
        raise RemoteProtocolError(f"sglang {field}: {len(raw)} bytes, at most {_MAX_TEXT}")
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        raise RemoteProtocolError(f"sglang {field}: not ASCII: {raw[:40]!r}") from None
    if not text.isprintable():
        raise RemoteProtocolError(f"sglang {field}: not printable: {text[:40]!r}")
    return text


def _int(frames: list[bytes], i: int, field: str, low: int, high: int) -> int:
    text = _text(frames, i, field)
    try:
        value = int(text)
    except ValueError:
        raise RemoteProtocolError(f"sglang {field}: not a decimal integer: {text[:40]!r}") from None
    if not low <= value <= high:
        raise RemoteProtocolError(f"sglang {field}: {value} not in [{low}, {high}]")
    return value


def _metadata(frame: bytes) -> bytes:
    cap = MAX_FRAME_BYTES[Register.TYPE]  # (a registration waiting to connect keeps it)
    if len(frame) > cap:
        raise RemoteProtocolError(f"sglang agent metadata: {len(frame)} bytes, at most {cap}")
    return bytes(frame)


def _ptrs(frames: list[bytes], i: int, field: str) -> tuple[int, ...]:
    raw = bytes(frames[i])
    if len(raw) % 8 or len(raw) // 8 > _MAX_PTRS:
        raise RemoteProtocolError(f"sglang {field}: {len(raw)} bytes is not a list of at most {_MAX_PTRS} u64")
    return struct.unpack(f"<{len(raw) // 8}Q", raw)


def _i32(frames: list[bytes], i: int, field: str) -> npt.NDArray[np.int32]:
    raw = bytes(frames[i])
    if len(raw) % 4:
        raise RemoteProtocolError(f"sglang {field}: {len(raw)} bytes is not a whole number of int32")
    return np.frombuffer(raw, dtype="<i4").astype(np.int32, copy=False)


@dataclasses.dataclass(frozen=True, slots=True)
class SglangRegister:
    """A decode rank's registration (sent once per prefill rank it uses)."""

    ip: str
    port: int
    agent_name: str
    agent_metadata: bytes
    kv_ptrs: tuple[int, ...]
    """In SGLang's order: K of every layer, then V of every layer (MLA: one per layer)."""
    aux_ptrs: tuple[int, ...]
    state_ptrs: tuple[int, ...]
    gpu_id: int
    tp_size: int
    """Decode attention TP size."""
    engine_rank: int
    kv_item_len: int
    """Bytes of one page of one KV buffer on decode (``kv_item_lens[0]``)."""

    @property
    def endpoint(self) -> str:
        return f"tcp://{self.ip}:{self.port}"

    def encode(self) -> list[bytes]:
        def ptrs(values: tuple[int, ...]) -> bytes:
            return struct.pack(f"<{len(values)}Q", *values)

        return [GUARD, b"None", self.ip.encode(), str(self.port).encode(), self.agent_name.encode(),
                bytes(self.agent_metadata), ptrs(self.kv_ptrs), ptrs(self.aux_ptrs), ptrs(self.state_ptrs),
                str(self.gpu_id).encode(), str(self.tp_size).encode(), str(self.engine_rank).encode(),
                str(self.kv_item_len).encode()]


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class SglangTransferInfo:
    """One decode rank's destination for one room."""

    room: int
    ip: str
    port: int
    agent_name: str
    dst_pages: npt.NDArray[np.int32]
    """Empty: this prefill rank is a dummy for the room (it sends nothing)."""
    aux_index: int
    required_dst_info_num: int
    state_indices: npt.NDArray[np.int32]

    @property
    def is_dummy(self) -> bool:
        return self.dst_pages.size == 0

    def encode(self) -> list[bytes]:
        return [GUARD, str(self.room).encode(), self.ip.encode(), str(self.port).encode(), self.agent_name.encode(),
                np.ascontiguousarray(self.dst_pages, dtype="<i4").tobytes(), str(self.aux_index).encode(),
                str(self.required_dst_info_num).encode(),
                np.ascontiguousarray(self.state_indices, dtype="<i4").tobytes()]


SglangMessage = SglangRegister | SglangTransferInfo
"""What a decode rank sends a prefill rank on SGLang's wire."""


def encode_message(msg: SglangMessage) -> list[bytes]:
    return msg.encode()


def decode_frames(frames: list[bytes]) -> SglangMessage:
    """Decode one decode → prefill message; raises ``RemoteProtocolError`` naming the bad field."""
    if not frames or bytes(frames[0]) != GUARD:
        raise RemoteProtocolError("sglang: first frame is not the NixlMsgGuard (foreign traffic?)")
    if len(frames) == 13 and bytes(frames[1]) == b"None":
        return SglangRegister(
            ip=_text(frames, 2, "decode ip"), port=_int(frames, 3, "decode port", 1, 65535),
            agent_name=_text(frames, 4, "agent name"), agent_metadata=_metadata(frames[5]),
            kv_ptrs=_ptrs(frames, 6, "kv pointers"), aux_ptrs=_ptrs(frames, 7, "aux pointers"),
            state_ptrs=_ptrs(frames, 8, "state pointers"), gpu_id=_int(frames, 9, "gpu_id", 0, 1 << 16),
            tp_size=_int(frames, 10, "decode tp size", 1, 1 << 16),
            engine_rank=_int(frames, 11, "decode engine rank", 0, 1 << 16),
            kv_item_len=_int(frames, 12, "kv item len", 1, 1 << 40))
    if len(frames) == 9:
        return SglangTransferInfo(
            room=_int(frames, 1, "room", 0, MAX_ROOM), ip=_text(frames, 2, "decode ip"),
            port=_int(frames, 3, "decode port", 1, 65535), agent_name=_text(frames, 4, "agent name"),
            dst_pages=_i32(frames, 5, "destination pages"),
            aux_index=_int(frames, 6, "aux index", -1, (1 << 31) - 1),
            required_dst_info_num=_int(frames, 7, "required_dst_info_num", 1, 1 << 16),
            state_indices=_i32(frames, 8, "state indices"))
    raise RemoteProtocolError(f"sglang: {len(frames)} frames is neither a registration (13 frames, room 'None') "
                              f"nor a transfer info (9 frames): another SGLang version? (0.5.10 is spoken)")


# -- notifications ---------------------------------------------------------------------------


def kv_notification(room: int, chunk: int, is_last: bool, pp_rank: int) -> bytes:
    return f"{room}_kv_{chunk}_{int(is_last)}_{pp_rank}".encode("ascii")


def aux_notification(room: int) -> bytes:
    return f"{room}_aux".encode("ascii")


def state_notification(room: int, pp_rank: int) -> bytes:
    return f"{room}_state_{pp_rank}".encode("ascii")


@dataclasses.dataclass(frozen=True, slots=True)
class SglangNotification:
    room: int
    kind: str
    """"kv", "aux" or "state"."""
    chunk: int = 0
    is_last: bool = False
    pp_rank: int = 0


def parse_notification(raw: bytes) -> SglangNotification:
    """Parse one notification string; raises ``RemoteProtocolError`` for anything else."""
    try:
        text = bytes(raw).decode("ascii")
    except UnicodeDecodeError:
        raise RemoteProtocolError(f"sglang notification not ASCII: {bytes(raw)[:40]!r}") from None
    parts = text.split("_")
    try:
        room = int(parts[0])
        if not 0 <= room <= MAX_ROOM:
            raise ValueError(room)
        if parts[1:2] == ["aux"] and len(parts) == 2:
            return SglangNotification(room, "aux")
        if parts[1:2] == ["state"] and len(parts) == 3:
            return SglangNotification(room, "state", pp_rank=_small(parts[2]))
        if parts[1:2] == ["kv"] and len(parts) in (4, 5) and parts[3] in ("0", "1"):
            pp = _small(parts[4]) if len(parts) == 5 else 0  # 0.5.5 sent no pp rank
            return SglangNotification(room, "kv", chunk=_small(parts[2]), is_last=parts[3] == "1", pp_rank=pp)
    except (ValueError, IndexError):
        pass
    raise RemoteProtocolError(f"sglang notification not understood: {text[:80]!r}")


def _small(text: str) -> int:
    value = int(text)
    if not 0 <= value < 1 << 31 or not text.isdigit():
        raise ValueError(text)
    return value


class SglangCompletion:
    """Decode's completion rule for one room of a stock SGLang prefill, from its notifications.

    Done when the aux row arrived and every pp rank it expects (``pp_ranks``) sent its last chunk
    and all chunks before it, and its state when state is expected. Unlike SGLang, a chunk id at
    or past a rank's last, or a second last chunk, fails the room (SGLang's set count would then
    never match and the room would wait for its timeout); duplicates are ignored."""

    def __init__(self, pp_ranks: int = 1, expects_state: bool = False) -> None:
        self.pp_ranks = pp_ranks
        self.expects_state = expects_state
        self.chunks: dict[int, set[int]] = {}
        self.expected: dict[int, int] = {}
        self.aux = False
        self.state: set[int] = set()
        self.error: str | None = None

    def add(self, note: SglangNotification) -> None:
        if note.kind == "aux":
            self.aux = True
        elif note.kind == "state":
            self.state.add(note.pp_rank)
        else:
            last = self.expected.get(note.pp_rank)
            if note.is_last:
                if last is not None and last != note.chunk + 1:
                    self._fail(f"pp rank {note.pp_rank}: two last chunks ({last - 1} and {note.chunk})")
                last = self.expected[note.pp_rank] = note.chunk + 1
            seen = self.chunks.setdefault(note.pp_rank, set())
            seen.add(note.chunk)
            if last is not None and max(seen) >= last:
                self._fail(f"pp rank {note.pp_rank}: chunk {max(seen)} after its last chunk {last - 1}")
        if note.pp_rank >= self.pp_ranks:
            self._fail(f"pp rank {note.pp_rank} notified, {self.pp_ranks} expected")

    def _fail(self, why: str) -> None:
        if self.error is None:  # the first reason is the one reported
            self.error = why

    @property
    def done(self) -> bool:
        if self.error is not None or not self.aux or len(self.expected) < self.pp_ranks:
            return False
        if self.expects_state and len(self.state) < self.pp_ranks:
            return False
        return all(len(self.chunks.get(pp, ())) == n for pp, n in self.expected.items())
