"""Bootstrap-server payloads and the pure rank table behind ``/route``.

Prefill ranks register with ``PUT /route`` (a JSON ``PrefillRank``); decode ranks fetch
the whole topology with ``GET /route``. Readiness counts *distinct* ranks; a rank that
re-registers (a restart) replaces its entry instead of inflating the count.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .messages import PROTOCOL_VERSION

__all__ = ["PayloadError", "PrefillRank", "RankTable"]


class PayloadError(ValueError):
    """A bootstrap request body is malformed; the server answers 400 with this text."""


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
    """The rank's control endpoint, ``tcp://host:port``."""
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
            value = data[f.name]
            expected = {"int": int, "str": str, "bool": bool}[str(f.type)]
            if type(value) is not expected:
                raise PayloadError(f"field {f.name!r} must be {expected.__name__}, got {value!r:.60}")
            values[f.name] = value
        rank = cls(**values)
        for size, idx in (("tp_size", "tp_rank"), ("pp_size", "pp_rank"), ("dp_size", "dp_rank")):
            if not 0 <= values[idx] < values[size]:
                raise PayloadError(f"{idx}={values[idx]} not in [0, {size}={values[size]})")
        if values["page_size"] <= 0:
            raise PayloadError("page_size must be > 0")
        if not values["endpoint"].startswith("tcp://"):
            raise PayloadError("endpoint must look like tcp://host:port")
        return rank


class RankTable:
    """Registered prefill ranks of one instance, keyed by (dp, tp, pp)."""

    def __init__(self) -> None:
        self._ranks: dict[tuple[int, int, int], PrefillRank] = {}
        self._topology: dict[str, Any] | None = None

    def register(self, rank: PrefillRank) -> None:
        """Add or replace a rank; refuses one whose instance-wide fields disagree."""
        if self._topology is not None and rank.topology != self._topology:
            diff = {k: (self._topology[k], v) for k, v in rank.topology.items() if self._topology[k] != v}
            if self._ranks:
                raise PayloadError("rank disagrees with the registered instance: "
                                   + ", ".join(f"{k} registered {a!r}, got {b!r}" for k, (a, b) in diff.items()))
        self._topology = rank.topology
        self._ranks[rank.key] = rank

    def unregister(self, key: tuple[int, int, int], agent_id: str) -> bool:
        """Remove a rank if it is still the same incarnation."""
        rank = self._ranks.get(key)
        if rank is None or rank.agent_id != agent_id:
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
        """The ``GET /route`` answer: topology plus every rank."""
        return {**(self._topology or {}),
                "ranks": [r.to_json() for _, r in sorted(self._ranks.items())]}
