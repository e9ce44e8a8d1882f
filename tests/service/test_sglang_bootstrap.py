"""asynckv's server for SGLang 0.5.10's bootstrap HTTP API, over real HTTP: the answers a stock
SGLang rank expects (tests/interop checks them against real SGLang), and what it refuses."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from asynckv.proto.bootstrap import PayloadError
from asynckv.proto.sglang_bootstrap import SglangRouteTable
from asynckv.service.sglang_bootstrap import SglangBootstrapServer

PARAMS = ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank")


def rank(**kw: Any) -> dict[str, Any]:
    """A prefill rank's PUT body, as SGLang 0.5.10 sends it."""
    base = {"attn_tp_size": 2, "attn_tp_rank": 0, "attn_cp_size": 1, "attn_cp_rank": 0, "attn_dp_size": 1,
            "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0, "system_dp_size": 1, "system_dp_rank": 0,
            "rank_ip": "127.0.0.1", "rank_port": 42577, "page_size": 4, "kv_cache_dtype": "auto",
            "load_balance_method": "follow_bootstrap_room"}
    return {**base, **kw}


def test_readiness_counts_distinct_ranks_and_a_disagreeing_rank_is_refused() -> None:
    table = SglangRouteTable()
    table.register(rank())
    table.register(rank())  # a restart of the same rank (SGLang counted it twice: "ready" at 1 of 2)
    assert not table.ready and table.registered == 1
    with pytest.raises(PayloadError, match="page_size registered 4, got 8"):
        table.register(rank(attn_tp_rank=1, page_size=8))
    table.register(rank(attn_tp_rank=1, rank_port=42578))
    assert table.ready and table.rank_info(0, 0, 1, 0) == {"rank_ip": "127.0.0.1", "rank_port": 42578}
    with pytest.raises(PayloadError, match="more than 4096"):
        SglangRouteTable().register(rank(attn_tp_size=60000))
    for bad in (rank(attn_tp_rank=2), rank(rank_port="1"), rank(rank_ip=""), [], rank(page_size=True)):
        with pytest.raises(PayloadError):
            SglangRouteTable().register(bad)


def test_rooms_are_bounded_and_expire() -> None:
    table = SglangRouteTable(max_rooms=2)
    for room in (1, 2, 3):
        table.register_room(room, room % 2, now=0.0)
    assert table.query_rooms([1, 2, 3, 4], now=1.0) == {"2": 0, "3": 1}
    assert table.query_rooms([2, 3], now=200.0) == {}


async def test_the_answers_sglang_expects() -> None:
    async with SglangBootstrapServer("127.0.0.1", 0) as server, aiohttp.ClientSession() as http:
        url = f"http://{server.addr}"
        topo = dict.fromkeys(PARAMS, "-1")
        async with http.get(f"{url}/route", params=topo) as resp:
            assert resp.status == 503
            assert await resp.text() == "Prefill server not fully registered yet (0 workers registered)."
        for tp in (0, 1):
            async with http.put(f"{url}/route", json=rank(attn_tp_rank=tp, rank_port=5000 + tp)) as resp:
                assert resp.status == 200 and await resp.text() == "OK"
        async with http.get(f"{url}/route", params=topo) as resp:
            assert resp.status == 200
            assert await resp.json() == {
                "attn_tp_size": 2, "attn_cp_size": 1, "dp_size": 1, "pp_size": 1, "page_size": 4,
                "kv_cache_dtype": "auto", "follow_bootstrap_room": True, "target_tp_rank": None,
                "target_tp_ranks": None, "target_cp_ranks": None, "target_pp_ranks": None,
                "required_dst_info_num": None, "required_prefill_response_num": None}
        async with http.get(f"{url}/route", params={**dict.fromkeys(PARAMS, "0"), "target_tp_rank": "1"}) as resp:
            assert await resp.json() == {"rank_ip": "127.0.0.1", "rank_port": 5001}
        async with http.get(f"{url}/route", params={**dict.fromkeys(PARAMS, "0"), "target_tp_rank": "7"}) as resp:
            assert resp.status == 404 and "tp_rank=7" in await resp.text()
        async with http.get(f"{url}/route", params={"prefill_dp_rank": "0"}) as resp:
            assert resp.status == 400 and await resp.text() == "Missing inputs for bootstrap server."
        async with http.post(f"{url}/route") as resp:
            assert resp.status == 405
        async with http.post(f"{url}/register_dp_rank", json={"bootstrap_room": 77, "dp_rank": 1}) as resp:
            assert resp.status == 200
        async with http.post(f"{url}/query_dp_ranks", json={"bootstrap_rooms": [77, 78]}) as resp:
            assert await resp.json() == {"77": 1}
        async with http.get(f"{url}/health") as resp:
            assert resp.status == 200 and await resp.text() == "OK"
        for body in (b"[" * 5000, b"\xff", json.dumps(rank(pp_rank=3)).encode()):  # never a 5xx
            async with http.put(f"{url}/route", data=body) as resp:
                assert resp.status == 400
        assert server.requests_refused >= 6
