"""How control messages travel (protocol version 4): asynckv's wire sends each message as one ZMQ
frame (``messages.pack``: its parts, then the authentication trailer, each length-prefixed); SGLang's
wire stays multipart. The reader takes either: a multipart message of an older asynckv is refused as
a version mismatch, a broken envelope as malformed, and the reader carries on. Real ZMQ sockets."""

from __future__ import annotations

import struct
import time

import pytest
import zmq

from asynckv.proto.auth import Authenticator
from asynckv.proto.messages import MAGIC, Ping, VersionMismatch, decode, encode, pack, unpack
from asynckv.transport.control import ControlChannel

from .test_control_reader import ping, started
from .waiting import until

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("one_frame", [True, False], ids=["asynckv wire", "multipart (SGLang's wire)"])
@pytest.mark.parametrize("secret", ["", "s3cret"], ids=["plain", "sealed"])
async def test_a_message_leaves_as_one_frame_on_asynckv_wire_and_as_its_parts_otherwise(
        one_frame: bool, secret: str) -> None:
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    endpoint = f"tcp://127.0.0.1:{pull.bind_to_random_port('tcp://127.0.0.1')}"
    chan = ControlChannel("127.0.0.1", lambda msg: None, auth=Authenticator(secret) if secret else None,
                          one_frame=one_frame)
    await chan.start()
    try:
        msg = Ping("p" * 8, chan.endpoint, 1, 7)
        chan.send(endpoint, msg)
        assert pull.poll(5000), "nothing arrived"
        frames = pull.recv_multipart()
    finally:
        pull.close()
        ctx.term()
        await chan.close(flush_s=0.1)
    parts = unpack(frames[0]) if one_frame else frames
    assert len(frames) == (1 if one_frame else len(parts))
    if secret:
        parts = Authenticator(secret).open(parts, endpoint, time.time_ns())
    assert parts == encode(msg) and decode(parts) == msg


async def test_the_reader_takes_one_frame_and_multipart_and_refuses_an_older_version_and_broken_envelopes() -> None:
    got: list[int] = []
    mismatches: list[VersionMismatch] = []
    async with started(lambda msg: got.append(msg.seq)) as (chan, push):
        chan._on_version_mismatch = mismatches.append
        older = ping(3)
        older[0] = struct.pack("<4sHH", MAGIC, 3, Ping.TYPE)  # version 3 sent its parts as a multipart message
        push.send(pack(ping(1)))
        push.send_multipart(ping(2))  # this version's parts, multipart: read as well
        push.send_multipart(older)
        push.send(pack(ping(4))[:-1])  # the last part cut short: the envelope says more than came
        push.send(struct.pack("<I", 5) + b"AKVP")
        push.send(pack([ping(6)[0]] * 10))
        push.send(pack(ping(7)))
        await until(lambda: 7 in got, "the last message")
    assert got == [1, 2, 7]
    assert [m.theirs for m in mismatches] == [3] and chan.dropped == {"version": 1, "malformed": 3}
