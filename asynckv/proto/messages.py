"""Native control protocol v5: message dataclasses and their codec.

Every message is a list of parts::

    part 0   header, 8 bytes: magic b"AKVP", u16 LE protocol version, u16 LE message type
    part 1   body: UTF-8 JSON object of the scalar fields (sorted keys, no spaces)
    part 2+  binary fields, in the order the message's schema lists them

and travels as one ZMQ frame (``pack``: each part, then the authentication trailer if any, as a
u32 LE length and its bytes); versions 1-3 sent the parts as a multipart message (5 added ``state_tp_size``).

Arrays travel as little-endian int32 (``<i4``); opaque bytes (NIXL agent metadata)
as they are. Decoding validates every field's presence and type and raises
``RemoteProtocolError``; nothing else escapes from ``decode``. See docs/protocol.md.

Every message type has a size cap, checked before anything of it is parsed, identifiers have a
length cap, and reasons are cut when encoded (``wire_limits``). Every type but ``Register`` also
has generated fast paths (``fastcodec``): the same bytes, messages and errors, at a third of the cost.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from ..errors import RemoteProtocolError
from .fastcodec import FastCodec
from .wire_limits import MAX_REASON_CHARS, MAX_STR_CHARS, check_sizes

__all__ = ["MAGIC", "MAX_ROOM", "PROTOCOL_VERSION", "Abort", "Bye", "Message", "Ping", "Pong", "Register",
           "RegisterResult", "Status", "TransferInfo", "VersionMismatch", "decode", "encode", "encode_frame",
           "pack", "unpack"]

MAGIC = b"AKVP"
PROTOCOL_VERSION = 5
MAX_ROOM = 2**63 - 1
MAX_FRAMES = 8
_HEADER = struct.Struct("<4sHH")
_LENGTH = struct.Struct("<I")

# Field kinds: "int", "uint" (>= 0), "room", "str", "bool", "ints" (list of uint),
# and the binary kinds "bytes" and "i32" (parts 2+).
_BINARY = ("bytes", "i32")


class VersionMismatch(RemoteProtocolError):
    """The peer speaks another protocol version; ``theirs`` and ``ours`` name both."""

    def __init__(self, theirs: int, msg_type: int, body: dict[str, Any] | None) -> None:
        super().__init__(f"protocol version mismatch: peer speaks v{theirs}, we speak v{PROTOCOL_VERSION}")
        self.theirs = theirs
        self.ours = PROTOCOL_VERSION
        self.msg_type = msg_type
        self.body = body


@dataclasses.dataclass(frozen=True, slots=True)
class Message:
    """Base of every control message; subclasses set TYPE and SCHEMA."""

    TYPE: ClassVar[int] = 0
    SCHEMA: ClassVar[tuple[tuple[str, str], ...]] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class Register(Message):
    """Decode rank → prefill rank, once per (decode agent, prefill rank): who we are, where to write."""

    TYPE: ClassVar[int] = 1
    SCHEMA: ClassVar[tuple[tuple[str, str], ...]] = (
        ("decode_id", "str"), ("prefill_id", "str"), ("session", "uint"), ("lease_ms", "uint"), ("endpoint", "str"),
        ("engine_rank", "uint"), ("tp_size", "uint"), ("page_size", "uint"), ("kv_dtype", "str"), ("mem_kind", "str"),
        ("is_mla", "bool"), ("gpu_id", "uint"), ("kv_ptrs", "ints"), ("kv_lens", "ints"), ("kv_item_lens", "ints"),
        ("kv_layer_ids", "ints"), ("aux_ptrs", "ints"), ("aux_lens", "ints"), ("aux_item_lens", "ints"),
        ("scratch_ptr", "uint"), ("scratch_len", "uint"), ("kv_head_num", "uint"), ("total_kv_head_num", "uint"),
        ("state_type", "str"), ("state_ptrs", "ints"), ("state_lens", "ints"), ("state_item_lens", "ints"),
        ("state_layer_ids", "ints"), ("state_dims", "ints"), ("state_outer", "ints"), ("agent_metadata", "bytes"),
        ("state_tp_size", "uint"), ("state_engine_rank", "uint"), ("state_head_num", "uint"),
    )
    decode_id: str
    """Decode NIXL agent name (unique per process lifetime)."""
    prefill_id: str
    """The prefill incarnation decode expects; a restarted prefill refuses, naming both."""
    session: int
    """Which registration of this (decode, prefill) pair this is; a new one voids the old one's rooms."""
    lease_ms: int
    """How long after each grant (the RegisterResult, then every Pong) prefill may write into decode."""
    endpoint: str
    """Decode control endpoint, ``tcp://host:port`` or ``stream://host:port``, for replies and status."""
    engine_rank: int
    tp_size: int
    page_size: int
    kv_dtype: str
    mem_kind: str
    is_mla: bool
    gpu_id: int
    kv_ptrs: tuple[int, ...]
    kv_lens: tuple[int, ...]
    kv_item_lens: tuple[int, ...]
    kv_layer_ids: tuple[int, ...]
    aux_ptrs: tuple[int, ...]
    aux_lens: tuple[int, ...]
    aux_item_lens: tuple[int, ...]
    scratch_ptr: int
    """A small DRAM region prefill may write for the first-contact warm-up."""
    scratch_len: int
    kv_head_num: int
    """KV heads on this decode rank."""
    total_kv_head_num: int
    state_type: str
    """"none", "mamba", "swa" or "nsa"."""
    state_ptrs: tuple[int, ...]
    state_lens: tuple[int, ...]
    state_item_lens: tuple[int, ...]
    state_layer_ids: tuple[int, ...]
    """Empty: state entries pair positionally."""
    state_dims: tuple[int, ...]
    """mamba: sliced-dimension size per entry on this rank; empty if not given."""
    state_outer: tuple[int, ...]
    agent_metadata: bytes
    """``nixl_agent.get_agent_metadata()`` of the decode agent (opaque)."""
    state_tp_size: int = 0
    """With the next two, the rank the state belongs to, where the KV pool is staging slots (0: this one)."""
    state_engine_rank: int = 0  # (registration.state_rank reads the three)
    state_head_num: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class RegisterResult(Message):
    """Prefill rank → decode: registration accepted, or refused with a reason."""

    TYPE: ClassVar[int] = 2
    SCHEMA: ClassVar[tuple[tuple[str, str], ...]] = (
        ("prefill_id", "str"), ("decode_id", "str"), ("session", "uint"), ("ok", "bool"), ("reason", "str"))
    prefill_id: str
    decode_id: str
    session: int
    ok: bool
    reason: str


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class TransferInfo(Message):
    """Decode → prefill, per room: the destination pages and aux row."""

    TYPE: ClassVar[int] = 3
    SCHEMA: ClassVar[tuple[tuple[str, str], ...]] = (
        ("room", "room"), ("epoch", "uint"), ("decode_id", "str"), ("prefill_id", "str"), ("aux_index", "int"),
        ("required_dst_info_num", "uint"), ("is_dummy", "bool"), ("write_aux", "bool"),
        ("decode_prefix_len", "uint"), ("dst_pages", "i32"), ("dst_state_indices", "i32"))
    room: int
    epoch: int
    """The receiver's incarnation of this room (new for every ``KVReceiver``): a room id reused after
    ``clear()`` can never be completed or aborted by the old room's messages."""
    decode_id: str
    prefill_id: str
    """The prefill incarnation (agent name) decode means; a restarted prefill refuses the room."""
    aux_index: int
    """Destination aux row, or -1 for none."""
    required_dst_info_num: int
    """How many decode ranks this prefill rank must hear from before the room is ready."""
    is_dummy: bool
    """This prefill rank takes part in the room but writes and reports nothing."""
    write_aux: bool
    """This prefill rank is the one that writes the aux row (and replicated state)."""
    decode_prefix_len: int
    """Tokens decode already holds (a multiple of page_size); dst_pages start after them."""
    dst_pages: npt.NDArray[np.int32]
    dst_state_indices: npt.NDArray[np.int32]
    """mamba: the request's state slot; swa/nsa: state page indices; empty: no state."""

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TransferInfo):
            return NotImplemented
        return all(np.array_equal(getattr(self, f), getattr(other, f)) if kind == "i32" else
                   getattr(self, f) == getattr(other, f) for f, kind in self.SCHEMA)


