"""With a shared secret, unauthenticated and replayed control messages and bootstrap requests are refused."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
import zmq
import zmq.asyncio

from asynckv import KVPoll
from asynckv.proto.auth import AUTH_HEADER, Authenticator
from asynckv.proto.messages import Bye, Ping, Pong, encode

from ..proto.test_bootstrap_table import rank
from .conftest import CONTROL, make_pair, transfer_room

pytestmark = pytest.mark.integration


@pytest.mark.zmq_wire
async def test_unauthenticated_and_replayed_messages_are_refused_and_counted() -> None:
    async with make_pair(auth_token="s3cret") as pair:
        control = pair.prefill.control
        ctx = zmq.asyncio.Context()
        push = ctx.socket(zmq.PUSH)
        push.connect(pair.prefill.endpoint)
        try:
            ping = encode(Ping("intruder", "tcp://127.0.0.1:1", 1, 1))
            to = pair.prefill.endpoint
            await push.send_multipart(ping)  # no MAC
            await push.send_multipart(Authenticator("guess").seal(ping, to, time.time_ns()))  # wrong secret
            sealed = Authenticator("s3cret").seal(ping, to, time.time_ns())
            await push.send_multipart(sealed)  # accepted
            await push.send_multipart(sealed)  # the same bytes again: a replay
            await push.send_multipart(Authenticator("s3cret").seal(ping, to, time.time_ns() - 60 * 10**9))  # stale
            for _ in range(200):
                if sum(control.dropped.values()) >= 4:
                    break
                await asyncio.sleep(0.005)
            assert control.dropped["auth_missing"] == 1 and control.dropped["auth_bad_mac"] == 1
            assert control.dropped["auth_replayed"] == 1 and control.dropped["auth_stale"] == 1
            assert pair.prefill.stats["msg_Ping"] == 1
            assert await transfer_room(pair, 5, [1, 2], [3, 4]) == (KVPoll.Success, KVPoll.Success)
        finally:
            push.close(0)
            ctx.term()


async def test_mutating_bootstrap_requests_need_the_secret() -> None:
    async with make_pair(auth_token="s3cret") as pair, aiohttp.ClientSession() as http:
        url = f"http://{pair.addr}/route"
        body = b'{"x": 1}'
        async with http.put(url, data=body) as resp:
            assert resp.status == 401 and "missing" in await resp.text()
        header = Authenticator("s3cret").http_header("PUT", "/route", body, time.time_ns())
        async with http.put(url, data=body, headers={AUTH_HEADER: header}) as resp:
            assert resp.status == 400  # authenticated, then refused for its content
        async with http.put(url, data=body, headers={AUTH_HEADER: header}) as resp:
            assert resp.status == 401 and "replayed" in await resp.text()
        async with http.put(url, json=rank().to_json(),
                            headers={AUTH_HEADER: Authenticator("guess").http_header(
                                "PUT", "/route", b"", time.time_ns())}) as resp:
            assert resp.status == 401
        async with http.get(f"http://{pair.addr}/health") as resp:
            assert resp.status == 200


async def test_a_decode_without_the_secret_cannot_use_the_prefill() -> None:
    async with make_pair(auth_token="s3cret") as pair:
        from asynckv import Config, KVManager, Mode
        from asynckv.testing import KVPool

        pool = KVPool(4, 64, 256)
        cfg = Config(**CONTROL, auth_token="", handshake_timeout_s=1.0, waiting_timeout_s=5)
        async with KVManager(Mode.DECODE, pool.kv_args(4), config=cfg) as intruder:
            receiver = intruder.receiver(pair.addr, 9)
            assert await receiver.init([1]) == KVPoll.Failed
            assert "did not answer registration" in (receiver.failure_reason or "")
        assert pair.prefill.control.dropped["auth_missing"] >= 1


@pytest.mark.zmq_wire
async def test_a_message_sealed_for_one_prefill_is_refused_by_another() -> None:
    """A Bye that decode sealed for prefill P1, replayed to P2, must not end decode's session at P2
    (P2 then dropped decode's next room as unknown); nor may a replayed Pong renew a lease there."""
    async with make_pair(auth_token="s3cret") as pair, make_pair(auth_token="s3cret") as other:
        d = pair.decode
        assert await transfer_room(pair, 5, [1, 2], [3, 4]) == (KVPoll.Success, KVPoll.Success)
        # the same decode registers with a second prefill: one session with each
        receiver, sender = d.receiver(other.addr, 6), other.prefill.sender(6)
        assert await receiver.init([5, 6]) == KVPoll.WaitingForInput
        p2 = other.prefill
        session = p2.snapshot()["peers"][0]["session"]
        ctx = zmq.asyncio.Context()
        push = ctx.socket(zmq.PUSH)
        push.connect(p2.endpoint)
        try:
            for msg in (Bye(d.name, session, "manager closed"), Pong(d.name, session, 1)):
                sealed_for_p1 = Authenticator("s3cret").seal(encode(msg), pair.prefill.endpoint, time.time_ns())
                await push.send_multipart(sealed_for_p1)
            for _ in range(200):
                if p2.control.dropped["auth_bad_mac"] >= 2:
                    break
                await asyncio.sleep(0.005)
            assert p2.control.dropped["auth_bad_mac"] == 2
            assert p2.stats.get("msg_Bye", 0) == 0
            assert [peer["session"] for peer in p2.snapshot()["peers"]] == [session]  # decode still registered
            assert await sender.wait_ready(10) == KVPoll.WaitingForInput
            sender.init(2)
            await sender.send([1, 2])
            assert await receiver.wait(10) == KVPoll.Success
        finally:
            push.close(0)
            ctx.term()
