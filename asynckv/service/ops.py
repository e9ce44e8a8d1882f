"""The operator's HTTP routes: ``/metrics`` (Prometheus), ``/peers`` (JSON) and ``/health``,
and ``serve``, which every asynckv HTTP server starts through.

Served by the bootstrap server and, for a manager that hosts none, by its own
``OpsServer``. Everything here reads ``KVManager.snapshot()``: plain JSON types only.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import Callable, Collection
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..proto.auth import PROTECTED_MODE_REASON, is_loopback
from . import metrics

__all__ = ["HttpLimits", "HttpRefused", "HttpService", "OpsServer", "add_ops_routes", "loopback_only", "peers_view",
           "read_json", "serve"]

OPEN_PATHS = frozenset({"/health", "/metrics"})
"""Paths anyone may read in protected mode; every other path is loopback only."""


@dataclasses.dataclass(frozen=True, slots=True)
class HttpLimits:
    """What one client may hold of an HTTP server (aiohttp bounds none of it by default)."""

    max_connections: int = 256
    """Open connections at most; the oldest is closed to admit a new one (an fd limit of 1,024
    is shared with ZMQ and UCX: idle connections must not starve them)."""
    header_timeout_s: float = 10.0
    """A connection must complete each request's headers this soon after it opened or after its
    last answer, else it is closed: aiohttp's keep-alive timer, which (3.14) starts at accept and
    is not pushed back by bytes that trickle in (tested)."""
    body_timeout_s: float = 10.0
    """A request body must arrive this soon once its headers did, else 408."""
    max_line_size: int = 4096
    max_field_size: int = 4096
    max_headers: int = 32
    lingering_s: float = 1.0
    """How long the rest of an unread body is drained before the connection is closed."""

    def __post_init__(self) -> None:
        if self.max_connections < 1 or not (self.header_timeout_s > 0 and self.body_timeout_s > 0):
            raise ValueError(f"bad HTTP limits: {self}")


class HttpRefused(Exception):
    """A request refused with ``status`` and a reason (the servers answer it as they answer errors)."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status


