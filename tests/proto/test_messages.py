from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asynckv.errors import RemoteProtocolError
from asynckv.proto.messages import (
    MAGIC,
    PROTOCOL_VERSION,
    Register,
    Status,
    TransferInfo,
    VersionMismatch,
    decode,
    encode,
    pack,
    unpack,
)

from .samples import SAMPLES

DATA = pathlib.Path(__file__).parent.parent / "data"


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_golden_vectors(name: str) -> None:
    path = DATA / f"{name}.frames"
    frames = encode(SAMPLES[name])
    if os.environ.get("ASYNCKV_REGENERATE_GOLDEN"):
        path.write_bytes(pack(frames))
    wire = path.read_bytes()  # the one ZMQ frame the message travels in
    assert pack(frames) == wire, "the wire format changed: bump PROTOCOL_VERSION and update docs/protocol.md"
    assert unpack(wire) == frames and decode([wire]) == decode(frames) == SAMPLES[name]


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_round_trip_one_frame_at_a_time(name: str) -> None:
    frames = encode(SAMPLES[name])
    for cut in range(len(frames)):
        with pytest.raises(RemoteProtocolError):
            decode(frames[:cut])
    assert decode(frames) == SAMPLES[name]


def test_header_layout_is_magic_version_type() -> None:
    head = encode(SAMPLES["status_ok"])[0]
    assert head[:4] == MAGIC
    assert struct.unpack("<HH", head[4:]) == (PROTOCOL_VERSION, Status.TYPE)


def test_transfer_info_pages_are_little_endian_int32() -> None:
    frames = encode(SAMPLES["transfer_info"])
    assert frames[2] == np.array([7, 3, 4, 5, 0], dtype="<i4").tobytes()
    assert frames[3] == np.array([11], dtype="<i4").tobytes()
    assert json.loads(frames[1]) == {"aux_index": 3, "decode_id": "0b6f3a52-decode", "required_dst_info_num": 1,
                                     "prefill_id": "9c1e-prefill", "epoch": 77,
                                     "room": 2**63 - 1, "is_dummy": False, "write_aux": True,
                                     "decode_prefix_len": 32}


def test_version_mismatch_names_both_versions_and_keeps_the_body() -> None:
    frames = encode(SAMPLES["register"])
    frames[0] = struct.pack("<4sHH", MAGIC, PROTOCOL_VERSION + 1, Register.TYPE)
    with pytest.raises(VersionMismatch) as info:
        decode(frames)
    assert f"v{PROTOCOL_VERSION + 1}" in str(info.value) and f"v{PROTOCOL_VERSION}" in str(info.value)
    assert info.value.body is not None and info.value.body["endpoint"] == "tcp://127.0.0.1:41000"


@pytest.mark.parametrize("mutate, needle", [
    (lambda f: [b"XXXX" + f[0][4:], *f[1:]], "magic"),
    (lambda f: [f[0][:7], *f[1:]], "header"),
    (lambda f: [struct.pack("<4sHH", MAGIC, PROTOCOL_VERSION, 99), *f[1:]], "unknown message type"),
    (lambda f: [f[0], b"{not json", *f[2:]], "JSON"),
    (lambda f: [f[0], b"[1,2]", *f[2:]], "JSON object"),
    (lambda f: [f[0], json.dumps({**json.loads(f[1]), "room": -1}).encode(), *f[2:]], "room"),
    (lambda f: [f[0], json.dumps({**json.loads(f[1]), "room": 2**63}).encode(), *f[2:]], "room"),
    (lambda f: [f[0], json.dumps({**json.loads(f[1]), "aux_index": "3"}).encode(), *f[2:]], "integer"),
    (lambda f: [f[0], json.dumps({**json.loads(f[1]), "aux_index": True}).encode(), *f[2:]], "integer"),
    (lambda f: [f[0], b'{"room": 1}', *f[2:]], "missing field"),
    (lambda f: [*f[:2], f[2][:-1], f[3]], "int32"),
    (lambda f: [*f, b"extra"], "binary frames"),
])
def test_malformed_transfer_info_is_refused_with_a_reason(mutate, needle) -> None:  # type: ignore[no-untyped-def]
    frames = mutate(encode(SAMPLES["transfer_info"]))
    with pytest.raises(RemoteProtocolError, match=needle):
        decode(frames)


def test_transfer_info_equality_compares_pages() -> None:
    a = SAMPLES["transfer_info"]
    assert isinstance(a, TransferInfo)
    b = dataclasses.replace(a, dst_pages=a.dst_pages[::-1].copy())
    assert a != b
    assert a == dataclasses.replace(a, dst_pages=a.dst_pages.copy())


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=64), min_size=0, max_size=6))
def test_garbage_only_ever_raises_remote_protocol_error(frames: list[bytes]) -> None:
    try:
        decode(frames)
    except RemoteProtocolError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(sorted(SAMPLES)), st.integers(0, 200), st.integers(0, 255))
def test_corrupted_byte_only_ever_raises_remote_protocol_error(name: str, pos: int, value: int) -> None:
    frames = [bytearray(f) for f in encode(SAMPLES[name])]
    flat = [(i, j) for i, f in enumerate(frames) for j in range(len(f))]
    i, j = flat[pos % len(flat)]
    frames[i][j] = value
    try:
        decode([bytes(f) for f in frames])
    except RemoteProtocolError:
        pass


# -- the one-frame envelope (version 4) -----------------------------------------------------------


@pytest.mark.parametrize("frame, needle", [
    (b"\x05\x00\x00", "not a packed message"),  # a length cut short
    (struct.pack("<I", 9) + b"12345678", "runs past the frame"),
    (b"".join(struct.pack("<I", 1) + b"x" for _ in range(10)), "more than 9 parts"),  # > 8 + a trailer
    (struct.pack("<I", 2**32 - 1), "runs past the frame"),
])
def test_a_broken_envelope_is_refused_with_a_reason(frame: bytes, needle: str) -> None:
    with pytest.raises(RemoteProtocolError, match=needle):
        unpack(frame)
    with pytest.raises(RemoteProtocolError, match=needle):
        decode([frame])


def test_an_envelope_holds_a_message_and_its_trailer_and_empty_parts() -> None:
    parts = [*encode(SAMPLES["ping"]), b"", b"t" * 70]
    assert unpack(pack(parts)) == parts and unpack(b"") == []
    nine = [b"p"] * 9  # a message of 8 parts and an authentication trailer: the most there can be
    assert unpack(pack(nine)) == nine


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=96))
def test_a_garbage_frame_only_ever_raises_remote_protocol_error(frame: bytes) -> None:
    try:
        decode([frame])
    except RemoteProtocolError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(sorted(SAMPLES)), st.integers(0, 400), st.integers(0, 255))
def test_a_corrupted_wire_frame_only_ever_raises_remote_protocol_error(name: str, pos: int, value: int) -> None:
    frame = bytearray(pack(encode(SAMPLES[name])))
    frame[pos % len(frame)] = value
    try:
        decode([bytes(frame)])
    except RemoteProtocolError:
        pass


def test_one_frame_decodes_from_any_buffer_a_reader_may_hold() -> None:
    import zmq

    wire = pack(encode(SAMPLES["status_ok"]))
    for frame in (wire, bytearray(wire), memoryview(wire), zmq.Frame(wire)):
        assert decode([frame]) == SAMPLES["status_ok"]  # type: ignore[list-item]
    with pytest.raises(RemoteProtocolError):
        decode([zmq.Frame(wire[:-1])])  # type: ignore[list-item]