@dataclasses.dataclass(frozen=True, slots=True)
class Status(Message):
    """Prefill → decode: the room's terminal result from one prefill rank."""

    TYPE: ClassVar[int] = 4
    SCHEMA: ClassVar[tuple[tuple[str, str], ...]] = (
        ("room", "room"), ("epoch", "uint"), ("prefill_id", "str"), ("session", "uint"), ("sender_rank", "uint"),
        ("ok", "bool"), ("reason", "str"))
    room: int
    epoch: int
    """The receiver incarnation this status answers (from its TransferInfo or Abort)."""
    prefill_id: str
    """Agent name (incarnation) of the prefill sender."""
    session: int
    """The registration session the room's destination came in (decode draws sessions at random, and
    only the prefill that received the Register knows one: a status naming another is dropped)."""
    sender_rank: int
    """Unique rank of the prefill sender (distinct senders are counted, never keys)."""
    ok: bool
    """True: every write landed. False: the room failed and this rank writes nothing more into it."""
    reason: str


@dataclasses.dataclass(frozen=True, slots=True)
class Abort(Message):
    """Decode → prefill: decode gave up on the room; prefill answers with ``Status(ok=False)``
    once none of its writes into the room can still land."""

    TYPE: ClassVar[int] = 5
    SCHEMA: ClassVar[tuple[tuple[str, str], ...]] = (
        ("room", "room"), ("epoch", "uint"), ("decode_id", "str"), ("destination_sent", "bool"),
        ("required", "uint"), ("reason", "str"))
    room: int
    epoch: int
    decode_id: str
    destination_sent: bool
    """Decode sent this rank the room's TransferInfo before this Abort (on the same ordered channel)."""
    required: int
    """How many decode ranks send this prefill rank the room's destination (as in TransferInfo)."""
    reason: str


