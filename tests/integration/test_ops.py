"""Metrics, /peers and a /health that tells the truth, over real HTTP."""

from __future__ import annotations

import asyncio
import re
import time
from typing import cast

import aiohttp
import pytest
from prometheus_client import generate_latest

from asynckv import KVPoll
from asynckv.service.metrics import REGISTRY
from asynckv.service.prefill import PrefillService
from asynckv.transport.control import ControlChannel
from asynckv.transport.stream import StreamChannel

from .conftest import make_pair, transfer_room

pytestmark = pytest.mark.integration


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    out = []
    for line in text.splitlines():
        m = re.match(rf"^{name}\{{(.*)\}} (\S+)$", line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
            out.append((labels, float(m.group(2))))
    return out


async def test_metrics_have_per_peer_series_with_real_values() -> None:
    async with make_pair(ops_port=0) as pair, aiohttp.ClientSession() as http:
        assert await transfer_room(pair, 3, [1, 2, 3], [4, 5, 6], src_aux=0, dst_aux=1) == (
            KVPoll.Success, KVPoll.Success)
        async with http.get(f"http://{pair.addr}/metrics") as resp:
            assert resp.status == 200 and resp.content_type.startswith("text/plain")
            text = await resp.text()
        peer = pair.decode.name[:8]
        kv = [v for labels, v in samples(text, "asynckv_transfer_bytes_total")
              if labels == {"mode": "prefill", "manager": pair.prefill.name[:8], "peer": peer, "kind": "kv"}]
        assert kv == [3 * pair.prefill.page_bytes]
        assert any(v == 1 for labels, v in samples(text, "asynckv_transfers_total") if labels["kind"] == "aux")
        assert any(labels["peer"] == peer and v >= 1
                   for labels, v in samples(text, "asynckv_transfer_seconds_count"))
        assert any(labels["peer"] == peer for labels, _ in samples(text, "asynckv_descriptors_per_transfer_bucket"))
        assert any(labels["mode"] == "decode" and labels["result"] == "success" and v == 1
                   for labels, v in samples(text, "asynckv_rooms_finished_total"))
        assert any(labels["mode"] == "prefill" and labels["peer"] == peer
                   for labels, _ in samples(text, "asynckv_first_contact_seconds_count"))
        assert any(labels["peer"] == peer and v == 1 for labels, v in samples(text, "asynckv_peer_up"))
        assert {labels["state"] for labels, _ in samples(text, "asynckv_rooms")} >= {"Success", "Failed"}
        assert samples(text, "asynckv_manager_healthy")
        # The decode manager serves the same on its own ops port.
        assert pair.decode.ops_server is not None
        async with http.get(f"http://{pair.decode.ops_server.addr}/peers") as resp:
            peers = (await resp.json())["peers"]
        assert {p["peer"] for p in peers if p["mode"] == "decode"} == {pair.prefill.name[:8]}  # (never in full)
        assert all(p["state"] == "alive" and p["last_heartbeat_s_ago"] < 5 for p in peers)


async def test_dropped_messages_and_failures_are_counted_by_reason() -> None:
    async with make_pair(bootstrap_timeout_s=0.1) as pair, aiohttp.ClientSession() as http:
        sender = pair.prefill.sender(8)
        assert await sender.wait(5) == KVPoll.Failed
        async with http.get(f"http://{pair.addr}/metrics") as resp:
            text = await resp.text()
        assert any(labels["reason"] == "BootstrapTimeout" and labels["result"] == "failed" and v == 1
                   for labels, v in samples(text, "asynckv_rooms_finished_total"))


async def test_health_fails_when_the_reader_dies() -> None:
    async with make_pair(ops_port=0) as pair, aiohttp.ClientSession() as http:
        async with http.get(f"http://{pair.addr}/health") as resp:
            assert resp.status == 200
        control = cast(ControlChannel | StreamChannel, pair.prefill.control)
        control.stop_reader()  # a reader that died, as the reference connector's did
        await asyncio.sleep(0.05)
        async with http.get(f"http://{pair.addr}/health") as resp:
            body = await resp.json()
            assert resp.status == 503 and body["failing"]
        assert pair.decode.ops_server is not None
        async with http.get(f"http://{pair.decode.ops_server.addr}/health") as resp:
            assert resp.status == 200


def test_gone_peers_series_are_kept_for_recent_peers_then_removed() -> None:
    from asynckv.service import metrics

    peers = [f"p{i:07d}" for i in range(metrics.RETIRED_PEERS_KEPT + 10)]
    for peer in peers:
        metrics.TRANSFER_BYTES.labels("prefill", "feedbeef", peer, "kv").inc(1)
        metrics.forget_peer(("prefill", "feedbeef"), peer)
    kept = {values[2] for values in metrics.TRANSFER_BYTES._metrics if values[1] == "feedbeef"}
    assert kept == set(peers[10:])


async def test_loop_lag_is_sampled_where_the_managers_timers_fire() -> None:
    """The loop is held past a heartbeat tick's due time: that tick fires late by at least as much,
    and ``asynckv_loop_lag_seconds`` records it for the manager whose timer it was."""
    async with make_pair(ops_port=0) as pair, aiohttp.ClientSession() as http:
        assert await transfer_room(pair, 3, [1], [2]) == (KVPoll.Success, KVPoll.Success)
        svc = cast(PrefillService, pair.prefill._svc)
        due = svc._timer_at
        assert due is not None  # (its peer's heartbeats keep a timer armed)
        while svc.clock() < due + 0.06:  # hold the loop, as a long callback of the serving stack would
            time.sleep(0.005)
        await asyncio.sleep(0.01)  # the tick runs now, 60 ms late
        async with http.get(f"http://{pair.addr}/metrics") as resp:
            text = await resp.text()
        mine = {"mode": "prefill", "manager": pair.prefill.name[:8]}
        lag_sum = [v for labels, v in samples(text, "asynckv_loop_lag_seconds_sum") if labels == mine]
        under_50ms = [v for labels, v in samples(text, "asynckv_loop_lag_seconds_bucket")
                      if labels == {**mine, "le": "0.05"}]
        count = [v for labels, v in samples(text, "asynckv_loop_lag_seconds_count") if labels == mine]
        assert lag_sum and lag_sum[0] >= 0.06
        assert count and under_50ms and under_50ms[0] < count[0]  # (one sample above 50 ms)
    assert not [labels for labels, _ in samples(generate_latest(REGISTRY).decode(), "asynckv_loop_lag_seconds_count")
                if labels == mine]  # a closed manager's series are gone
