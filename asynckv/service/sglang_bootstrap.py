"""A bootstrap server that speaks SGLang 0.5.10's HTTP API, so stock SGLang prefill and decode
ranks (and asynckv ranks on the SGLang wire) can meet at it. The table is
``asynckv.proto.sglang_bootstrap``; this is its aiohttp face, with the same limits and protected
mode as asynckv's own server (SGLang ranks cannot authenticate: across hosts it needs
``allow_unauthenticated``).

Routes, answers as SGLang's server gives them (plain text where it answers text):

- ``PUT /route``: a prefill rank registers (its JSON); 200 ``OK``, 400 with the reason;
- ``GET /route?prefill_dp_rank=&prefill_cp_rank=&target_tp_rank=&target_pp_rank=``: all -1: the
  topology (503 ``Prefill server not fully registered yet (N workers registered).`` until every
  rank did); else ``{"rank_ip", "rank_port"}`` of that rank, or 404; 400 when a parameter is
  missing; other methods on ``/route``: 405;
- ``POST /register_dp_rank`` and ``POST /query_dp_ranks``: room → DP-rank routing;
- ``GET /health``: 200 ``OK`` (SGLang's decode heartbeat).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from aiohttp import web

from ..proto.bootstrap import PayloadError
from ..proto.sglang_bootstrap import SglangRouteTable
from .ops import HttpLimits, HttpRefused, HttpService, loopback_only, read_json, serve

__all__ = ["SglangBootstrapServer"]

log = logging.getLogger("asynckv.bootstrap")

MAX_BODY_BYTES = 64 * 1024
_PARAMS = ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank")


class SglangBootstrapServer:
    """SGLang 0.5.10's bootstrap HTTP API (see the module docstring)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 8998, allow_unauthenticated: bool = False,
                 limits: HttpLimits | None = None) -> None:
        self.host, self.port = host, port
        self.protected = not allow_unauthenticated
        self.limits = limits or HttpLimits()
        self.table = SglangRouteTable()
        self.requests_refused = 0
        self._http: HttpService | None = None
        self._lock = asyncio.Lock()

    @property
    def addr(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    async def start(self) -> SglangBootstrapServer:
        guard = [loopback_only(on_refused=self._count_refused)] if self.protected else []
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=guard)
        app.router.add_route("PUT", "/route", self._put_route)
        app.router.add_route("GET", "/route", self._get_route)
        app.router.add_route("*", "/route", self._other_method)
        app.router.add_route("POST", "/register_dp_rank", self._register_dp_rank)
        app.router.add_route("POST", "/query_dp_ranks", self._query_dp_ranks)
        app.router.add_route("GET", "/health", self._health)
        self._http = await serve(app, self.host, self.port, self.limits)
        self.port = self._http.port
        log.info("SGLang-wire bootstrap server listening on %s%s", self.addr,
                 " (protected mode: loopback clients only)" if self.protected else "")
        return self

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None

    async def __aenter__(self) -> SglangBootstrapServer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _count_refused(self) -> None:
        self.requests_refused += 1

    def _refuse(self, status: int, reason: str) -> web.Response:
        self.requests_refused += 1
        return web.Response(text=reason, status=status)

    async def _json(self, request: web.Request) -> Any:
        return await read_json(request, self.limits, MAX_BODY_BYTES)

    async def _put_route(self, request: web.Request) -> web.Response:
        try:
            body = await self._json(request)
            async with self._lock:
                self.table.register(body)
        except HttpRefused as exc:
            return self._refuse(exc.status, str(exc))
        except PayloadError as exc:
            return self._refuse(400, str(exc))
        return web.Response(text="OK")

    async def _get_route(self, request: web.Request) -> web.Response:
        values = [request.query.get(name, "") for name in _PARAMS]
        try:
            dp, cp, tp, pp = (int(v) for v in values)
        except ValueError:
            return self._refuse(400, "Missing inputs for bootstrap server.")
        if not self.table.ready:
            return web.Response(text=f"Prefill server not fully registered yet "
                                     f"({self.table.registered} workers registered).", status=503)
        if (dp, cp, tp, pp) == (-1, -1, -1, -1):
            return web.json_response(self.table.server_info())
        info = self.table.rank_info(dp, cp, tp, pp)
        if info is None:
            return self._refuse(404, f"Bootstrap info not found for dp_rank={dp} cp_rank={cp} tp_rank={tp} "
                                     f"pp_rank={pp}")
        return web.json_response(info)

    async def _other_method(self, request: web.Request) -> web.Response:
        return self._refuse(405, "Method not allowed")

    async def _register_dp_rank(self, request: web.Request) -> web.Response:
        try:
            body = await self._json(request)
            room, dp = (body.get(k) if isinstance(body, dict) else None for k in ("bootstrap_room", "dp_rank"))
            if type(room) is not int or type(dp) is not int or room < 0 or not 0 <= dp < 1 << 16:
                raise PayloadError("need integer bootstrap_room and dp_rank")
        except HttpRefused as exc:
            return self._refuse(exc.status, str(exc))
        except PayloadError as exc:
            return self._refuse(400, str(exc))
        self.table.register_room(room, dp, time.monotonic())
        return web.Response(text="OK")

    async def _query_dp_ranks(self, request: web.Request) -> web.Response:
        try:
            body = await self._json(request)
            rooms = body.get("bootstrap_rooms") if isinstance(body, dict) else None
            if not isinstance(rooms, list) or len(rooms) > 4096 or not all(type(r) is int for r in rooms):
                raise PayloadError("need bootstrap_rooms: a list of at most 4096 integers")
        except HttpRefused as exc:
            return self._refuse(exc.status, str(exc))
        except PayloadError as exc:
            return self._refuse(400, str(exc))
        return web.json_response(self.table.query_rooms(rooms, time.monotonic()))

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="OK")
