"""Fast paths of the native codec for the messages every room sends, byte for byte the same wire.

``messages.encode``/``pack``/``decode`` walk a message's schema field by field: a dict, a JSON
encoder call, one validation call per field, a keyword ``__init__``. At 1,000 rooms in flight that
walk was the largest single cost a profile could name: 16% of the prefill loop's samples and 22% of
decode's (py-spy, Q3, 2026-12-06). Here each message type whose fields are scalars, strings,
booleans and binary arrays (every type but ``Register``, which travels once per pair) gets three
functions generated from its schema when this module is imported, the way ``dataclasses`` writes
``__init__``: straight-line code, one ``%`` format for the JSON body, the same checks inline.

- ``encode_parts(msg)``: the message's parts (header, body, binary fields), as ``encode`` makes them;
- ``encode_frame(msg)``: the one frame ``pack(encode(msg))`` makes;
- ``build(body, *binaries)``: the message from its body part and binary parts, as ``decode`` makes it
  (the frame's or the parts' layout, sizes and header are checked by the callers in ``messages``).

The fast paths decide nothing on their own. An encoder returns ``None`` for any value the generic
encoder would treat differently from a plain ``int``/``str``/``bool`` (a numpy integer, a bool in
an int field, a ``str`` subclass), and ``build`` returns ``None`` for anything but a body and parts
that pass every check; the caller then takes the generic path, which gives the same message or
raises the same error as before. A test holds both paths to the same bytes and the same messages
(``tests/proto/test_fastcodec.py``); ``FastCodec.source(cls)`` shows the generated code.
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Callable, Mapping
from json import JSONDecoder
from json.encoder import encode_basestring_ascii  # (json.dumps's own, for str with ensure_ascii)
from typing import Any, NamedTuple

import numpy as np

from ..errors import RemoteProtocolError
from .wire_limits import MAX_REASON_CHARS, MAX_STR_CHARS, check_sizes

__all__ = ["FastCodec", "FastPaths"]

_BINARY = ("bytes", "i32")
_SCALAR = ("int", "uint", "room", "str", "bool")
# (no whitespace around the object, as encoders send it; anything else goes the generic way)
_json_scan = JSONDecoder().scan_once  # type: ignore[attr-defined]
_LE_I32 = np.dtype("<i4")


class FastPaths(NamedTuple):
    """One message type's generated functions (see the module docstring)."""

    encode_parts: Callable[[Any], list[bytes] | None]
    encode_frame: Callable[[Any], bytes | None]
    build: Callable[..., Any]
    binaries: int
    """How many binary parts follow the body."""


def _i32_swapped(blob: bytes) -> Any:
    return np.frombuffer(blob, _LE_I32).astype(np.int32, copy=False)


def _i32_native(blob: bytes) -> Any:  # (little-endian hosts: the generic decoder's astype is a no-op)
    return np.frombuffer(blob, _LE_I32)


_i32 = _i32_native if sys.byteorder == "little" else _i32_swapped


def _i32_bytes(value: Any) -> bytes:
    return np.ascontiguousarray(value, dtype="<i4").tobytes()


def _tuple(names: list[str]) -> str:
    return ", ".join(names) + ("," if len(names) == 1 else "")


