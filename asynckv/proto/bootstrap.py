"""Bootstrap-server payloads and the pure rank table behind ``/route``.

Prefill ranks register with ``PUT /route`` (a JSON ``PrefillRank``); decode ranks fetch
the whole topology with ``GET /route``. Readiness counts *distinct* ranks; a rank that
re-registers (a restart) replaces its entry instead of inflating the count.

Entries are leases. Agent ids are public (``GET /route`` lists them), so they prove
nothing; a registration may carry a secret ``lease`` key instead, which only its owner
knows. The owner renews its entry (the same agent id and key) well within ``lease_s``.
Anyone else may replace a live entry only with an authenticated request; once an entry's
lease lapsed (its process died or froze) any registration may replace it. A lapsed
entry still answers ``GET /route``: it is replaceable, not gone.
"""

from __future__ import annotations

import dataclasses
import hmac
import reprlib
from typing import Any

from .endpoints import is_endpoint
from .messages import PROTOCOL_VERSION

__all__ = ["MAX_INT", "MAX_LEASE_KEY", "MAX_STR", "PayloadError", "PrefillRank", "RankTable", "RouteConflict",
           "lease_key"]

MAX_INT = 2**31 - 1
"""Every integer field is at most this (a JSON integer can have thousands of digits)."""
MAX_STR = {"endpoint": 256, "agent_id": 128, "kv_dtype": 32}
"""Longest accepted value of each string field, in characters."""
MAX_LEASE_KEY = 128

_short = reprlib.Repr()
_short.maxstring = _short.maxother = 60
_short.maxlevel = 2  # a reason never recurses into (or copies) a hostile nested value


class PayloadError(ValueError):
    """A bootstrap request body is malformed; the server answers 400 with this text."""


class RouteConflict(ValueError):
    """A live entry of another owner holds the rank; the server answers 409 with this text."""

    def __init__(self, reason: str, retry_after_s: float) -> None:
        super().__init__(reason)
        self.retry_after_s = retry_after_s


@dataclasses.dataclass(frozen=True, slots=True)
class PrefillRank:
    """One prefill rank's registration."""

    tp_size: int
    tp_rank: int
    pp_size: int
    pp_rank: int
    dp_size: int
    dp_rank: int
    endpoint: str
    """The rank's control endpoint, ``tcp://host:port`` (ZMQ) or ``stream://host:port``."""
    agent_id: str
    """NIXL agent name; changes with every process start (the incarnation)."""
    page_size: int
    kv_dtype: str
    is_mla: bool
    protocol_version: int = PROTOCOL_VERSION

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.dp_rank, self.tp_rank, self.pp_rank)

    @property
    def label(self) -> str:
        return f"dp={self.dp_rank} tp={self.tp_rank} pp={self.pp_rank}"

    @property
    def topology(self) -> dict[str, Any]:
        """The instance-wide fields every rank of one prefill instance must agree on."""
        return {"tp_size": self.tp_size, "pp_size": self.pp_size, "dp_size": self.dp_size,
                "page_size": self.page_size, "kv_dtype": self.kv_dtype, "is_mla": self.is_mla,
                "protocol_version": self.protocol_version}

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> PrefillRank:
        """Validate a decoded JSON body; raises ``PayloadError`` naming the bad field."""
        if not isinstance(data, dict):
            raise PayloadError("body must be a JSON object")
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name not in data:
                if f.name == "protocol_version":
                    continue
                raise PayloadError(f"missing field {f.name!r}")
            values[f.name] = _checked(f.name, str(f.type), data[f.name])
        rank = cls(**values)
        for size, idx in (("tp_size", "tp_rank"), ("pp_size", "pp_rank"), ("dp_size", "dp_rank")):
            if not 0 <= values[idx] < values[size]:
                raise PayloadError(f"{idx}={values[idx]} not in [0, {size}={values[size]})")
        if values["page_size"] <= 0:
            raise PayloadError("page_size must be > 0")
        if not is_endpoint(values["endpoint"]):
            raise PayloadError("endpoint must look like tcp://host:port or stream://host:port")
        return rank


def _checked(name: str, type_name: str, value: Any) -> Any:
    """One field's value, type-checked and bounded (it ends up in logs and in every decode's table)."""
    expected: type = {"int": int, "str": str, "bool": bool}[type_name]
    if type(value) is not expected:
        raise PayloadError(f"field {name!r} must be {expected.__name__}, got {_short.repr(value)}")
    if isinstance(value, str):
        limit = MAX_STR[name]
        if len(value) > limit:
            raise PayloadError(f"field {name!r} is {len(value)} characters long, at most {limit} allowed")
        if not value.isprintable():
            raise PayloadError(f"field {name!r} has non-printable characters: {_short.repr(value)}")
    elif isinstance(value, int) and not -MAX_INT <= value <= MAX_INT:
        raise PayloadError(f"field {name!r} must be within +-{MAX_INT}")
    return value