@dataclasses.dataclass(frozen=True, slots=True)
class Ping(Message):
    """Heartbeat request; the receiver answers Pong to ``endpoint``."""

    TYPE: ClassVar[int] = 6
    SCHEMA: ClassVar[tuple[tuple[str, str], ...]] = (
        ("sender_id", "str"), ("endpoint", "str"), ("session", "uint"), ("seq", "uint"))
    sender_id: str
    endpoint: str
    session: int
    """The registration session the sender holds with the receiver; an unknown one is answered with Bye."""
    seq: int


@dataclasses.dataclass(frozen=True, slots=True)
class Pong(Message):
    """Heartbeat answer, naming the answering incarnation (a restart shows up here)."""

    TYPE: ClassVar[int] = 7
    SCHEMA: ClassVar[tuple[tuple[str, str], ...]] = (("sender_id", "str"), ("session", "uint"), ("seq", "uint"))
    sender_id: str
    session: int
    seq: int


@dataclasses.dataclass(frozen=True, slots=True)
class Bye(Message):
    """The sender ends its registration session with the receiver (closing, declared dead, or an
    unknown session). From prefill it also promises that none of its writes can still land."""

    TYPE: ClassVar[int] = 8
    SCHEMA: ClassVar[tuple[tuple[str, str], ...]] = (("sender_id", "str"), ("session", "uint"), ("reason", "str"))
    sender_id: str
    session: int
    reason: str


