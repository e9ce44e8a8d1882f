"""The operator's HTTP routes: ``/metrics`` (Prometheus), ``/peers`` (JSON) and ``/health``.

Served by the bootstrap server and, for a manager that hosts none, by its own
``OpsServer``. Everything here reads ``KVManager.snapshot()``: plain JSON types only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from . import metrics

__all__ = ["OpsServer", "add_ops_routes", "peers_view", "serve"]


def peers_view() -> list[dict[str, Any]]:
    """Every live manager's known peers (the ``/peers`` JSON)."""
    out = []
    for mgr in metrics.managers():
        snap = mgr.snapshot()
        for peer in snap["peers"]:
            ago = peer["last_heard_s_ago"]
            out.append({"manager": mgr.name, "mode": snap["mode"], "peer": peer["peer"],  # the incarnation
                        "endpoint": peer["endpoint"], "session": peer["session"], "phase": peer["phase"],
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


async def serve(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Start ``app`` on host:port (0: any free port); returns the runner and the bound port."""
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port, reuse_address=True).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, int(runner.addresses[0][1])


def safe_check(check: Callable[[], bool]) -> bool:
    try:
        return bool(check())
    except Exception:
        return False


class OpsServer:
    """``/health``, ``/metrics`` and ``/peers`` of a manager that hosts no bootstrap server."""

    def __init__(self, host: str, port: int, healthy: Callable[[], bool]) -> None:
        self.host = host
        self.port = port
        self._healthy = healthy
        self._runner: web.AppRunner | None = None

    async def start(self) -> OpsServer:
        app = web.Application()
        app.router.add_route("GET", "/health", self._health)
        add_ops_routes(app)
        self._runner, self.port = await serve(app, self.host, self.port)
        return self

    @property
    def addr(self) -> str:
        return f"{self.host}:{self.port}"

    async def _health(self, request: web.Request) -> web.Response:
        ok = safe_check(self._healthy)
        return web.json_response({"status": "ok" if ok else "failing"}, status=200 if ok else 503)

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
