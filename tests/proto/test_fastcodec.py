"""The generated fast paths (``proto/fastcodec.py``) against the generic codec they stand in for:
the same bytes out, the same messages in, and every frame they refuse decided by the generic path
exactly as before (the same message, or the same error)."""

from __future__ import annotations

import json
import struct
import sys
from typing import Any, cast

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asynckv.errors import RemoteProtocolError
from asynckv.proto import messages as m
from asynckv.proto.messages import MESSAGE_TYPES, Register, Status, TransferInfo, decode, encode, pack, unpack
from asynckv.proto.wire_limits import MAX_REASON_CHARS, MAX_STR_CHARS

from .samples import SAMPLES

FAST_TYPES = [cls for cls in MESSAGE_TYPES.values() if cls is not Register]
_BOUNDS = {"uint": (0, 2**64 - 1), "int": (-(2**63), 2**63 - 1), "room": (0, m.MAX_ROOM)}


def _field(name: str, kind: str) -> st.SearchStrategy[Any]:
    if kind in _BOUNDS:
        low, high = _BOUNDS[kind]
        return st.one_of(st.sampled_from([low, high, 0, 1]), st.integers(low, high))
    if kind == "bool":
        return st.booleans()
    if kind == "i32":
        return st.lists(st.integers(-(2**31), 2**31 - 1), max_size=8).map(lambda v: np.asarray(v, dtype=np.int32))
    if kind == "bytes":
        return st.binary(max_size=32)
    cap = MAX_STR_CHARS.get(name, MAX_REASON_CHARS + 8 if name == "reason" else 64)
    return st.one_of(st.text(max_size=min(cap, 24)), st.sampled_from(['"\\\n\x00\u2028é😀', "x" * cap]))


def _message(cls: type) -> st.SearchStrategy[Any]:
    return st.builds(cls, **{n: _field(n, k) for n, k in cls.SCHEMA})  # type: ignore[attr-defined]


MESSAGES = st.sampled_from(FAST_TYPES).flatmap(_message)


def _same(a: Any, b: Any) -> None:
    """Equal, field by field, with the same types (arrays: the same dtype and values)."""
    assert type(a) is type(b)
    for name, kind in a.SCHEMA:
        x, y = getattr(a, name), getattr(b, name)
        assert type(x) is type(y), name
        if kind == "i32":
            assert x.dtype == y.dtype and np.array_equal(x, y), name
        else:
            assert x == y, name


def _outcome(fn: Any, *args: Any) -> tuple[str, Any]:
    try:
        return "ok", fn(*args)
    except RemoteProtocolError as exc:
        return type(exc).__name__, str(exc)


@settings(max_examples=400, deadline=None)
@given(MESSAGES)
def test_the_fast_encoders_write_the_generic_encoders_bytes(msg: Any) -> None:
    generic = m._encode_generic(msg)
    assert encode(msg) == generic
    assert m.encode_frame(msg) == pack(generic)
    assert m._FAST.encode_frame(msg) is not None  # (the fast path was taken: a plain message of a fast type)


@settings(max_examples=400, deadline=None)
@given(MESSAGES)
def test_the_fast_decoders_build_the_generic_decoders_messages(msg: Any) -> None:
    parts = m._encode_generic(msg)
    fast = m._FAST.decode(parts)
    assert fast is not None
    _same(fast, m._decode_generic(parts))
    _same(decode([pack(parts)]), m._decode_generic(parts))


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_every_sample_decodes_alike_both_ways_and_register_has_no_fast_path(name: str) -> None:
    parts = m._encode_generic(SAMPLES[name])
    fast = m._FAST.decode(parts)
    if isinstance(SAMPLES[name], Register):
        assert fast is None and m._FAST.encode_parts(SAMPLES[name]) is None
    else:
        _same(fast, m._decode_generic(parts))
    assert encode(SAMPLES[name]) == parts


def test_values_the_generic_encoder_writes_differently_take_the_generic_path() -> None:
    plain = Status(room=5, epoch=7, prefill_id="p", session=9, sender_rank=0, ok=True, reason="")
    odd = [plain.__class__(**{**_fields(plain), "ok": 1}),  # (an int in a bool field: JSON 1, not true)
           plain.__class__(**{**_fields(plain), "room": True}),  # (a bool in an int field: JSON true)
           plain.__class__(**{**_fields(plain), "reason": type("S", (str,), {})("sub")})]
    for msg in odd:
        assert m._FAST.encode_parts(msg) is None
        assert encode(msg) == m._encode_generic(msg)
    numpy_int = plain.__class__(**{**_fields(plain), "epoch": np.int64(7)})
    assert m._FAST.encode_frame(numpy_int) is None
    with pytest.raises(TypeError):  # (as before: the generic encoder cannot write a numpy integer)
        encode(numpy_int)


def test_a_long_reason_is_cut_alike() -> None:
    msg = Status(room=1, epoch=2, prefill_id="p", session=3, sender_rank=4, ok=False,
                 reason="é" * (MAX_REASON_CHARS + 1))
    assert m.encode_frame(msg) == pack(m._encode_generic(msg))
    assert cast(Status, decode([m.encode_frame(msg)])).reason == "é" * (MAX_REASON_CHARS - 3) + "..."


def _fields(msg: Any) -> dict[str, Any]:
    return {n: getattr(msg, n) for n, _ in msg.SCHEMA}


