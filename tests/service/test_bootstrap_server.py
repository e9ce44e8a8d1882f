"""The bootstrap server over real HTTP on 127.0.0.1 (port 0)."""

from __future__ import annotations

import io
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from asynckv import BootstrapServer, BootstrapTimeout, PeerUnreachable, RemoteProtocolError
from asynckv.proto.bootstrap import PrefillRank
from asynckv.service.bootstrap import BootstrapClient, split_addr

from ..proto.test_bootstrap_table import rank


@pytest.fixture
async def server() -> AsyncIterator[BootstrapServer]:
    async with BootstrapServer("127.0.0.1", 0) as srv:
        yield srv


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def call(http: aiohttp.ClientSession, server: BootstrapServer, method: str, path: str,
               **kw: Any) -> tuple[int, Any]:
    async with http.request(method, f"http://{server.addr}{path}", **kw) as resp:
        return resp.status, await resp.json(content_type=None)


async def test_register_then_route_and_health(server: BootstrapServer, http: aiohttp.ClientSession) -> None:
    status, body = await call(http, server, "GET", "/route")
    assert status == 503 and "0/0" in body["error"]
    assert (await call(http, server, "PUT", "/route", json=rank(tp_rank=0).to_json()))[0] == 200
    status, body = await call(http, server, "GET", "/route")
    assert status == 503 and "1/2 ranks" in body["error"]
    await call(http, server, "PUT", "/route", json=rank(tp_rank=1, agent_id="b").to_json())
    status, body = await call(http, server, "GET", "/route")
    assert status == 200 and body["tp_size"] == 2 and [r["tp_rank"] for r in body["ranks"]] == [0, 1]
    status, body = await call(http, server, "GET", "/health")
    assert status == 200 and body["status"] == "ok" and body["ready"] is True


@pytest.mark.parametrize("method, path, kw, code, needle", [
    ("PUT", "/route", {"data": b"{oops"}, 400, "not JSON"),
    ("PUT", "/route", {"json": [1, 2]}, 400, "JSON object"),
    ("PUT", "/route", {"json": {"tp_size": 1}}, 400, "missing field"),
    ("PUT", "/route", {"json": {**rank().to_json(), "tp_rank": 9}}, 400, "tp_rank=9"),
    ("PUT", "/route", {"data": io.BytesIO(b"x" * (2 * 1024 * 1024))}, 413, ""),
    ("GET", "/route?target_tp_rank=1", {}, 400, "no parameters"),
    ("DELETE", "/route", {"json": {"dp_rank": "x"}}, 400, "integer"),
    ("POST", "/route", {}, 405, ""),
])
async def test_malformed_requests_get_4xx_with_a_reason(server: BootstrapServer, http: aiohttp.ClientSession,
                                                        method: str, path: str, kw: dict[str, Any], code: int,
                                                        needle: str) -> None:
    async with http.request(method, f"http://{server.addr}{path}", **kw) as resp:
        assert resp.status == code
        assert needle in await resp.text()
    status, _ = await call(http, server, "GET", "/health")
    assert status == 200


async def test_health_fails_while_a_check_fails(server: BootstrapServer, http: aiohttp.ClientSession) -> None:
    alive = {"reader": True}
    server.add_health_check("reader", lambda: alive["reader"])
    assert (await call(http, server, "GET", "/health"))[0] == 200
    alive["reader"] = False
    status, body = await call(http, server, "GET", "/health")
    assert status == 503 and body["failing"] == ["reader"]


async def test_unregister_removes_the_rank(server: BootstrapServer) -> None:
    client = BootstrapClient(2.0)
    try:
        r = PrefillRank(**{**rank().to_json(), "tp_size": 1})
        await client.register(server.addr, r)
        assert (await client.fetch_instance(server.addr, 1.0)).tp_size == 1
        await client.unregister(server.addr, r)
        assert server.table.registered == 0
        with pytest.raises(BootstrapTimeout, match="not ready"):
            await client.fetch_instance(server.addr, 0.1)
    finally:
        await client.close()


async def test_client_maps_errors() -> None:
    client = BootstrapClient(1.0)
    try:
        with pytest.raises(PeerUnreachable):
            await client.fetch_instance("127.0.0.1:1", 1.0)
        assert not await client.is_up("127.0.0.1:1")
        async with BootstrapServer("127.0.0.1", 0) as srv:
            await client.register(srv.addr, rank())
            with pytest.raises(RemoteProtocolError, match="refused registration"):
                await client.register(srv.addr, rank(tp_rank=1, page_size=64))
    finally:
        await client.close()


def test_split_addr() -> None:
    assert split_addr("127.0.0.1:8998") == ("127.0.0.1", 8998)
    assert split_addr("[::1]:80") == ("::1", 80)
    for bad in ("nohost", "h:", ":1", "h:99999", "h:x"):
        with pytest.raises(ValueError):
            split_addr(bad)
