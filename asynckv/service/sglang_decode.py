"""The decode pump on SGLang's wire: runs a ``SglangDecodeCore``'s actions (SGLang's HTTP look-ups
and health checks, receivers' futures) and feeds it the data plane's NIXL notifications."""

from __future__ import annotations

import time
from collections.abc import Callable

from ..config import Config
from ..errors import AsyncKVError, ClosedError
from ..proto import actions as act
from ..proto.sglang_decode import CheckHealth, SglangDecodeCore, SglangPrefill
from ..transport.base import ControlPlane
from .decode import ReceiverPump
from .sglang_bootstrap import SglangBootstrapClient

__all__ = ["SglangDecodeService"]


class SglangDecodeService(ReceiverPump):
    def __init__(self, core: SglangDecodeCore, control: ControlPlane, http: SglangBootstrapClient, config: Config,
                 labels: tuple[str, str], clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(core, control, labels, clock)
        self.core: SglangDecodeCore = core
        self.http = http
        self.config = config
        self.handlers.update({act.FetchTopology: self._on_fetch, CheckHealth: self._on_check_health})

    def on_notified(self, batch: list[tuple[str, bytes]]) -> None:
        """NIXL notifications, from the data plane (on the loop)."""
        self.feed_each("notified", batch)

    # -- actions ---------------------------------------------------------------------------

    def _on_fetch(self, a: act.FetchTopology) -> None:
        self.spawn(self._fetch(a.addr), f"asynckv-route-{a.addr}",
                   lambda: self.feed("topology_fetched", a.addr, ClosedError("the topology look-up was cancelled")))

    async def _fetch(self, addr: str) -> None:
        cfg = self.config
        try:
            result: SglangPrefill | BaseException = await self.http.fetch_sglang(
                addr, self.core.kv_args, cfg.sglang_kv_cache_dtype, cfg.handshake_timeout_s)
        except AsyncKVError as exc:
            result = exc
        self.feed("topology_fetched", addr, result)

    def _on_check_health(self, a: CheckHealth) -> None:
        self.spawn(self._check_health(a), f"asynckv-health-{a.addr}",
                   lambda: self.feed("health_checked", a.addr, "the health check was cancelled"))

    async def _check_health(self, a: CheckHealth) -> None:
        self.feed("health_checked", a.addr, await self.http.health(a.addr, a.timeout_s))
