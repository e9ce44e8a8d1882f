"""The bootstrap server over real HTTP on 127.0.0.1 (port 0), and what it does with hostile input."""

from __future__ import annotations

import asyncio
import gzip
import io
import json
import socket
import time
from collections.abc import AsyncIterator
from typing import Any, cast
from unittest import mock

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from asynckv import BootstrapServer, BootstrapTimeout, ClosedError, PeerUnreachable, RemoteProtocolError
from asynckv.proto.bootstrap import PrefillRank
from asynckv.service.bootstrap import STALLED_ASKS, BootstrapClient, split_addr

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
    ("PUT", "/route", {"data": b" " * (100 * 1024)}, 413, "larger than"),
    # attack 7: a RecursionError escaped as 500 (1.1 KB bodies, PUT and DELETE)
    ("PUT", "/route", {"data": b"[" * 1000 + b"]" * 1000}, 400, "nested too deeply"),
    ("DELETE", "/route", {"data": b'{"a":' * 1000 + b"1" + b"}" * 1000}, 400, "nested too deeply"),
    ("PUT", "/route", {"data": b"[" * 30000 + b"]" * 30000}, 400, "nested too deeply"),
    ("PUT", "/route", {"data": b'{"tp_size": ' + b"[" * 900 + b"]" * 900 + b"}"}, 400, ""),  # a deep value in a field
    # bounded fields (attack 1): an agent id, endpoint or dtype of any length was accepted
    ("PUT", "/route", {"json": {**rank().to_json(), "agent_id": "a" * 200}}, 400, "at most 128"),
    ("PUT", "/route", {"json": {**rank().to_json(), "kv_dtype": "x" * 10**4}}, 400, "at most 32"),
    ("PUT", "/route", {"json": {**rank().to_json(), "page_size": 10**30}}, 400, "within"),
    ("PUT", "/route", {"json": {**rank().to_json(), "lease": 7}}, 400, "lease"),
    # never decompressed: 64 KiB of gzip can hold 64 MiB
    ("PUT", "/route", {"data": gzip.compress(json.dumps(rank().to_json()).encode()),
                       "headers": {"Content-Encoding": "gzip"}}, 400, "not JSON"),
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


async def test_a_closed_client_refuses_every_request_and_renews_nothing(server: BootstrapServer) -> None:
    """A closed client raises ClosedError for any request; a renewal asked for after close (a registration
    answered just as the manager closed) starts nothing, and one under way stops (it retried for ever, found by
    review)."""
    client = BootstrapClient(2.0)
    r = PrefillRank(**{**rank().to_json(), "tp_size": 1})
    lease = await client.register(server.addr, r)
    client.keep_registered(server.addr, r, 0.03)
    renewal = next(iter(client._renewals.values()))
    await client.close()
    assert renewal.done()
    for request in (client.fetch_instance(server.addr, 1.0), client.register(server.addr, r), client.is_up(server.addr),
                    client.unregister(server.addr, r)):
        with pytest.raises(ClosedError):
            await request
    client.keep_registered(server.addr, r, max(lease, 0.03))
    assert not client._renewals
    stalled = BootstrapClient(2.0)  # a renewal task that meets a closed client stops
    stalled._closed = True
    task = asyncio.ensure_future(stalled._renew(server.addr, r, 0.03))
    await asyncio.wait_for(task, 1.0)


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


