"""The bootstrap server (aiohttp) and its client.

Routes:

- ``PUT /route``: a prefill rank registers (JSON ``PrefillRank``); 200, or 400 with a reason.
- ``DELETE /route``: a prefill rank unregisters (``{"dp_rank", "tp_rank", "pp_rank", "agent_id"}``).
- ``GET /route``: the instance topology and every rank; 503 until every rank registered.
- ``GET /health``: 200 ``{"status": "ok", ...}`` while the server and its checks are fine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web

from ..errors import BootstrapTimeout, PeerUnreachable, RemoteProtocolError
from ..proto.auth import AUTH_HEADER, Authenticator, AuthError
from ..proto.bootstrap import PayloadError, PrefillRank, RankTable
from ..proto.topology import PrefillInstance
from .ops import add_ops_routes, safe_check, serve

__all__ = ["BootstrapClient", "BootstrapServer", "split_addr"]

log = logging.getLogger("asynckv.bootstrap")

MAX_BODY_BYTES = 1024 * 1024


def split_addr(addr: str) -> tuple[str, int]:
    """``"host:port"`` (or ``"[v6]:port"``) to ``(host, port)``; raises ValueError."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"bootstrap address must be host:port, got {addr!r}")
    return host.strip("[]"), int(port)


class BootstrapServer:
    """Where prefill ranks register and decode ranks look them up."""

    def __init__(self, host: str = "127.0.0.1", port: int = 8998, auth_token: str = "") -> None:
        self.host = host
        self.port = port
        self._auth = Authenticator(auth_token) if auth_token else None
        self.table = RankTable()
        self.requests_refused = 0
        self._health_checks: dict[str, Callable[[], bool]] = {}
        self._runner: web.AppRunner | None = None
        self._lock = asyncio.Lock()

    @property
    def addr(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def add_health_check(self, name: str, check: Callable[[], bool]) -> None:
        """``/health`` fails (503) while any registered check returns False."""
        self._health_checks[name] = check

    async def start(self) -> BootstrapServer:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_route("PUT", "/route", self._put_route)
        app.router.add_route("GET", "/route", self._get_route)
        app.router.add_route("DELETE", "/route", self._delete_route)
        app.router.add_route("GET", "/health", self._health)
        add_ops_routes(app)
        self._runner, self.port = await serve(app, self.host, self.port)
        log.info("bootstrap server listening on %s", self.addr)
        return self

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> BootstrapServer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _refuse(self, status: int, reason: str) -> web.Response:
        self.requests_refused += 1
        return web.json_response({"error": reason}, status=status)

    async def _json_body(self, request: web.Request) -> Any:
        raw = await request.read()
        if self._auth is not None:
            try:  # wall clock: freshness across hosts (see proto.auth)
                self._auth.check_http(request.method, request.path, raw, request.headers.get(AUTH_HEADER),
                                      time.time_ns())
            except AuthError as exc:
                raise _Unauthorized(str(exc)) from None
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise PayloadError(f"body is not JSON: {exc}") from None

    async def _put_route(self, request: web.Request) -> web.Response:
        try:
            rank = PrefillRank.from_json(await self._json_body(request))
            async with self._lock:
                self.table.register(rank)
        except _Unauthorized as exc:
            return self._refuse(401, str(exc))
        except PayloadError as exc:
            return self._refuse(400, str(exc))
        except web.HTTPRequestEntityTooLarge:
            return self._refuse(413, f"body larger than {MAX_BODY_BYTES} bytes")
        log.info("registered prefill rank dp=%d tp=%d pp=%d at %s (%d/%d)", rank.dp_rank, rank.tp_rank,
                 rank.pp_rank, rank.endpoint, self.table.registered, self.table.expected)
        return web.json_response({"status": "ok", "registered": self.table.registered,
                                  "expected": self.table.expected})

    async def _delete_route(self, request: web.Request) -> web.Response:
        try:
            body = await self._json_body(request)
            if not isinstance(body, dict):
                raise PayloadError("body must be a JSON object")
            key = tuple(body.get(k) for k in ("dp_rank", "tp_rank", "pp_rank"))
            agent_id = body.get("agent_id")
            if not all(type(k) is int for k in key) or not isinstance(agent_id, str):
                raise PayloadError("need integer dp_rank, tp_rank, pp_rank and a string agent_id")
        except _Unauthorized as exc:
            return self._refuse(401, str(exc))
        except PayloadError as exc:
            return self._refuse(400, str(exc))
        async with self._lock:
            removed = self.table.unregister((int(key[0]), int(key[1]), int(key[2])), agent_id)  # type: ignore[arg-type]
        return web.json_response({"status": "ok", "removed": removed})

    async def _get_route(self, request: web.Request) -> web.Response:
        if request.query:
            return self._refuse(400, f"GET /route takes no parameters, got {sorted(request.query)}")
        if not self.table.ready:
            return web.json_response({"error": f"prefill not fully registered yet "
                                               f"({self.table.registered}/{self.table.expected} ranks)"},
                                     status=503)
        return web.json_response(self.table.route())

    async def _health(self, request: web.Request) -> web.Response:
        failing = [name for name, check in self._health_checks.items() if not safe_check(check)]
        body = {"status": "ok" if not failing else "failing", "failing": failing,
                "registered": self.table.registered, "expected": self.table.expected,
                "ready": self.table.ready}
        return web.json_response(body, status=200 if not failing else 503)


class _Unauthorized(Exception):
    pass


class BootstrapClient:
    """HTTP client for the bootstrap server, with errors mapped to asynckv's tree."""

    def __init__(self, timeout_s: float = 5.0, auth_token: str = "") -> None:
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._auth = Authenticator(auth_token) if auth_token else None
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _request(self, method: str, addr: str, path: str, body: Any = None) -> tuple[int, Any]:
        url = f"http://{addr}{path}"
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self._auth is not None and method in ("PUT", "DELETE"):
            headers[AUTH_HEADER] = self._auth.http_header(method, path, data or b"", time.time_ns())
        try:
            async with self._http().request(method, url, data=data, headers=headers) as resp:
                text = await resp.text()
                try:
                    answer = json.loads(text) if text else None
                except ValueError:
                    answer = text
                return resp.status, answer
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise PeerUnreachable(f"bootstrap server {addr} unreachable: {exc!r}") from exc

    async def is_up(self, addr: str) -> bool:
        try:
            status, _ = await self._request("GET", addr, "/health")
        except PeerUnreachable:
            return False
        return status in (200, 503)

    async def register(self, addr: str, rank: PrefillRank, attempts: int = 5) -> None:
        """``PUT /route`` with exponential backoff and jitter; raises on refusal or exhaustion."""
        last: Exception | None = None
        for attempt in range(attempts):
            try:
                status, data = await self._request("PUT", addr, "/route", rank.to_json())
            except PeerUnreachable as exc:
                last = exc
            else:
                if status == 200:
                    return
                reason = data.get("error") if isinstance(data, dict) else data
                raise RemoteProtocolError(f"bootstrap server {addr} refused registration ({status}): {reason}")
            await asyncio.sleep(min(0.1 * 2**attempt, 5.0) * random.uniform(0.75, 1.0))
        raise PeerUnreachable(f"could not register with bootstrap server {addr} "
                              f"after {attempts} attempts: {last}")

    async def unregister(self, addr: str, rank: PrefillRank) -> None:
        body = {"dp_rank": rank.dp_rank, "tp_rank": rank.tp_rank, "pp_rank": rank.pp_rank,
                "agent_id": rank.agent_id}
        try:
            await self._request("DELETE", addr, "/route", body)
        except PeerUnreachable:
            log.debug("bootstrap server %s gone before unregister", addr)

    async def fetch_instance(self, addr: str, timeout_s: float) -> PrefillInstance:
        """``GET /route`` until every prefill rank registered (503 is retried) or ``timeout_s``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        delay = 0.02
        while True:
            status, data = await self._request("GET", addr, "/route")
            if status == 200:
                return PrefillInstance.from_route(data)
            if status != 503:
                raise RemoteProtocolError(f"bootstrap server {addr} answered {status} to GET /route: {data}")
            if loop.time() + delay > deadline:
                raise BootstrapTimeout(f"prefill at {addr} not ready after {timeout_s:.1f}s: {data}")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)