MESSAGE_TYPES: dict[int, type[Message]] = {
    cls.TYPE: cls for cls in (Register, RegisterResult, TransferInfo, Status, Abort, Ping, Pong, Bye)
}
_FIELDS = {cls: (tuple((n, k) for n, k in cls.SCHEMA if k not in _BINARY),
                 tuple((n, k) for n, k in cls.SCHEMA if k in _BINARY)) for cls in MESSAGE_TYPES.values()}
"""Per message type: its scalar (body) fields and its binary fields, in frame order."""
_JSON_OUT = json.JSONEncoder(sort_keys=True, separators=(",", ":"))  # (json.dumps builds one per call)
_JSON_IN = json.JSONDecoder()


def encode(msg: Message) -> list[bytes]:
    """Encode a message into its parts: header, JSON body, binary fields (``pack`` makes them one frame)."""
    parts = _FAST.encode_parts(msg)
    return parts if parts is not None else _encode_generic(msg)


def _encode_generic(msg: Message) -> list[bytes]:
    """``encode`` field by field, for every type and value (the fast paths defer to it)."""
    body: dict[str, Any] = {}
    blobs: list[bytes] = []
    for name, kind in msg.SCHEMA:
        value = getattr(msg, name)
        if kind == "bytes":
            blobs.append(bytes(value))
        elif kind == "i32":
            blobs.append(np.ascontiguousarray(value, dtype="<i4").tobytes())
        elif kind == "ints":
            body[name] = [int(v) for v in value]
        elif name == "reason" and len(value) > MAX_REASON_CHARS:
            body[name] = value[:MAX_REASON_CHARS - 3] + "..."
        else:
            body[name] = value
    head = _HEADER.pack(MAGIC, PROTOCOL_VERSION, msg.TYPE)
    return [head, _JSON_OUT.encode(body).encode(), *blobs]


def encode_frame(msg: Message) -> bytes:
    """``pack(encode(msg))``, through the type's generated fast path where it has one (``fastcodec``)."""
    frame = _FAST.encode_frame(msg)
    return frame if frame is not None else pack(encode(msg))


def pack(parts: list[bytes]) -> bytes:
    """The one ZMQ frame a message travels in (version 4 on): each part (``encode``'s frames, then
    an authentication trailer, if any) as a little-endian u32 length followed by its bytes. One
    frame is one send and one receive in pyzmq and ZMQ instead of one per part."""
    return b"".join([piece for part in parts for piece in (_LENGTH.pack(len(part)), part)])


def unpack(frame: bytes) -> list[bytes]:
    """The parts of a frame built by ``pack``; raises ``RemoteProtocolError`` on anything off (at
    most ``MAX_FRAMES`` + 1 parts: a message and its authentication trailer)."""
    parts: list[bytes] = []
    pos, end = 0, len(frame)
    while pos < end:
        if len(parts) > MAX_FRAMES:
            raise RemoteProtocolError(f"more than {MAX_FRAMES + 1} parts in one frame")
        if end - pos < _LENGTH.size:
            raise RemoteProtocolError(f"frame of {end} bytes is not a packed message (part {len(parts)} at {pos})")
        (length,) = _LENGTH.unpack_from(frame, pos)
        pos += _LENGTH.size
        if length > end - pos:
            raise RemoteProtocolError(f"part {len(parts)} of {length} bytes runs past the frame ({end} bytes)")
        parts.append(frame[pos:pos + length])
        pos += length
    return parts


def decode(frames: list[bytes]) -> Message:
    """Decode a message from its parts, or from the one frame ``pack`` made of them; raises
    ``RemoteProtocolError`` on anything off."""
    if len(frames) == 1:
        frames = unpack(bytes(frames[0]))
    fast: Message | None = _FAST.decode(frames)
    return fast if fast is not None else _decode_generic(frames)


