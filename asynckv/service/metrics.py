"""Prometheus metrics of every KVManager in this process.

Counters and histograms are updated where things happen (a post settles, a room ends, a peer
is first contacted, a timer fires: how late); gauges (rooms by state, peers and their heartbeats,
in-flight bytes, dropped control messages) are read from the managers' own tables at scrape
time, so they cost nothing between scrapes. The counters and histograms are this module's
own: a series is a plain counter list updated on its manager's loop thread with no lock (a
room updates about ten of them; prometheus_client's took 1-2 us each behind a mutex and a
Python bucket search, about 5% of a busy prefill loop), rendered into metric families at
scrape time (without prometheus_client's ``_created`` samples).
Labels: ``mode`` (prefill/decode), ``manager``
(the first 8 characters of its agent name), ``peer`` (the peer's agent name prefix) and,
where it matters, ``kind``, ``result`` and ``reason``. Series of gone peers are kept for the
64 most recent ones and removed after that.
"""

from __future__ import annotations

import bisect
import collections
import weakref
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from .manager import KVManager

__all__ = ["REGISTRY", "forget_manager", "forget_peer", "managers", "register_manager"]

REGISTRY = CollectorRegistry(auto_describe=True)
"""The registry ``/metrics`` serves (separate from prometheus_client's global one)."""



class _Series:
    """One labelled series: ``values`` (a counter's total; a histogram's per-bucket counts, then the sum)."""

    __slots__ = ("bounds", "values")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = bounds
        self.values: list[float] = [0] * (len(bounds) + 1) if bounds else [0]

    def inc(self, amount: float = 1) -> None:
        if amount < 0:
            raise ValueError("counters can only be incremented by non-negative amounts")
        self.values[0] += amount

    def observe(self, amount: float) -> None:
        values = self.values
        values[bisect.bisect_left(self.bounds, amount)] += 1  # (the first bucket whose bound >= amount)
        values[-1] += amount


