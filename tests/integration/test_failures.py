"""Failures reach both sides with the right reason; bad input never kills a reader."""

from __future__ import annotations

import asyncio
import dataclasses
import struct
from typing import cast

import numpy as np
import pytest
import zmq
import zmq.asyncio

from asynckv import Aborted, BootstrapTimeout, KVPoll, LayoutMismatch, TransferFailed, WaitingTimeout
from asynckv.proto.messages import (
    MAGIC,
    PROTOCOL_VERSION,
    Register,
    RegisterResult,
    TransferInfo,
    decode,
    encode,
)

from ..proto.samples import SAMPLES
from .conftest import CONTROL, make_pair, transfer_room

pytestmark = pytest.mark.integration


async def test_decode_abort_reaches_prefill() -> None:
    async with make_pair() as pair:
        receiver = pair.decode.receiver(pair.addr, 21)
        await receiver.init([1, 2])
        sender = pair.prefill.sender(21)
        await sender.wait_ready(5)
        assert await receiver.abort("client went away") == KVPoll.Failed  # returns once fenced
        assert await receiver.wait(1) == KVPoll.Failed
        assert isinstance(receiver.failure_exception(), Aborted)
        assert await sender.wait(5) == KVPoll.Failed
        assert sender.failure_reason == "aborted by decode: client went away"
        sender.init(2)
        await sender.send([0, 1])  # a failed room ignores further chunks: nothing is written
        assert not pair.dpool.kv.any()


async def test_prefill_abort_reaches_decode_at_once() -> None:
    async with make_pair() as pair:
        receiver = pair.decode.receiver(pair.addr, 22)
        await receiver.init([1])
        sender = pair.prefill.sender(22)
        await sender.wait_ready(5)
        sender.abort("prefill OOM")
        assert await receiver.wait(5) == KVPoll.Failed
        assert isinstance(receiver.failure_exception(), TransferFailed)
        assert "prefill OOM" in (receiver.failure_reason or "")


async def test_bootstrap_timeout_fails_the_sender() -> None:
    async with make_pair(bootstrap_timeout_s=0.2) as pair:
        sender = pair.prefill.sender(23)
        assert await sender.wait(5) == KVPoll.Failed
        assert isinstance(sender.failure_exception(), BootstrapTimeout)
        assert "no destination from decode after 0.2s" in (sender.failure_reason or "")


async def test_waiting_timeout_fails_the_receiver_and_tells_prefill() -> None:
    async with make_pair(waiting_timeout_s=0.3) as pair:
        receiver = pair.decode.receiver(pair.addr, 24)
        await receiver.init([1])
        sender = pair.prefill.sender(24)
        await sender.wait_ready(5)
        assert await receiver.wait(5) == KVPoll.Failed
        assert isinstance(receiver.failure_exception(), WaitingTimeout)
        assert await sender.wait(5) == KVPoll.Failed  # the abort reached prefill
        assert "aborted by decode" in (sender.failure_reason or "")


async def test_page_size_mismatch_is_refused_naming_both_values() -> None:
    async with make_pair(page_size=4, decode_fields={"page_size": 8}) as pair:
        receiver = pair.decode.receiver(pair.addr, 25)
        assert await receiver.init([1]) == KVPoll.Failed
        assert isinstance(receiver.failure_exception(), LayoutMismatch)
        assert receiver.failure_reason == "page_size mismatch: prefill has 4, decode has 8"


@pytest.mark.zmq_wire
async def test_item_size_mismatch_is_refused_at_registration() -> None:
    async with make_pair() as pair:
        # A decode whose pages are twice as large: same page_size, different bytes per page.
        from asynckv import Config, KVManager, Mode
        from asynckv.testing import KVPool

        pool = KVPool(4, 64, 512)
        async with KVManager(Mode.DECODE, pool.kv_args(4), config=Config(**CONTROL, waiting_timeout_s=5)) as other:
            receiver = other.receiver(pair.addr, 26)
            assert await receiver.init([1]) == KVPoll.Failed
            assert receiver.failure_reason == ("prefill refused registration: KV entry 0 item size mismatch: "
                                               "prefill has 256 bytes per page, decode has 512")
        assert pair.prefill.stats["peers_refused"] == 1
        assert await transfer_room(pair, 27, [0], [0]) == (KVPoll.Success, KVPoll.Success)


