"""The bootstrap server (aiohttp) and its client.

Routes:

- ``PUT /route``: a prefill rank registers or renews (JSON ``PrefillRank`` plus its secret
  ``lease`` key); 200 with the lease length, 400 with a reason, 409 while another live
  agent holds the rank.
- ``DELETE /route``: a prefill rank unregisters (``{"dp_rank", "tp_rank", "pp_rank", "agent_id", "lease"}``).
- ``GET /route``: the instance topology and every rank; 503 until every rank registered.
- ``GET /health``: 200 ``{"status": "ok", ...}`` while the server and its checks are fine.

Hostile input gets a 4xx with a reason, never a 5xx: bodies are bounded in size and time,
connections in number and in how long their headers may take (``HttpLimits``). Without a
token or ``allow_unauthenticated`` (protected mode) only loopback clients reach ``/route``
and ``/peers``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import secrets
import time
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web

from ..errors import BootstrapTimeout, ClosedError, PeerUnreachable, RemoteProtocolError
from ..proto.auth import AUTH_HEADER, Authenticator, AuthError
from ..proto.bootstrap import PayloadError, PrefillRank, RankTable, RouteConflict, lease_key
from ..proto.topology import PrefillInstance
from .ops import HttpLimits, HttpRefused, HttpService, add_ops_routes, loopback_only, read_json, safe_check, serve

__all__ = ["BootstrapClient", "BootstrapServer", "split_addr"]

log = logging.getLogger("asynckv.bootstrap")

MAX_BODY_BYTES = 64 * 1024
"""A registration is under 1 KiB; 64 KiB at most per body keeps max_connections bodies small."""
CONFLICT_MARGIN_S = 2.0
"""A registration refused with 409 is retried for the holder's lease plus this."""


def split_addr(addr: str) -> tuple[str, int]:
    """``"host:port"`` (or ``"[v6]:port"``) to ``(host, port)``; raises ValueError."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"bootstrap address must be host:port, got {addr!r}")
    return host.strip("[]"), int(port)



class BootstrapServer:
    """Where prefill ranks register and decode ranks look them up.

    ``max_ranks`` bounds tp_size*pp_size*dp_size of the instance; ``route_lease_s`` is how long
    an entry stays irreplaceable without a renewal (registered managers renew every third of it)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 8998, auth_token: str = "", *,
                 allow_unauthenticated: bool = False, max_ranks: int = 4096, route_lease_s: float = 10.0,
                 limits: HttpLimits | None = None) -> None:
        self.host = host
        self.port = port
        self._auth = Authenticator(auth_token) if auth_token else None
        self.protected = not auth_token and not allow_unauthenticated
        self.limits = limits or HttpLimits()
        self.table = RankTable(max_ranks, route_lease_s)
        self.requests_refused = 0
        self._health_checks: dict[str, Callable[[], bool]] = {}
        self._http: HttpService | None = None
        self._lock = asyncio.Lock()

    @property
    def addr(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def http(self) -> HttpService | None:
        """The running HTTP service (open connections, evictions), None when stopped."""
        return self._http

    def add_health_check(self, name: str, check: Callable[[], bool]) -> None:
        """``/health`` fails (503) while any registered check returns False."""
        self._health_checks[name] = check

    async def start(self) -> BootstrapServer:
        guard = [loopback_only(on_refused=self._count_refused)] if self.protected else []
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=guard)
        app.router.add_route("PUT", "/route", self._put_route)
        app.router.add_route("GET", "/route", self._get_route)
        app.router.add_route("DELETE", "/route", self._delete_route)
        app.router.add_route("GET", "/health", self._health)
        add_ops_routes(app)
        self._http = await serve(app, self.host, self.port, self.limits)
        self.port = self._http.port
        log.info("bootstrap server listening on %s%s", self.addr,
                 " (protected mode: /route and /peers for loopback clients only)" if self.protected else "")
        return self

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None

    async def __aenter__(self) -> BootstrapServer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _count_refused(self) -> None:
        self.requests_refused += 1

    def _refuse(self, status: int, reason: str, **extra: Any) -> web.Response:
        self.requests_refused += 1
        return web.json_response({"error": reason, **extra}, status=status)

    async def _json_body(self, request: web.Request) -> Any:
        """The authenticated, decoded body; raises ``HttpRefused`` with the status and reason."""
        return await read_json(request, self.limits, MAX_BODY_BYTES,
                               None if self._auth is None else lambda raw: self._authenticate(request, raw))

    def _authenticate(self, request: web.Request, raw: bytes) -> None:
        auth = self._auth
        if auth is None:
            return
        try:  # wall clock: freshness across hosts (see proto.auth)
            auth.check_http(request.method, request.path, raw, request.headers.get(AUTH_HEADER), time.time_ns())
        except AuthError as exc:
            raise HttpRefused(401, str(exc)) from None
        except Exception as exc:  # a header that cannot even be checked (a time beyond 64 bits) proves nothing
            raise HttpRefused(401, f"unauthenticated (malformed): {AUTH_HEADER} cannot be checked: {exc}") from None

    async def _put_route(self, request: web.Request) -> web.Response:
        try:
            body = await self._json_body(request)
            rank, key = PrefillRank.from_json(body), lease_key(body)
            async with self._lock:  # every request that got here was authenticated, if there is a token
                changed = self.table.register(rank, time.monotonic(), key=key, authenticated=self._auth is not None)
        except HttpRefused as exc:
            return self._refuse(exc.status, str(exc))
        except PayloadError as exc:
            return self._refuse(400, str(exc))
        except RouteConflict as exc:
            return self._refuse(409, str(exc), retry_after_s=round(exc.retry_after_s, 3),
                                lease_s=self.table.lease_s)
        (log.info if changed else log.debug)(
            "%s prefill rank %s agent %s at %s (%d/%d)", "registered" if changed else "renewed", rank.label,
            rank.agent_id[:8], rank.endpoint, self.table.registered, self.table.expected)
        return web.json_response({"status": "ok", "registered": self.table.registered,
                                  "expected": self.table.expected, "lease_s": self.table.lease_s})

    async def _delete_route(self, request: web.Request) -> web.Response:
        try:
            body = await self._json_body(request)
            if not isinstance(body, dict):
                raise PayloadError("body must be a JSON object")
            key = tuple(body.get(k) for k in ("dp_rank", "tp_rank", "pp_rank"))
            agent_id = body.get("agent_id")
            if not all(type(k) is int for k in key) or not isinstance(agent_id, str):
                raise PayloadError("need integer dp_rank, tp_rank, pp_rank and a string agent_id")
            lease = lease_key(body)
        except HttpRefused as exc:
            return self._refuse(exc.status, str(exc))
        except PayloadError as exc:
            return self._refuse(400, str(exc))
        async with self._lock:
            removed = self.table.unregister((int(key[0]), int(key[1]), int(key[2])), agent_id, lease,  # type: ignore[arg-type]
                                            authenticated=self._auth is not None)
        return web.json_response({"status": "ok", "removed": removed})

    async def _get_route(self, request: web.Request) -> web.Response:
        if request.query:
            return self._refuse(400, f"GET /route takes no parameters, got {len(request.query)}")
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