async def test_a_route_request_the_server_stalled_past_the_http_timeout_is_asked_again(server: BootstrapServer) -> None:
    """A stall is not a death: the first connection is held open unanswered (a host stalled for
    seconds failed a room in CI); the next one reaches the real server through a relay."""
    registrar = BootstrapClient(2.0)
    await registrar.register(server.addr, PrefillRank(**{**rank().to_json(), "tp_size": 1}))
    await registrar.close()
    host, port = split_addr(server.addr)
    stalled: list[asyncio.StreamWriter] = []
    opened: list[asyncio.StreamWriter] = []
    stall_all = [False]

    async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        while data := await src.read(65536):
            dst.write(data)
        dst.close()

    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        opened.append(writer)
        if not stalled or stall_all[0]:
            stalled.append(writer)  # (read nothing, answer nothing)
            return
        up_reader, up_writer = await asyncio.open_connection(host, port)
        opened.append(up_writer)
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer), return_exceptions=True)

    stalling = await asyncio.start_server(relay, "127.0.0.1", 0)
    addr = f"127.0.0.1:{stalling.sockets[0].getsockname()[1]}"
    try:
        client = BootstrapClient(0.3)
        try:
            assert (await client.fetch_instance(addr, 5.0)).tp_size == 1
            assert len(stalled) == 1  # (the first request did stall)
        finally:
            await client.close()
        stalled.clear()
        client = BootstrapClient(0.3)  # (a new one: the first kept its relayed connection alive)
        try:
            with pytest.raises(PeerUnreachable, match="TimeoutError"):  # (no time left to ask again)
                await client.fetch_instance(addr, 0.1)
            assert len(stalled) == 1
        finally:
            await client.close()
        stall_all[0] = True  # a wedged server: asked STALLED_ASKS times, then the fetch fails
        client = BootstrapClient(0.2)
        try:
            t0 = time.monotonic()
            with pytest.raises(PeerUnreachable, match="TimeoutError"):
                await client.fetch_instance(addr, 60.0)
            assert len(stalled) == 1 + STALLED_ASKS and time.monotonic() - t0 < 5
        finally:
            await client.close()
    finally:
        stalling.close()
        for w in opened:
            w.close()
        await asyncio.gather(*(w.wait_closed() for w in opened), return_exceptions=True)
        await stalling.wait_closed()


def test_split_addr() -> None:
    assert split_addr("127.0.0.1:8998") == ("127.0.0.1", 8998)
    assert split_addr("[::1]:80") == ("::1", 80)
    for bad in ("nohost", "h:", ":1", "h:99999", "h:x"):
        with pytest.raises(ValueError):
            split_addr(bad)


async def test_a_hostile_first_put_with_a_huge_instance_is_refused_and_the_real_rank_registers(
        server: BootstrapServer, http: aiohttp.ClientSession) -> None:
    """Attack 1: ``tp_size=10**12`` as the first registration made the table accept any number of
    ranks (3,000 in 0.9 s) and refuse the real prefill with 400."""
    for sizes, needle in (({"tp_size": 10**12}, "within"), ({"tp_size": 5000}, "at most 4096"),
                          ({"tp_size": 64, "dp_size": 65}, "at most 4096")):
        status, body = await call(http, server, "PUT", "/route",
                                  json={**rank().to_json(), "agent_id": "hostile", **sizes})
        assert status == 400 and needle in body["error"], body
    assert server.table.registered == 0
    assert (await call(http, server, "PUT", "/route", json={**rank().to_json(), "tp_size": 1}))[0] == 200
    status, body = await call(http, server, "GET", "/route")
    assert status == 200 and [r["agent_id"] for r in body["ranks"]] == ["a"]


async def raw(srv: BootstrapServer) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = split_addr(srv.addr)
    return await asyncio.open_connection(host, port)


async def closed_after(reader: asyncio.StreamReader, limit: float = 5.0) -> tuple[float, bytes]:
    """Read until the server closes; returns the seconds it took and what was received."""
    t = time.monotonic()

    async def read_all() -> bytes:
        data = b""
        while chunk := await reader.read(4096):
            data += chunk
        return data

    data = await asyncio.wait_for(read_all(), limit)
    return time.monotonic() - t, data


async def test_a_connection_whose_headers_never_complete_is_closed_within_the_header_timeout() -> None:
    """Attack 6: a partial-header connection stayed open for more than 45 s (aiohttp's default keep-alive
    timer is an hour). Trickling bytes does not extend it."""
    from asynckv.service.ops import HttpLimits

    async with BootstrapServer("127.0.0.1", 0, limits=HttpLimits(header_timeout_s=0.4)) as srv:
        silent_r, silent_w = await raw(srv)
        silent_w.write(b"PUT /route HTTP/1.1\r\nHost: x\r\nContent-Len")
        trickle_r, trickle_w = await raw(srv)

        async def trickle() -> None:
            for byte in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100:
                trickle_w.write(bytes([byte]))
                await asyncio.sleep(0.05)

        feeding = asyncio.create_task(trickle())
        (silent_s, silent_data), (trickle_s, trickle_data) = await asyncio.gather(
            closed_after(silent_r), closed_after(trickle_r))
        feeding.cancel()
        assert silent_data == trickle_data == b""
        assert 0.3 < silent_s < 1.4 and trickle_s < 1.4, (silent_s, trickle_s)
        for w in (silent_w, trickle_w):
            w.close()


