"""Ranks whose control messages go over plain TCP streams (``control_transport="stream"``, the
default on asynckv's wire), named explicitly so these hold whatever ASYNCKV_CONTROL_TRANSPORT
the tier runs with: bytes land, chunked and in parallel; a killed prefill process fails its
rooms on the heartbeat bound; authentication holds; a pair whose sides use different transports
fails the room at once, naming both."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

import pytest

from asynckv import BootstrapServer, Config, KVManager, KVPoll, LayoutMismatch, Mode
from asynckv.demo import DemoSpec
from asynckv.testing import KVPool, PeerProcess

from .conftest import check_landed, make_pair, transfer_room
from .test_process_faults import DETECTION_BOUND_S, receive_all, wait_registered

pytestmark = pytest.mark.integration

STREAM: dict[str, Any] = {"control_transport": "stream"}


async def test_rooms_move_byte_exact_over_streams() -> None:
    async with make_pair(**STREAM) as pair:
        assert pair.prefill.endpoint.startswith("stream://") and pair.decode.endpoint.startswith("stream://")
        assert await transfer_room(pair, 1, [0, 1, 2, 3], [9, 4, 7, 5], chunk=1, src_aux=1, dst_aux=2) == (
            KVPoll.Success, KVPoll.Success)
        check_landed(pair, 1, [9, 4, 7, 5], 2)
        rooms = range(10, 40)
        results = await asyncio.gather(*(transfer_room(pair, r, [r], [r + 20]) for r in rooms))
        assert results == [(KVPoll.Success, KVPoll.Success)] * len(rooms)
        for r in rooms:
            check_landed(pair, r, [r + 20])
        pair.assert_no_room_state()
        assert not pair.prefill.control.dropped and not pair.decode.control.dropped


async def test_with_a_token_rooms_move_and_the_tokenless_are_refused() -> None:
    async with make_pair(auth_token="s3cret", **STREAM) as pair:
        assert await transfer_room(pair, 1, [0, 1], [2, 3]) == (KVPoll.Success, KVPoll.Success)
        check_landed(pair, 1, [2, 3])
        pool = KVPool(4, 64, 256)
        cfg = Config(handshake_timeout_s=1.0, waiting_timeout_s=5, **STREAM)
        async with KVManager(Mode.DECODE, pool.kv_args(4), config=cfg) as intruder:
            receiver = intruder.receiver(pair.addr, 9)
            assert await receiver.init([1]) == KVPoll.Failed
            assert "did not answer registration" in (receiver.failure_reason or "")
        assert pair.prefill.control.dropped["auth_missing"] >= 1


@pytest.mark.parametrize(("prefill", "decode"), [("zmq", "stream"), ("stream", "zmq")])
async def test_a_transport_mismatch_fails_the_room_at_once_naming_both(prefill: str, decode: str) -> None:
    pool = KVPool(4, 64, 256)
    async with KVManager(Mode.PREFILL, pool.kv_args(4), bootstrap_addr="127.0.0.1:0",
                         config=Config(control_transport=prefill)) as p, \
            KVManager(Mode.DECODE, pool.kv_args(4), config=Config(control_transport=decode)) as d:
        assert p.bootstrap_addr is not None
        receiver = d.receiver(p.bootstrap_addr, 1)
        started = time.monotonic()
        assert await receiver.init([0]) == KVPoll.Failed
        assert time.monotonic() - started < 5.0  # (not a registration or waiting timeout)
        assert isinstance(receiver.failure_exception(), LayoutMismatch), receiver.failure_reason
        assert f"control_transport mismatch: prefill has '{prefill}', decode has '{decode}'" in str(
            receiver.failure_reason)


async def test_a_killed_prefill_process_fails_its_rooms_on_the_heartbeat_bound() -> None:
    spec = DemoSpec(layers=2, kv_heads=2, head_dim=16, page_size=4, min_pages=4, max_pages=8, chunk_pages=2,
                    seed=11, requests=10, inflight=10, chunk_delay_s=1.5)
    pool = KVPool(spec.entries, spec.requests * spec.max_pages, spec.item_bytes, aux_rows=spec.requests)
    async with BootstrapServer("127.0.0.1", 0) as server:
        spec = dataclasses.replace(spec, bootstrap=server.addr)
        async with PeerProcess.start_ctx("prefill", spec, env={"ASYNCKV_CONTROL_TRANSPORT": "stream"}) as prefill, \
                KVManager(Mode.DECODE, pool.kv_args(spec.page_size),
                          config=Config(waiting_timeout_s=60, **STREAM)) as d:
            await wait_registered(server)
            assert all(r["endpoint"].startswith("stream://") for r in server.table.route()["ranks"])
            inited: list[int] = []
            receiving = asyncio.create_task(receive_all(d, spec, pool, server.addr, inited))
            deadline = time.monotonic() + 30
            while len(inited) < spec.requests and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert len(inited) == spec.requests
            await asyncio.sleep(0.2)
            prefill.kill()
            killed = time.monotonic()
            results = await receiving
            assert [r[1] for r in results] == [KVPoll.Failed] * spec.requests
            assert all("unheard for" in reason for *_, reason in results), results[0]
            assert max(r[2] for r in results) - killed <= DETECTION_BOUND_S