def _reason(data: Any) -> str:
    """The server's reason, bounded (the server may be hostile too)."""
    reason = data.get("error") if isinstance(data, dict) else data
    return str(reason)[:1000]


def _lease_s(data: Any) -> float:
    """The lease the server granted (0: none, an older server); capped so a server cannot make us wait long."""
    value = data.get("lease_s") if isinstance(data, dict) else None
    if not isinstance(value, (int, float)) or not value > 0:
        return 0.0
    return min(float(value), 600.0)


STALLED_ASKS = 3
"""``GET /route`` requests that timed out before a fetch gives up (see ``fetch_instance``)."""


def _backoff(attempt: int, cap: float) -> float:
    return min(0.1 * 2.0**attempt, cap) * random.uniform(0.75, 1.0)


class BootstrapClient:
    """HTTP client for the bootstrap server, with errors mapped to asynckv's tree.

    Its registrations carry one secret lease key (never shown by ``GET /route``) that proves
    ownership when they are renewed or removed."""

    def __init__(self, timeout_s: float = 5.0, auth_token: str = "") -> None:
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._auth = Authenticator(auth_token) if auth_token else None
        self._session: aiohttp.ClientSession | None = None
        self._lease = secrets.token_hex(16)
        self._renewals: dict[tuple[str, tuple[int, int, int]], asyncio.Task[None]] = {}
        self._closed = False
        """Closed: every request raises ``ClosedError`` (a look-up under way, retrying 503s, stops)."""

    def _http(self) -> aiohttp.ClientSession:
        if self._closed:
            raise ClosedError("the bootstrap client is closed")
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        return self._session

    async def close(self) -> None:
        self._closed = True
        for task in self._renewals.values():
            task.cancel()
        await asyncio.gather(*self._renewals.values(), return_exceptions=True)
        self._renewals.clear()
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
                except (ValueError, RecursionError):
                    answer = text
                return resp.status, answer
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:  # (not TimeoutError before 3.11)
            if self._closed:  # (close() cut it)
                raise ClosedError(f"the bootstrap client closed during {method} {path} at {addr}") from exc
            raise PeerUnreachable(f"bootstrap server {addr} unreachable: {exc!r}") from exc

    async def _put_rank(self, addr: str, rank: PrefillRank) -> tuple[int, Any]:
        return await self._request("PUT", addr, "/route", {**rank.to_json(), "lease": self._lease})

    async def is_up(self, addr: str) -> bool:
        try:
            status, _ = await self._request("GET", addr, "/health")
        except PeerUnreachable:
            return False
        return status in (200, 503)

    async def register(self, addr: str, rank: PrefillRank, attempts: int = 5) -> float:
        """``PUT /route``; returns the lease the server granted in seconds (0: none to renew).

        An unreachable server is retried ``attempts`` times with exponential backoff and jitter. A rank
        held by another live agent (409: a crashed predecessor whose lease has not lapsed yet) is retried
        for that lease plus a margin. Any other refusal (400, 401, 403) raises at once with the reason."""
        loop = asyncio.get_running_loop()
        unreachable, conflicts, give_up_at = 0, 0, 0.0
        while True:
            try:
                status, data = await self._put_rank(addr, rank)
            except PeerUnreachable as exc:
                unreachable += 1
                if unreachable >= attempts:
                    raise PeerUnreachable(f"could not register with bootstrap server {addr} "
                                          f"after {attempts} attempts: {exc}") from exc
                await asyncio.sleep(_backoff(unreachable - 1, 5.0))
                continue
            if status == 200:
                return _lease_s(data)
            if status != 409:
                raise RemoteProtocolError(f"bootstrap server {addr} refused registration ({status}): {_reason(data)}")
            now = loop.time()
            if not conflicts:
                give_up_at = now + (_lease_s(data) or 10.0) + CONFLICT_MARGIN_S
                log.info("prefill rank %s: %s; retrying until it lapses", rank.label, _reason(data))
            if now >= give_up_at:
                raise RemoteProtocolError(f"bootstrap server {addr} refused registration (409) for "
                                          f"{conflicts} attempts: {_reason(data)}")
            await asyncio.sleep(min(_backoff(conflicts, 1.0), give_up_at - now))
            conflicts += 1

    def keep_registered(self, addr: str, rank: PrefillRank, lease_s: float) -> None:
        """Renew ``rank`` every third of ``lease_s`` until ``unregister`` or ``close`` (a renewal also
        re-creates the entry if the bootstrap server restarted and lost it)."""
        if lease_s <= 0 or self._closed:  # (closed while the registration was answered: nothing to renew)
            return
        old = self._renewals.pop((addr, rank.key), None)
        if old is not None:
            old.cancel()
        self._renewals[(addr, rank.key)] = asyncio.get_running_loop().create_task(
            self._renew(addr, rank, lease_s), name=f"asynckv-route-renewal-{rank.label}")

    async def _renew(self, addr: str, rank: PrefillRank, lease_s: float) -> None:
        problem = ""
        while True:
            await asyncio.sleep(lease_s / 3)
            try:
                status, data = await self._put_rank(addr, rank)
            except ClosedError:
                return
            except Exception as exc:  # unreachable (or a bug): keep trying, the lease is what is at stake
                status, data = 0, repr(exc)
            if status == 200:
                lease_s = _lease_s(data) or lease_s
                if problem:
                    log.info("prefill rank %s: route at %s renewed again", rank.label, addr)
                problem = ""
            elif not problem:
                problem = f"({status}) {_reason(data)}" if status else _reason(data)
                log.warning("prefill rank %s: renewing its route at %s failed: %s; decode ranks may not find "
                            "it once its %.1fs lease lapses (retrying every %.1fs)", rank.label, addr, problem,
                            lease_s, lease_s / 3)

    async def unregister(self, addr: str, rank: PrefillRank) -> None:
        """Stop renewing ``rank``, then remove it (``DELETE /route`` with its lease key)."""
        task = self._renewals.pop((addr, rank.key), None)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        body = {"dp_rank": rank.dp_rank, "tp_rank": rank.tp_rank, "pp_rank": rank.pp_rank,
                "agent_id": rank.agent_id, "lease": self._lease}
        try:
            await self._request("DELETE", addr, "/route", body)
        except PeerUnreachable:
            log.debug("bootstrap server %s gone before unregister", addr)

    async def fetch_instance(self, addr: str, timeout_s: float) -> PrefillInstance:
        """``GET /route`` until every prefill rank registered (503 is retried) or ``timeout_s``;
        any other refusal (403 in protected mode) raises at once with the server's reason. A request
        that timed out (a server that stalled, or a host that never accepted the connection) is made
        ``STALLED_ASKS`` times in all while ``timeout_s`` lasts (a host stalled for seconds failed a
        room in CI; a wedged one still fails within a few HTTP timeouts); a refused connection, or one
        closed before an answer, raises at once."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        delay, stalled = 0.02, 0
        while True:
            try:
                status, data = await self._request("GET", addr, "/route")
            except PeerUnreachable as exc:
                stalled += 1
                if not isinstance(exc.__cause__, asyncio.TimeoutError) or stalled >= STALLED_ASKS \
                        or loop.time() + delay > deadline:
                    raise
                log.info("GET /route at %s: %s; asking again", addr, exc)
                await asyncio.sleep(delay)
                continue
            if status == 200:
                return PrefillInstance.from_route(data)
            if status != 503:
                raise RemoteProtocolError(f"bootstrap server {addr} answered {status} to GET /route: {_reason(data)}")
            if loop.time() + delay > deadline:
                raise BootstrapTimeout(f"prefill at {addr} not ready after {timeout_s:.1f}s: {_reason(data)}")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)