async def test_a_body_that_never_completes_gets_408_within_the_body_timeout() -> None:
    from asynckv.service.ops import HttpLimits

    async with BootstrapServer("127.0.0.1", 0, limits=HttpLimits(body_timeout_s=0.3)) as srv:
        reader, writer = await raw(srv)
        writer.write(b"PUT /route HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"tp_size\": ")
        took, data = await closed_after(reader)
        assert data.startswith(b"HTTP/1.1 408") and b"body not received within 0.3s" in data, data
        assert took < 2.5, took  # 0.3 s, then at most 1 s draining the rest of the body
        assert srv.requests_refused == 1
        writer.close()


async def test_idle_connections_beyond_the_cap_do_not_stop_health_or_registration(
        http: aiohttp.ClientSession) -> None:
    """Attack 6: 1,100 idle connections against a 1,024-fd limit starved the process (wait_ready timed
    out, UCX could not create a worker). The cap closes the oldest connection to admit a new one."""
    from asynckv.service.ops import HttpLimits

    async with BootstrapServer("127.0.0.1", 0, limits=HttpLimits(max_connections=8)) as srv:
        held = [await raw(srv) for _ in range(40)]
        for _, w in held[::4]:
            w.write(b"GET /health HTTP/1.1\r\nHost")  # some half-sent, the rest silent
        await asyncio.sleep(0.05)
        assert (await call(http, srv, "GET", "/health"))[0] == 200
        assert (await call(http, srv, "PUT", "/route", json={**rank().to_json(), "tp_size": 1}))[0] == 200
        assert (await call(http, srv, "GET", "/route"))[0] == 200
        assert srv.http is not None and srv.http.open_connections <= 8 and srv.http.evicted >= 32
        for _, w in held:
            w.close()