def _body_variants(msg: Any) -> list[bytes]:
    """Bodies the generic decoder treats each its own way: whitespace, a missing, extra, repeated,
    out-of-range or mistyped field, not an object, not JSON, not UTF-8."""
    body = json.loads(m._encode_generic(msg)[1])
    key = sorted(body)[0]
    out = [b" " + json.dumps(body).encode(), json.dumps(body).encode() + b" ", json.dumps(body, indent=1).encode(),
           json.dumps({k: v for k, v in body.items() if k != key}).encode(),
           json.dumps({**body, "extra": [1, {"x": None}]}).encode(),
           json.dumps(body, separators=(",", ":"))[:-1].encode() + b',"' + key.encode() + b'":null}',
           b"[]", b"{", b"\xff\xfe", json.dumps(body).encode() + b"x", json.dumps(list(body.items())).encode()]
    for name in body:
        for bad in (-1, 2**64, 2**63, True, 1.5, "7", None, "x" * 300):
            out.append(json.dumps({**body, name: bad}).encode())
    return out


@pytest.mark.parametrize("cls", FAST_TYPES, ids=lambda c: c.__name__)
def test_every_refused_or_odd_body_is_decided_as_the_generic_decoder_decides_it(cls: type) -> None:
    msg = next(s for s in SAMPLES.values() if type(s) is cls)
    parts = m._encode_generic(msg)
    variants = [[parts[0], body, *parts[2:]] for body in _body_variants(msg)]
    for i in range(2, len(parts)):  # (a binary part a byte longer or shorter: not whole int32 for pages)
        variants += [[*parts[:i], parts[i] + b"\x01", *parts[i + 1:]], [*parts[:i], parts[i][:-1], *parts[i + 1:]]]
    for variant in variants:
        body = variant[1]
        got, want = _outcome(decode, variant), _outcome(m._decode_generic, variant)
        assert got[0] == want[0], body
        if got[0] == "ok":
            _same(got[1], want[1])
        else:
            assert got[1] == want[1]
        assert _outcome(decode, [pack(variant)])[0] == want[0]


@settings(max_examples=600, deadline=None)
@given(st.sampled_from(sorted(SAMPLES)), st.data())
def test_a_corrupted_frame_is_decided_as_the_generic_decoder_decides_it(name: str, data: st.DataObject) -> None:
    frame = bytearray(pack(m._encode_generic(SAMPLES[name])))
    for _ in range(data.draw(st.integers(1, 3))):
        frame[data.draw(st.integers(0, len(frame) - 1))] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, 4))
    wire = bytes(frame[:len(frame) - cut])
    want = _outcome(lambda f: m._decode_generic(unpack(f)), wire)
    got = _outcome(decode, [wire])
    assert got[0] == want[0]
    if got[0] == "ok":
        _same(got[1], want[1])
    else:
        assert got[1] == want[1]


def test_pages_decode_as_read_only_little_endian_int32_either_way() -> None:
    msg = next(s for s in SAMPLES.values() if isinstance(s, TransferInfo))
    for parts in (m._encode_generic(msg), unpack(pack(m._encode_generic(msg)))):
        fast, generic = m._FAST.decode(parts), cast(TransferInfo, m._decode_generic(parts))
        assert fast.dst_pages.dtype == generic.dst_pages.dtype == np.int32
        assert not fast.dst_pages.flags.writeable and not generic.dst_pages.flags.writeable


def test_the_generated_source_is_readable_python_for_each_fast_type() -> None:
    for cls in FAST_TYPES:
        text = m._FAST.source(cls)
        compile(text, cls.__name__, "exec")
        assert "def encode_frame(msg):" in text and "def build(raw" in text


def test_a_header_part_in_any_buffer_decodes_as_the_generic_path_reads_it() -> None:
    head, body = m._encode_generic(Status(5, 7, "p", 9, 0, True, ""))
    strided = memoryview(bytes(x for c in head for x in (c, 0)))[::2]  # (8 bytes, not contiguous)
    _same(decode([strided, body]), m._decode_generic([strided, body]))  # type: ignore[list-item]
    wide = np.frombuffer(head, np.uint8).astype(np.uint16)  # (8 items, 16 bytes)
    assert _outcome(decode, [wide, body]) == _outcome(m._decode_generic, [wide, body])


def test_a_message_bad_in_a_binary_field_and_a_scalar_raises_what_the_generic_encoder_raises() -> None:
    limit = sys.get_int_max_str_digits()
    msg = TransferInfo(room=10 ** (limit + 10) if limit else 1, epoch=0, decode_id="d", prefill_id="p", aux_index=-1,
                       required_dst_info_num=1, is_dummy=False, write_aux=True, decode_prefix_len=0,
                       dst_pages=None, dst_state_indices=np.array([], np.int32))  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        m._encode_generic(msg)
    with pytest.raises(TypeError):
        encode(msg)
    with pytest.raises(TypeError):
        m.encode_frame(msg)


def test_a_deeply_nested_body_within_its_cap_is_refused_as_malformed() -> None:
    deep = b'{"x":' + b"[" * 2000 + b"]" * 2000 + b"}"
    parts = [struct.pack("<4sHH", m.MAGIC, m.PROTOCOL_VERSION, TransferInfo.TYPE), deep, b"", b""]
    with pytest.raises(RemoteProtocolError, match="not JSON"):
        decode([pack(parts)])
