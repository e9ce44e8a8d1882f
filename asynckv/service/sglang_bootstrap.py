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

from ..errors import BootstrapTimeout, PeerUnreachable, RemoteProtocolError
from ..layout import KVArgs
from ..proto.bootstrap import PayloadError
from ..proto.sglang_bootstrap import SglangRouteTable
from ..proto.sglang_decode import SglangPrefill, check_prefill
from .bootstrap import BootstrapClient, _backoff, _reason
from .ops import HttpLimits, HttpRefused, HttpService, loopback_only, read_json, serve

__all__ = ["SglangBootstrapClient", "SglangBootstrapServer", "sglang_rank"]

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


def sglang_rank(kv_args: KVArgs, endpoint: str, kv_cache_dtype: str) -> dict[str, Any]:
    """The ``PUT /route`` body of an asynckv prefill rank on the SGLang wire (SGLang's fields)."""
    a = kv_args
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    return {"attn_tp_size": a.tp_size, "attn_tp_rank": a.engine_rank, "attn_cp_size": 1, "attn_cp_rank": 0,
            "attn_dp_size": a.dp_size, "attn_dp_rank": a.dp_rank, "pp_size": a.pp_size, "pp_rank": a.pp_rank,
            "system_dp_size": 1, "system_dp_rank": 0, "rank_ip": host.strip("[]"), "rank_port": int(port),
            "page_size": a.page_size, "kv_cache_dtype": kv_cache_dtype, "load_balance_method": "follow_bootstrap_room"}


class SglangBootstrapClient(BootstrapClient):
    """SGLang 0.5.10's bootstrap HTTP API, from the client side (``PUT /route``, ``GET /route``,
    ``GET /health``); errors mapped to asynckv's tree."""

    async def register_sglang(self, addr: str, body: dict[str, Any], attempts: int = 5) -> None:
        """``PUT /route`` (SGLang has no lease and no removal): an unreachable server is retried
        ``attempts`` times with backoff; a refusal raises at once with the server's reason."""
        for attempt in range(attempts):
            try:
                status, data = await self._request("PUT", addr, "/route", body)
            except PeerUnreachable as exc:
                if attempt + 1 >= attempts:
                    raise PeerUnreachable(f"could not register with SGLang bootstrap server {addr} after "
                                          f"{attempts} attempts: {exc}") from exc
                await asyncio.sleep(_backoff(attempt, 5.0))
                continue
            if status != 200:
                raise RemoteProtocolError(f"SGLang bootstrap server {addr} refused registration ({status}): "
                                          f"{_reason(data)}")
            return

    async def fetch_sglang(self, addr: str, kv_args: KVArgs, kv_cache_dtype: str, timeout_s: float) -> SglangPrefill:
        """The prefill instance (``GET /route`` with every parameter -1, retried while 503 until
        ``timeout_s``) and, when this decode rank can pair with it, the endpoint of the rank it writes
        to in each DP group (``target_tp_rank`` = our engine rank)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        delay = 0.02
        while True:
            status, data = await self._request("GET", addr, "/route?" + _query(-1, -1, -1, -1))
            if status == 200:
                break
            if status != 503:
                raise RemoteProtocolError(f"SGLang bootstrap server {addr} answered {status} to GET /route: "
                                          f"{_reason(data)}")
            if loop.time() + delay > deadline:
                raise BootstrapTimeout(f"SGLang prefill at {addr} not ready after {timeout_s:.1f}s: {_reason(data)}")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)
        prefill = SglangPrefill.from_json(data)
        check_prefill(prefill, kv_args, kv_cache_dtype)  # (no endpoints to look up for a pair that cannot work)
        for dp in range(prefill.dp_size):
            status, data = await self._request("GET", addr, "/route?" + _query(dp, 0, kv_args.engine_rank, 0))
            ip, port = (data.get(k) if isinstance(data, dict) else None for k in ("rank_ip", "rank_port"))
            if status != 200 or not isinstance(ip, str) or type(port) is not int or not 0 < port < 65536:
                raise RemoteProtocolError(f"SGLang bootstrap server {addr}: no endpoint for dp rank {dp}, tp rank "
                                          f"{kv_args.engine_rank} ({status}): {_reason(data)}")
            host = f"[{ip}]" if ":" in ip else ip
            prefill.endpoints[dp] = f"tcp://{host}:{port}"
        return prefill

    async def health(self, addr: str, timeout_s: float) -> str | None:
        """``GET /health``: None when it answered 200, else why not."""
        try:
            status, data = await asyncio.wait_for(self._request("GET", addr, "/health"), timeout_s)
        except (PeerUnreachable, TimeoutError) as exc:
            return str(exc) or f"no answer within {timeout_s:g}s"
        return None if status == 200 else f"GET /health answered {status}: {_reason(data)}"


def _query(dp: int, cp: int, tp: int, pp: int) -> str:
    return "&".join(f"{name}={value}" for name, value in zip(_PARAMS, (dp, cp, tp, pp), strict=True))