def _source(cls: type, bounds: Mapping[str, tuple[int, int]]) -> str:
    """The generated functions of ``cls`` as Python source; ``bounds``: each integer kind's range."""
    schema: tuple[tuple[str, str], ...] = cls.SCHEMA  # type: ignore[attr-defined]
    fields = [n for n, _ in schema]
    scalars = sorted((n, k) for n, k in schema if k in _SCALAR)  # (the JSON body's keys, sorted)
    binaries = [(n, k) for n, k in schema if k in _BINARY]
    has_reason = ("reason", "str") in scalars

    # Encoding: exact types only (the generic encoder writes anything else differently, or raises).
    exact = {"bool": "bool", "str": "str"}
    enc = ["def encode_body(msg):",
           f"    {_tuple(fields)} = {_tuple([f'msg.{n}' for n in fields])}",
           "    if not (" + " and ".join(f"type({n}) is {exact.get(k, 'int')}" for n, k in scalars) + "):",
           "        return None"]
    if has_reason:
        enc.append(f"    if len(reason) > {MAX_REASON_CHARS}: reason = reason[:{MAX_REASON_CHARS - 3}] + '...'")
    # (the binary fields first: the generic encoder converts them before it writes the body, so a
    # message bad in both ways raises the same error either way)
    enc += [f"    {n} = {'bytes' if k == 'bytes' else '_i32_bytes'}({n})" for n, k in binaries]
    body = "{" + ",".join(f'"{n}":{"%s" if k in exact else "%d"}' for n, k in scalars) + "}"
    values = [f"'true' if {n} else 'false'" if k == "bool" else f"_str({n})" if k == "str" else n for n, k in scalars]
    enc.append(f"    return {_tuple([f'({body!r} % ({_tuple(values)})).encode()', *(n for n, _ in binaries)])}")
    parts = ["body", *(n for n, _ in binaries)]
    enc += ["",
            "def encode_parts(msg):",
            "    out = encode_body(msg)",
            "    return None if out is None else [_HEAD, *out]",
            "",
            "def encode_frame(msg):",
            "    out = encode_body(msg)",
            "    if out is None: return None",
            f"    {_tuple(parts)} = out",
            "    return b''.join((_PACKED_HEAD, " + ", ".join(f"_len(len({p})), {p}" for p in parts) + "))"]

    # Decoding: the generic decoder's checks, inline, for the body and binary parts it was given.
    def check(name: str, kind: str) -> str:
        if kind in bounds:
            low, high = bounds[kind]
            return f"type({name}) is int and {low} <= {name} <= {high}"
        if kind == "bool":
            return f"type({name}) is bool"
        cap = MAX_STR_CHARS.get(name)
        return f"type({name}) is str" + (f" and len({name}) <= {cap}" if cap is not None else "")

    dec = [f"def build({', '.join(['raw', *(n for n, _ in binaries)])}):",
           "    try:",
           "        text = bytes(raw).decode('utf-8')",
           "        body, stop = _json(text, 0)",
           "    except Exception:",  # (not UTF-8 or not JSON: the generic path says why)
           "        return None",
           "    if stop != len(text) or type(body) is not dict: return None",
           "    try:",
           f"        {_tuple([n for n, _ in scalars])} = {_tuple([f'body[{n!r}]' for n, _ in scalars])}",
           "    except KeyError:",  # (a field missing: the generic path names it)
           "        return None",
           "    if not (" + " and ".join(check(n, k) for n, k in scalars) + "):",
           "        return None"]
    for n, k in binaries:  # (bytes() of bytes is the same object; of a ZMQ frame, a copy, as generic makes)
        dec += [f"    {n} = bytes({n})"]
        if k == "i32":
            dec += [f"    if len({n}) % 4: return None", f"    {n} = _i32({n})"]
    dec += ["    msg = _new(_cls)", *(f"    _set(msg, {n!r}, {n})" for n in fields), "    return msg"]
    return "\n".join(enc) + "\n\n" + "\n".join(dec) + "\n"


class FastCodec:
    """The fast paths of a set of message types, behind the generic codec's own signatures: each
    method returns ``None`` where the generic path must decide. ``header`` and ``length`` are the
    codec's structs (header part, part length), ``bounds`` its integer kinds' ranges."""

    def __init__(self, types: dict[int, type], magic: bytes, version: int, header: struct.Struct,
                 length: struct.Struct, bounds: Mapping[str, tuple[int, int]]) -> None:
        self._magic, self._version, self._header, self._bounds = magic, version, header, bounds
        self._by_type: dict[int, FastPaths] = {}
        for msg_type, cls in types.items():
            if not all(k in _SCALAR or k in _BINARY for _, k in cls.SCHEMA):  # type: ignore[attr-defined]
                continue
            head = header.pack(magic, version, msg_type)
            namespace: dict[str, Any] = {
                "_HEAD": head, "_PACKED_HEAD": length.pack(len(head)) + head, "_len": length.pack,
                "_str": encode_basestring_ascii, "_i32_bytes": _i32_bytes, "_i32": _i32, "_json": _json_scan,
                "_new": object.__new__, "_set": object.__setattr__, "_cls": cls}
            exec(compile(self.source(cls), f"<fastcodec {cls.__name__}>", "exec"), namespace)
            binaries = sum(k in _BINARY for _, k in cls.SCHEMA)  # type: ignore[attr-defined]
            self._by_type[msg_type] = FastPaths(namespace["encode_parts"], namespace["encode_frame"],
                                                namespace["build"], binaries)
        self._by_class = {types[t]: paths for t, paths in self._by_type.items()}

    def source(self, cls: type) -> str:
        """The generated functions of ``cls``, as Python source (for reading and tests)."""
        return _source(cls, self._bounds)

    def encode_parts(self, msg: Any) -> list[bytes] | None:
        fast = self._by_class.get(type(msg))
        return fast.encode_parts(msg) if fast is not None else None

    def encode_frame(self, msg: Any) -> bytes | None:
        fast = self._by_class.get(type(msg))
        return fast.encode_frame(msg) if fast is not None else None

    def decode(self, parts: list[bytes]) -> Any:
        """The message of ``parts`` (header, body, binary parts: ``unpack``'s output), or ``None``."""
        if len(parts) < 2:
            return None
        head = bytes(parts[0])  # (as the generic path reads it: a strided or wide buffer too)
        if len(head) != self._header.size:
            return None
        magic, version, msg_type = self._header.unpack(head)
        fast = self._by_type.get(msg_type)
        if fast is None or magic != self._magic or version != self._version or len(parts) != 2 + fast.binaries:
            return None
        try:
            check_sizes(msg_type, parts)
        except RemoteProtocolError:
            return None
        return fast.build(*parts[1:])