async def raw_decode_socket(ctx: zmq.asyncio.Context) -> tuple[zmq.asyncio.Socket, str]:
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    return pull, f"tcp://127.0.0.1:{port}"


@pytest.mark.zmq_wire
async def test_protocol_version_mismatch_is_refused_naming_both_versions() -> None:
    async with make_pair() as pair:
        ctx = zmq.asyncio.Context()
        pull, endpoint = await raw_decode_socket(ctx)
        push = ctx.socket(zmq.PUSH)
        push.connect(pair.prefill.endpoint)
        try:
            register = cast(Register, SAMPLES["register"])
            frames = encode(dataclasses.replace(register, prefill_id=pair.prefill.name, endpoint=endpoint))
            frames[0] = struct.pack("<4sHH", MAGIC, PROTOCOL_VERSION + 1, Register.TYPE)
            await push.send_multipart(frames)
            reply = decode(await asyncio.wait_for(pull.recv_multipart(), 5))
            assert isinstance(reply, RegisterResult) and not reply.ok
            assert reply.reason == (f"protocol version mismatch: peer speaks v{PROTOCOL_VERSION + 1}, "
                                    f"we speak v{PROTOCOL_VERSION}")
        finally:
            push.close(0)
            pull.close(0)
            ctx.term()


@pytest.mark.zmq_wire
async def test_garbage_is_dropped_counted_and_the_reader_lives_on() -> None:
    async with make_pair() as pair:
        ctx = zmq.asyncio.Context()
        push = ctx.socket(zmq.PUSH)
        push.connect(pair.prefill.endpoint)
        try:
            garbage = [[b"NixlMsgGuard", b"None"], [b""], [b"AKVP\x01\x00\x03\x00", b"{}"], [b"x" * 10] * 9,
                       [struct.pack("<4sHH", MAGIC, PROTOCOL_VERSION, 77), b"{}"]]
            for frames in garbage * 20:
                await push.send_multipart(frames)
            control = pair.prefill.control
            for _ in range(500):
                if sum(control.dropped.values()) >= 100:
                    break
                await asyncio.sleep(0.005)
            assert sum(control.dropped.values()) == 100 and control.reader_alive
            assert pair.prefill.healthy
            assert await transfer_room(pair, 28, [0, 1], [5, 6]) == (KVPoll.Success, KVPoll.Success)
        finally:
            push.close(0)
            ctx.term()


async def test_out_of_range_destination_from_a_peer_fails_the_room_before_any_write() -> None:
    async with make_pair() as pair:
        assert await transfer_room(pair, 29, [0], [0]) == (KVPoll.Success, KVPoll.Success)  # registers decode
        sender = pair.prefill.sender(30)
        bad = TransferInfo(30, 1, pair.decode.name, pair.prefill.name, -1, 1, False, True, 0,
                           np.array([3, 64], dtype=np.int32),
                           np.empty(0, dtype=np.int32))
        pair.decode.send_control(pair.prefill.endpoint, bad)
        assert await sender.wait(5) == KVPoll.Failed
        assert "decode destination pages: index 64 outside the registered range [0, 64)" in (
            sender.failure_reason or "")
        assert not pair.dpool.kv[:, 3].any()


async def test_an_abort_before_the_sender_exists_fails_it_at_once() -> None:
    async with make_pair(handshake_timeout_s=5) as pair:
        from asynckv.testing import FaultInjector, inject

        injector = FaultInjector()
        inject(pair.prefill, injector)
        injector.fail_next(1)  # the warm-up write of the first contact fails: registration is refused
        receiver = pair.decode.receiver(pair.addr, 31)
        assert await receiver.init([0]) == KVPoll.Failed
        assert "warm-up: injected failure" in (receiver.failure_reason or "")
        sender = pair.prefill.sender(31)
        assert await sender.wait(2) == KVPoll.Failed
        assert (sender.failure_reason or "").startswith("aborted by decode")