def lease_key(body: Any) -> str:
    """The optional secret ``lease`` of a PUT or DELETE body ("" when absent); raises ``PayloadError``."""
    key = body.get("lease", "") if isinstance(body, dict) else ""
    if not isinstance(key, str) or len(key) > MAX_LEASE_KEY or not key.isprintable():
        raise PayloadError(f"field 'lease' must be a printable string of at most {MAX_LEASE_KEY} characters")
    return key


@dataclasses.dataclass(slots=True)
class _Entry:
    rank: PrefillRank
    key: str
    """The owner's secret lease key ("" if it sent none)."""
    expires: float

    def owned_by(self, rank: PrefillRank, key: str) -> bool:
        """The same incarnation with the same secret; without a secret only an identical renewal counts
        (an impostor who copied the agent id from ``GET /route`` must not move the endpoint)."""
        if rank.agent_id != self.rank.agent_id or not hmac.compare_digest(key.encode(), self.key.encode()):
            return False
        return bool(key) or rank == self.rank


class RankTable:
    """Registered prefill ranks of one instance, keyed by (dp, tp, pp), each held for ``lease_s``.

    ``now`` is any monotonic clock in seconds (a parameter: this module reads no clock)."""

    def __init__(self, max_ranks: int = 4096, lease_s: float = 10.0) -> None:
        if max_ranks < 1 or not lease_s > 0:
            raise ValueError(f"need max_ranks >= 1 and lease_s > 0, got {max_ranks}, {lease_s}")
        self.max_ranks = max_ranks
        self.lease_s = lease_s
        self._ranks: dict[tuple[int, int, int], _Entry] = {}
        self._topology: dict[str, Any] | None = None

    def register(self, rank: PrefillRank, now: float = 0.0, *, key: str = "", authenticated: bool = False) -> bool:
        """Add, renew or replace a rank; True if the entry is new or changed (False: a renewal).

        Raises ``PayloadError`` for an instance too large or disagreeing with the registered one,
        and ``RouteConflict`` when a live entry of another owner holds the rank."""
        size = rank.tp_size * rank.pp_size * rank.dp_size
        if size > self.max_ranks:
            raise PayloadError(f"tp_size*pp_size*dp_size = {rank.tp_size}*{rank.pp_size}*{rank.dp_size} = {size} "
                               f"ranks, this server accepts at most {self.max_ranks}")
        self._check_topology(rank, now)
        old = self._ranks.get(rank.key)
        if old is not None and old.expires > now and not authenticated and not old.owned_by(rank, key):
            raise RouteConflict(
                f"prefill rank {rank.label} is held by live agent {old.rank.agent_id[:8]} at {old.rank.endpoint}; "
                f"another agent may replace it when its lease lapses in {old.expires - now:.1f}s (unless it is "
                "renewed), or at once with a request authenticated by ASYNCKV_AUTH_TOKEN", old.expires - now)
        self._topology = rank.topology
        self._ranks[rank.key] = _Entry(rank, key, now + self.lease_s)
        return old is None or old.rank != rank

    def _check_topology(self, rank: PrefillRank, now: float) -> None:
        """A rank must agree with the live ranks of its instance; once none is live, a new instance
        (another topology) replaces the lapsed one."""
        if self._topology is None or rank.topology == self._topology:
            return
        if any(e.expires > now for e in self._ranks.values()):
            diff = {k: (self._topology[k], v) for k, v in rank.topology.items() if self._topology[k] != v}
            raise PayloadError("rank disagrees with the registered instance: "
                               + ", ".join(f"{k} registered {a!r}, got {b!r}" for k, (a, b) in diff.items()))
        self._ranks.clear()

    def unregister(self, key: tuple[int, int, int], agent_id: str, lease: str = "", *,
                   authenticated: bool = False) -> bool:
        """Remove a rank if it is still the same incarnation and the caller owns it (or is authenticated)."""
        entry = self._ranks.get(key)
        if entry is None or entry.rank.agent_id != agent_id:
            return False
        if not authenticated and not hmac.compare_digest(lease.encode(), entry.key.encode()):
            return False
        del self._ranks[key]
        return True

    @property
    def expected(self) -> int:
        if self._topology is None:
            return 0
        t = self._topology
        return int(t["tp_size"]) * int(t["pp_size"]) * int(t["dp_size"])

    @property
    def registered(self) -> int:
        return len(self._ranks)

    @property
    def ready(self) -> bool:
        return self._topology is not None and self.registered >= self.expected

    def route(self) -> dict[str, Any]:
        """The ``GET /route`` answer: topology plus every rank (lease keys never leave the table)."""
        return {**(self._topology or {}),
                "ranks": [e.rank.to_json() for _, e in sorted(self._ranks.items())]}