class _Metric(Collector):
    """A counter or histogram with labels, in the prometheus_client shape this module uses:
    ``labels(*values)`` -> a series with ``inc``/``observe``; ``remove(*values)``."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str], buckets: Sequence[float],
                 registry: CollectorRegistry) -> None:
        self._name = name
        self._documentation = documentation
        self._labelnames = tuple(labelnames)
        self._bounds = (*buckets, float("inf")) if buckets else ()
        self._metrics: dict[tuple[str, ...], _Series] = {}
        registry.register(self)

    def labels(self, *values: str) -> _Series:
        if len(values) != len(self._labelnames):
            raise ValueError(f"{self._name}: expected {len(self._labelnames)} label values, got {len(values)}")
        key = tuple(str(v) for v in values)
        series = self._metrics.get(key)
        if series is None:
            series = self._metrics[key] = _Series(self._bounds)
        return series

    def remove(self, *values: str) -> None:
        self._metrics.pop(tuple(str(v) for v in values), None)

    def collect(self) -> Iterator[Any]:
        if not self._bounds:
            family: Any = CounterMetricFamily(self._name, self._documentation, labels=self._labelnames)
            for key, series in list(self._metrics.items()):
                family.add_metric(key, series.values[0])
            yield family
            return
        family = HistogramMetricFamily(self._name, self._documentation, labels=self._labelnames)
        les = ["+Inf" if b == float("inf") else repr(float(b)) for b in self._bounds]  # (as prometheus_client)
        for key, series in list(self._metrics.items()):
            values = list(series.values)  # (a copy: the loop thread may be updating it)
            cumulative, buckets = 0.0, []
            for le, n in zip(les, values, strict=False):
                cumulative += n
                buckets.append((le, cumulative))
            family.add_metric(key, buckets, values[-1])
        yield family


class Counter(_Metric):
    def __init__(self, name: str, documentation: str, labelnames: Sequence[str],
                 registry: CollectorRegistry = REGISTRY) -> None:
        super().__init__(name, documentation, labelnames, (), registry)


class Histogram(_Metric):
    def __init__(self, name: str, documentation: str, labelnames: Sequence[str], buckets: Sequence[float],
                 registry: CollectorRegistry = REGISTRY) -> None:
        if not buckets:
            raise ValueError(f"{name}: a histogram needs buckets")
        super().__init__(name, documentation, labelnames, buckets, registry)


_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)

TRANSFER_BYTES = Counter("asynckv_transfer_bytes", "Bytes written to a peer (prefill), by kind (kv, aux, state)",
                         ["mode", "manager", "peer", "kind"], registry=REGISTRY)
TRANSFERS = Counter("asynckv_transfers", "Writes that landed, by kind (a room's aux row counts as one even when it "
                    "rode on the room's last KV post)", ["mode", "manager", "peer", "kind"], registry=REGISTRY)
TRANSFER_SECONDS = Histogram("asynckv_transfer_seconds", "Time from handing a post to the engine to all its writes "
                             "landing", ["mode", "manager", "peer"], buckets=_LATENCY_BUCKETS, registry=REGISTRY)
DESCRIPTORS = Histogram("asynckv_descriptors_per_transfer", "Descriptors (or prepared indices) per NIXL post, "
                        "before NIXL merges runs", ["mode", "manager", "peer"],
                        buckets=(1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144), registry=REGISTRY)
TRANSFER_FAILURES = Counter("asynckv_transfer_failures", "NIXL posts that failed, by reason",
                            ["mode", "manager", "peer", "reason"], registry=REGISTRY)
ROOM_SECONDS = Histogram("asynckv_room_seconds", "Room latency: prefill from the first send(), decode from init(), "
                         "to the outcome", ["mode", "manager", "peer", "result"], buckets=_LATENCY_BUCKETS,
                         registry=REGISTRY)
ROOMS_FINISHED = Counter("asynckv_rooms_finished", "Rooms that ended, by result and failure reason",
                         ["mode", "manager", "result", "reason"], registry=REGISTRY)
FIRST_CONTACT_SECONDS = Histogram("asynckv_first_contact_seconds", "Registration of a new peer plus the warm-up "
                                  "write (prefill) or the registration round trip (decode)",
                                  ["mode", "manager", "peer"], buckets=_LATENCY_BUCKETS, registry=REGISTRY)
LOOP_LAG_SECONDS = Histogram("asynckv_loop_lag_seconds", "How late the manager's timers fired on its event loop "
                             "(heartbeat ticks and room deadlines): the lag its scheduler's own callbacks see too "
                             "(uvloop's timers have 1 ms resolution)", ["mode", "manager"], buckets=_LATENCY_BUCKETS,
                             registry=REGISTRY)
PEERS_DEAD = Counter("asynckv_peers_dead", "Peers declared dead (silence, disconnect, restart)",
                     ["mode", "manager", "reason"], registry=REGISTRY)

_MANAGERS: weakref.WeakSet[KVManager] = weakref.WeakSet()


_CHILDREN: dict[tuple[int, tuple[str, ...]], Any] = {}
"""(metric, label values) -> its child: ``labels()`` costs ~5 us and a room updates ~10 series."""


def child(metric: Any, *labels: str) -> Any:
    """``metric.labels(*labels)``, cached (until a series is removed)."""
    key = (id(metric), labels)
    found = _CHILDREN.get(key)
    if found is None:
        found = _CHILDREN[key] = metric.labels(*labels)
    return found


def register_manager(mgr: KVManager) -> None:
    _MANAGERS.add(mgr)


def managers() -> list[KVManager]:
    return list(_MANAGERS)


def forget_manager(mgr: KVManager) -> None:
    _MANAGERS.discard(mgr)
    labels = {"mode": mgr.mode.value, "manager": mgr.name[:8]}
    for metric in (TRANSFER_BYTES, TRANSFERS, TRANSFER_SECONDS, DESCRIPTORS, TRANSFER_FAILURES, ROOM_SECONDS,
                   ROOMS_FINISHED, FIRST_CONTACT_SECONDS, PEERS_DEAD, LOOP_LAG_SECONDS):
        _remove_matching(metric, labels)


RETIRED_PEERS_KEPT = 64
_retired: collections.deque[dict[str, str]] = collections.deque()


def forget_peer(labels: tuple[str, str], peer: str) -> None:
    """Retire a gone peer's series (``labels``: the manager's mode and name): the last
    ``RETIRED_PEERS_KEPT`` stay scrapable (a scrape just after a peer left still sees its totals),
    older ones are removed so restarts do not grow the label set forever."""
    _retired.append({"mode": labels[0], "manager": labels[1], "peer": peer[:8]})
    while len(_retired) > RETIRED_PEERS_KEPT:
        old = _retired.popleft()
        for metric in (TRANSFER_BYTES, TRANSFERS, TRANSFER_SECONDS, DESCRIPTORS, TRANSFER_FAILURES,
                       FIRST_CONTACT_SECONDS):
            _remove_matching(metric, old)


def _remove_matching(metric: Any, labels: dict[str, str]) -> None:
    _CHILDREN.clear()  # (a removed series must not live on in the cache, detached from the registry)
    names = metric._labelnames
    for values in list(metric._metrics):
        row = dict(zip(names, values, strict=True))
        if all(row.get(k) == v for k, v in labels.items()):
            metric.remove(*values)


class _LiveCollector(Collector):
    """Gauges read from the live managers' snapshots at scrape time."""

    def collect(self) -> Iterator[Any]:
        rooms = GaugeMetricFamily("asynckv_rooms", "Rooms by state", labels=["mode", "manager", "state"])
        peer_up = GaugeMetricFamily("asynckv_peer_up", "1 while a peer was heard within two heartbeats; "
                                    "0 while it is late (declared dead, it disappears)",
                                    labels=["mode", "manager", "peer", "endpoint"])
        heard = GaugeMetricFamily("asynckv_peer_last_heard_seconds", "Seconds since a peer was last heard from",
                                  labels=["mode", "manager", "peer"])
        inflight = GaugeMetricFamily("asynckv_inflight_bytes", "Bytes posted and not yet landed",
                                     labels=["mode", "manager"])
        dropped = CounterMetricFamily("asynckv_control_dropped", "Control messages dropped, by reason",
                                      labels=["mode", "manager", "reason"])
        healthy = GaugeMetricFamily("asynckv_manager_healthy", "1 while reader, engine thread and timers run",
                                    labels=["mode", "manager"])
        staging = GaugeMetricFamily("asynckv_staging_bytes", "Staging area bytes (prefill: head-slice gathers; "
                                    "decode: slots of staged pages), by use: capacity or held",
                                    labels=["mode", "manager", "use"])
        waiting = GaugeMetricFamily("asynckv_staging_waiting_rooms", "Decode rooms waiting for free staging slots",
                                    labels=["mode", "manager"])
        for mgr in managers():
            snap = mgr.snapshot()
            base = [mgr.mode.value, mgr.name[:8]]
            for state in ("Failed", "Bootstrapping", "WaitingForInput", "Transferring", "Success"):
                rooms.add_metric([*base, state], snap["rooms"].get(state, 0))
            for peer in snap["peers"]:
                peer_up.add_metric([*base, peer["peer"][:8], peer["endpoint"]], 1.0 if peer["alive"] else 0.0)
                if peer["last_heard_s_ago"] is not None:
                    heard.add_metric([*base, peer["peer"][:8]], max(0.0, peer["last_heard_s_ago"]))
            inflight.add_metric(base, snap["tables"].get("inflight_bytes", 0))
            for reason, count in snap["dropped"].items():
                dropped.add_metric([*base, reason], count)
            healthy.add_metric(base, 1.0 if snap["healthy"] else 0.0)
            area = snap.get("staging")
            if area is not None:
                staging.add_metric([*base, "capacity"], area["capacity_bytes"])
                staging.add_metric([*base, "held"], area["held_bytes"])
                if "waiting_rooms" in area:  # (decode)
                    waiting.add_metric(base, area["waiting_rooms"])
        yield from (rooms, peer_up, heard, inflight, dropped, healthy, staging, waiting)


REGISTRY.register(_LiveCollector())