def routable_ip() -> str | None:
    """This host's address on its default route (no packet is sent), or None if it has only loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("198.51.100.1", 9))  # TEST-NET-2: takes the default route
            ip = str(s.getsockname()[0])
        except OSError:
            return None
    return None if ip.startswith("127.") or ip == "0.0.0.0" else ip


async def test_protected_mode_answers_403_with_the_reason_to_a_mocked_remote() -> None:
    from asynckv.proto.auth import PROTECTED_MODE_REASON

    async with BootstrapServer("127.0.0.1", 0) as srv:
        assert srv.http is not None
        app = srv.http.app
        for remote, path, expected in (("10.1.2.3", "/route", 403), ("10.1.2.3", "/peers", 403),
                                       ("10.1.2.3", "/health", 200), ("10.1.2.3", "/metrics", 200),
                                       ("127.0.0.1", "/route", 503), ("::1", "/route", 503),
                                       ("::ffff:127.0.0.1", "/route", 503), ("::ffff:10.1.2.3", "/route", 403)):
            transport = mock.Mock()
            transport.get_extra_info.return_value = (remote, 4242)
            resp = cast(web.Response, await app._handle(make_mocked_request("GET", path, app=app, transport=transport)))
            assert resp.status == expected, (remote, path, resp.status)
            if expected == 403:
                assert resp.text is not None and PROTECTED_MODE_REASON.split(":")[0] in resp.text


async def test_protected_mode_refuses_a_non_loopback_client_and_the_client_fails_at_once() -> None:
    from asynckv.proto.auth import PROTECTED_MODE_REASON
    from asynckv.service.ops import OpsServer

    ip = routable_ip()
    if ip is None:
        pytest.skip("no non-loopback address on this host")
    r = PrefillRank(**{**rank().to_json(), "tp_size": 1})
    client = BootstrapClient(2.0)
    try:
        async with BootstrapServer(ip, 0) as srv, aiohttp.ClientSession() as http:
            for method, path in (("GET", "/route"), ("PUT", "/route"), ("DELETE", "/route"), ("GET", "/peers")):
                status, body = await call(http, srv, method, path)
                assert status == 403 and body == {"error": PROTECTED_MODE_REASON}, (method, path)
            assert (await call(http, srv, "GET", "/health"))[0] == 200
            async with http.get(f"http://{srv.addr}/metrics") as resp:
                assert resp.status == 200
            t = time.monotonic()
            with pytest.raises(RemoteProtocolError, match=r"\(403\): asynckv protected mode"):
                await client.register(srv.addr, r)
            with pytest.raises(RemoteProtocolError, match="403 to GET /route: asynckv protected mode"):
                await client.fetch_instance(srv.addr, 10.0)
            assert time.monotonic() - t < 1.0 and srv.table.registered == 0  # no retry loop
        async with BootstrapServer(ip, 0, allow_unauthenticated=True) as srv:
            await client.register(srv.addr, r)
            assert (await client.fetch_instance(srv.addr, 1.0)).tp_size == 1
        async with BootstrapServer(ip, 0, auth_token="t") as srv, aiohttp.ClientSession() as http:
            assert (await call(http, srv, "GET", "/route"))[0] == 503  # reads stay open with a token
            assert (await call(http, srv, "PUT", "/route", json=r.to_json()))[0] == 401
        for kw, peers in (({}, 403), ({"allow_unauthenticated": True}, 200), ({"auth_token": "t"}, 200)):
            ops = await OpsServer(ip, 0, lambda: True, **kw).start()
            try:
                async with aiohttp.ClientSession() as http:
                    for path, expected in (("/peers", peers), ("/health", 200), ("/metrics", 200)):
                        async with http.get(f"http://{ops.addr}{path}") as resp:
                            assert resp.status == expected, (kw, path)
            finally:
                await ops.close()
    finally:
        await client.close()


async def test_register_retries_a_409_until_the_crashed_holders_lease_lapses() -> None:
    """Attack 8's other side: a restarted prefill must still get its rank once the crashed one's lease lapsed."""
    async with BootstrapServer("127.0.0.1", 0, route_lease_s=0.5) as srv:
        crashed, restarted = BootstrapClient(2.0), BootstrapClient(2.0)
        try:
            await crashed.register(srv.addr, rank(tp_size=1, agent_id="crashed"))
            await crashed.close()  # no DELETE: as if killed
            t = time.monotonic()
            assert await restarted.register(srv.addr, rank(tp_size=1, agent_id="restarted")) == 0.5
            assert 0.3 < time.monotonic() - t < 2.0
            assert srv.table.route()["ranks"][0]["agent_id"] == "restarted"
        finally:
            await restarted.close()


async def test_a_live_holder_keeps_its_rank_and_the_other_registration_fails_with_the_reason() -> None:
    async with BootstrapServer("127.0.0.1", 0, route_lease_s=0.4) as srv:
        holder, other = BootstrapClient(2.0), BootstrapClient(2.0)
        try:
            mine = rank(tp_size=1, agent_id="8e8e95d2-holder")
            holder.keep_registered(srv.addr, mine, await holder.register(srv.addr, mine))
            t = time.monotonic()
            with pytest.raises(RemoteProtocolError, match=r"\(409\).*dp=0 tp=0 pp=0 is held by live agent 8e8e95d2"):
                await other.register(srv.addr, rank(tp_size=1, agent_id="impostor"))
            assert 0.4 + 1.5 < time.monotonic() - t < 0.4 + 4.0  # the lease plus the 2 s margin
            await holder.unregister(srv.addr, mine)  # stops renewing, then removes the entry
            await asyncio.sleep(0.5)
            assert srv.table.registered == 0
        finally:
            await holder.close()
            await other.close()


async def test_a_renewal_recreates_the_entry_a_restarted_server_lost() -> None:
    client = BootstrapClient(2.0)
    try:
        async with BootstrapServer("127.0.0.1", 0, route_lease_s=0.3) as first:
            port, mine = first.port, rank(tp_size=1)
            client.keep_registered(first.addr, mine, await client.register(first.addr, mine))
        async with BootstrapServer("127.0.0.1", port, route_lease_s=0.3) as second:
            for _ in range(100):
                if second.table.ready:
                    break
                await asyncio.sleep(0.02)
            assert second.table.route()["ranks"][0]["agent_id"] == "a"
    finally:
        await client.close()