def _decode_generic(frames: list[bytes]) -> Message:
    """``decode`` of a message's parts, field by field, for every type (the fast paths defer to it)."""
    if not 2 <= len(frames) <= MAX_FRAMES:
        raise RemoteProtocolError(f"expected 2..{MAX_FRAMES} frames, got {len(frames)}")
    head = bytes(frames[0])
    if len(head) != _HEADER.size:
        raise RemoteProtocolError(f"header must be {_HEADER.size} bytes, got {len(head)}")
    magic, version, msg_type = _HEADER.unpack(head)
    if magic != MAGIC:
        raise RemoteProtocolError(f"bad magic {magic!r} (foreign traffic?)")
    check_sizes(msg_type, frames)
    body = _load_body(frames[1])
    if version != PROTOCOL_VERSION:
        raise VersionMismatch(version, msg_type, body)
    cls = MESSAGE_TYPES.get(msg_type)
    if cls is None:
        raise RemoteProtocolError(f"unknown message type {msg_type}")
    blobs = frames[2:]
    scalars, binaries = _FIELDS[cls]
    if len(blobs) != len(binaries):
        raise RemoteProtocolError(f"{cls.__name__}: expected {len(binaries)} binary frames, got {len(blobs)}")
    values: dict[str, Any] = {}
    for name, kind in scalars:
        if name not in body:
            raise RemoteProtocolError(f"{cls.__name__}: missing field {name!r}")
        values[name] = _scalar(cls.__name__, name, kind, body[name])
    for (name, kind), blob in zip(binaries, blobs, strict=True):
        values[name] = _binary(cls.__name__, name, kind, bytes(blob))
    return cls(**values)


def _load_body(frame: bytes) -> dict[str, Any]:
    try:
        body = _JSON_IN.decode(bytes(frame).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # (nesting within the size cap)
        raise RemoteProtocolError(f"body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise RemoteProtocolError("body must be a JSON object")
    return body


def _scalar(cls_name: str, name: str, kind: str, value: Any) -> Any:
    if type(value) is int and kind in _INT_RANGES:  # (most fields: checked without the slow path)
        low, high = _INT_RANGES[kind]
        if low <= value <= high:
            return value
    return _checked_scalar(cls_name, name, kind, value)


_INT_RANGES = {"uint": (0, 2**64 - 1), "room": (0, MAX_ROOM), "int": (-(2**63), 2**63 - 1)}
_FAST = FastCodec(MESSAGE_TYPES, MAGIC, PROTOCOL_VERSION, _HEADER, _LENGTH, _INT_RANGES)


def _checked_scalar(cls_name: str, name: str, kind: str, value: Any) -> Any:
    def bad(expected: str) -> RemoteProtocolError:
        return RemoteProtocolError(f"{cls_name}.{name}: expected {expected}, got {value!r:.80}")

    if kind == "str":
        if not isinstance(value, str):
            raise bad("a string")
        cap = MAX_STR_CHARS.get(name)
        if cap is not None and len(value) > cap:
            raise bad(f"a string of at most {cap} characters")
        return value
    if kind == "bool":
        if not isinstance(value, bool):
            raise bad("a boolean")
        return value
    if kind == "ints":
        if not isinstance(value, list) or not all(
                type(v) is int and 0 <= v < 2**64 for v in value):
            raise bad("a list of unsigned 64-bit integers")
        return tuple(value)
    if type(value) is not int:
        raise bad("an integer")
    if kind == "uint" and not 0 <= value < 2**64:
        raise bad("an unsigned 64-bit integer")
    if kind == "room" and not 0 <= value <= MAX_ROOM:
        raise bad(f"a room id in [0, {MAX_ROOM}]")
    if kind == "int" and not -(2**63) <= value < 2**63:
        raise bad("a signed 64-bit integer")
    return value


def _binary(cls_name: str, name: str, kind: str, blob: bytes) -> Any:
    if kind == "bytes":
        return blob
    if len(blob) % 4:
        raise RemoteProtocolError(f"{cls_name}.{name}: {len(blob)} bytes is not a whole number of int32")
    return np.frombuffer(blob, dtype="<i4").astype(np.int32, copy=False)