async def read_json(request: web.Request, limits: HttpLimits, max_bytes: int,
                    check: Callable[[bytes], None] | None = None) -> Any:
    """A request's JSON body, within the limits; raises ``HttpRefused``: 408 when it does not arrive
    in time (aiohttp waits as long as the client keeps the connection open), 413 when too large,
    400 when not JSON (nesting too deep included: a RecursionError was a 500). ``check`` sees the
    raw body first (authentication) and raises ``HttpRefused`` itself."""
    try:
        raw = await asyncio.wait_for(request.read(), limits.body_timeout_s)
    except asyncio.TimeoutError:
        raise HttpRefused(408, f"body not received within {limits.body_timeout_s:g}s") from None
    except web.HTTPRequestEntityTooLarge:
        raise HttpRefused(413, f"body larger than {max_bytes} bytes") from None
    if check is not None:
        check(raw)
    try:
        return json.loads(raw)
    except RecursionError:
        raise HttpRefused(400, "body is not JSON: nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise HttpRefused(400, f"body is not JSON: {exc}") from None


def peers_view() -> list[dict[str, Any]]:
    """Every live manager's known peers (the ``/peers`` JSON)."""
    out = []
    for mgr in metrics.managers():
        snap = mgr.snapshot()
        for peer in snap["peers"]:
            ago = peer["last_heard_s_ago"]
            # Names as the metrics show them, 8 characters: a decode's full agent name and its sessions
            # are what lets a process act as that decode towards a prefill, so they are never shown.
            out.append({"manager": mgr.name[:8], "mode": snap["mode"], "peer": peer["peer"][:8],
                        "endpoint": peer["endpoint"], "phase": peer["phase"],
                        "state": "alive" if peer["alive"] else "late",
                        "last_heartbeat_s_ago": None if ago is None else round(max(0.0, ago), 3),
                        "inflight_rooms": peer["rooms"]})
    return out


async def _metrics(request: web.Request) -> web.Response:
    body = generate_latest(metrics.REGISTRY)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _peers(request: web.Request) -> web.Response:
    return web.json_response({"peers": peers_view()})


def add_ops_routes(app: web.Application) -> None:
    """``GET /metrics`` (Prometheus text) and ``GET /peers`` (JSON)."""
    app.router.add_route("GET", "/metrics", _metrics)
    app.router.add_route("GET", "/peers", _peers)


def loopback_only(open_paths: Collection[str] = OPEN_PATHS,
                  on_refused: Callable[[], None] | None = None) -> Middleware:
    """Protected mode: every path but ``open_paths`` answers 403 with the reason to a non-loopback client."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in open_paths or is_loopback(request.remote or ""):
            return await handler(request)
        if on_refused is not None:
            on_refused()
        return web.json_response({"error": PROTECTED_MODE_REASON}, status=403)

    return middleware


class _Quiet(logging.Filter):
    """aiohttp logs every malformed request at ERROR with a traceback: a hostile client could fill
    the disk. Passes ``burst`` records per ``period_s``, one line each, and counts the rest."""

    def __init__(self, period_s: float = 10.0, burst: int = 5) -> None:
        super().__init__()
        self._period, self._burst = period_s, burst
        self._start, self._count = 0.0, 0
        self.suppressed = 0

    def filter(self, record: logging.LogRecord) -> bool:
        now = time.monotonic()
        if now - self._start > self._period:
            self._start, self._count = now, 0
        self._count += 1
        if self._count > self._burst:
            self.suppressed += 1
            return False
        if record.exc_info and record.exc_info[1] is not None:
            record.msg, record.args = f"{record.getMessage()}: {record.exc_info[1]!r}", ()
            record.exc_info, record.exc_text = None, None
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


http_log = logging.getLogger("asynckv.http")
http_log.addFilter(_Quiet())


class HttpService:
    """A started aiohttp app: the runner, the listening socket and the connection cap."""

    def __init__(self, runner: web.AppRunner, limits: HttpLimits) -> None:
        if runner.server is None:
            raise RuntimeError("the app runner is not set up")
        self._runner = runner
        self._server = runner.server
        self._limits = limits
        self._listener: asyncio.AbstractServer | None = None
        self.port = 0
        self.evicted = 0
        """Connections closed to admit a newer one (the cap was reached)."""

    @property
    def app(self) -> web.Application:
        return self._runner.app

    @property
    def open_connections(self) -> int:
        return sum(1 for h in self._server.connections if h.transport is not None)

    def _accept(self) -> asyncio.BaseProtocol:
        """Protocol factory: over the cap, close the oldest open connection first. An attacker's idle
        or half-sent connections are older than a real client's fresh one, so real requests get in
        (closing the newest instead would lock every new client out until the old ones time out)."""
        server = self._server
        # Connections accepted in this loop iteration are not listed until their connection_made:
        # a burst may exceed the cap by asyncio's accept batch (the backlog) until the next accept.
        live = [h for h in server.connections if h.transport is not None]
        for handler in live[:max(0, len(live) - self._limits.max_connections + 1)]:
            handler.force_close()
            self.evicted += 1
        return server()

    async def start(self, host: str, port: int) -> HttpService:
        loop = asyncio.get_running_loop()
        self._listener = await loop.create_server(self._accept, host, port, reuse_address=True)
        self.port = int(self._listener.sockets[0].getsockname()[1])
        return self

    async def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        await self._runner.cleanup()


async def serve(app: web.Application, host: str, port: int, limits: HttpLimits | None = None) -> HttpService:
    """Start ``app`` on host:port (0: any free port) within ``limits``."""
    limits = limits or HttpLimits()
    runner = web.AppRunner(app, access_log=None, handle_signals=False, handler_cancellation=True,
                           keepalive_timeout=limits.header_timeout_s, max_line_size=limits.max_line_size,
                           max_field_size=limits.max_field_size, max_headers=limits.max_headers,
                           lingering_time=limits.lingering_s, logger=http_log, shutdown_timeout=1.0,
                           auto_decompress=False)  # no client of ours compresses; a 64 KiB gzip bomb is 64 MiB
    await runner.setup()
    service = HttpService(runner, limits)
    try:
        return await service.start(host, port)
    except BaseException:
        await runner.cleanup()
        raise


def safe_check(check: Callable[[], bool]) -> bool:
    try:
        return bool(check())
    except Exception:
        return False


class OpsServer:
    """``/health``, ``/metrics`` and ``/peers`` of a manager that hosts no bootstrap server.

    Without ``auth_token`` and ``allow_unauthenticated`` (protected mode) ``/peers`` answers
    loopback clients only; ``/health`` and ``/metrics`` stay open."""

    def __init__(self, host: str, port: int, healthy: Callable[[], bool], *, auth_token: str = "",
                 allow_unauthenticated: bool = False, limits: HttpLimits | None = None) -> None:
        self.host = host
        self.port = port
        self._healthy = healthy
        self._protected = not auth_token and not allow_unauthenticated
        self._limits = limits or HttpLimits()
        self._http: HttpService | None = None

    async def start(self) -> OpsServer:
        app = web.Application(middlewares=[loopback_only()] if self._protected else [])
        app.router.add_route("GET", "/health", self._health)
        add_ops_routes(app)
        self._http = await serve(app, self.host, self.port, self._limits)
        self.port = self._http.port
        return self

    @property
    def addr(self) -> str:
        return f"{self.host}:{self.port}"

    async def _health(self, request: web.Request) -> web.Response:
        ok = safe_check(self._healthy)
        return web.json_response({"status": "ok" if ok else "failing"}, status=200 if ok else 503)

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None
