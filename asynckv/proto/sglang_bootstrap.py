"""The bootstrap table of SGLang 0.5.10's HTTP API, sans-IO (served by
``asynckv.service.sglang_bootstrap``): prefill ranks ``PUT /route`` themselves, decode ranks
``GET /route`` the topology (all four parameters -1) or one rank's ZMQ endpoint.

Unlike SGLang's server: readiness counts distinct ranks (SGLang counts PUTs, so a restarted
rank made an instance look ready early); a rank whose instance-wide fields disagree with the
registered ones is refused naming them (SGLang keeps the first writer's silently); the table
and the room → DP-rank map are bounded.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

from .bootstrap import PayloadError

__all__ = ["SglangRouteTable"]

_INTS = ("attn_tp_size", "attn_tp_rank", "attn_cp_size", "attn_cp_rank", "attn_dp_size", "attn_dp_rank",
         "pp_size", "pp_rank", "system_dp_size", "system_dp_rank", "rank_port", "page_size")
_STRS = ("rank_ip", "kv_cache_dtype", "load_balance_method")
_MAX = 1 << 16


@dataclasses.dataclass(frozen=True, slots=True)
class _Rank:
    key: tuple[int, int, int, int]
    """(dp group, cp rank, tp rank, pp rank)."""
    instance: dict[str, Any]
    endpoint: dict[str, Any]


def _parse(body: Any) -> _Rank:
    if not isinstance(body, dict):
        raise PayloadError("body must be a JSON object")
    for name in _INTS:
        value = body.get(name)
        if type(value) is not int or not 0 <= value < (65536 if name == "rank_port" else _MAX):
            raise PayloadError(f"field {name!r} must be an integer in range, got {value!r:.40}")
    for name in _STRS:
        value = body.get(name)
        if not isinstance(value, str) or not 0 < len(value) <= 128 or not value.isprintable():
            raise PayloadError(f"field {name!r} must be a short printable string, got {value!r:.40}")
    for size, rank in (("attn_tp_size", "attn_tp_rank"), ("attn_cp_size", "attn_cp_rank"),
                       ("attn_dp_size", "attn_dp_rank"), ("pp_size", "pp_rank"),
                       ("system_dp_size", "system_dp_rank")):
        if not body[rank] < body[size]:
            raise PayloadError(f"{rank}={body[rank]} not below {size}={body[size]}")
    single = body["system_dp_size"] == 1
    instance = {"attn_tp_size": body["attn_tp_size"], "attn_cp_size": body["attn_cp_size"],
                "dp_size": body["attn_dp_size"] if single else body["system_dp_size"], "pp_size": body["pp_size"],
                "page_size": body["page_size"], "kv_cache_dtype": body["kv_cache_dtype"],
                "follow_bootstrap_room": body["load_balance_method"] == "follow_bootstrap_room"}
    key = (body["attn_dp_rank"] if single else body["system_dp_rank"], body["attn_cp_rank"], body["attn_tp_rank"],
           body["pp_rank"])
    return _Rank(key, instance, {"rank_ip": body["rank_ip"], "rank_port": body["rank_port"]})


class SglangRouteTable:
    """Prefill ranks of one instance, as SGLang's bootstrap server answers for them."""

    def __init__(self, max_ranks: int = 4096, max_rooms: int = 65536) -> None:
        self.max_ranks = max_ranks
        self.max_rooms = max_rooms
        self._instance: dict[str, Any] | None = None
        self._ranks: dict[tuple[int, int, int, int], dict[str, Any]] = {}
        self._rooms: collections.OrderedDict[int, tuple[int, float]] = collections.OrderedDict()

    @property
    def expected(self) -> int:
        i = self._instance
        return 0 if i is None else int(i["dp_size"] * i["attn_cp_size"] * i["attn_tp_size"] * i["pp_size"])

    @property
    def ready(self) -> bool:
        return self._instance is not None and len(self._ranks) >= self.expected

    @property
    def registered(self) -> int:
        return len(self._ranks)

    def register(self, body: Any) -> None:
        """``PUT /route``: add or replace (a restart) one rank; raises ``PayloadError`` for a bad body,
        more ranks than ``max_ranks``, or instance-wide fields that disagree with the live ones."""
        rank = _parse(body)
        i = rank.instance
        if i["dp_size"] * i["attn_cp_size"] * i["attn_tp_size"] * i["pp_size"] > self.max_ranks:
            raise PayloadError(f"an instance of more than {self.max_ranks} ranks is refused")
        if self._instance is not None and self._ranks and rank.instance != self._instance:
            diff = ", ".join(f"{k} registered {self._instance[k]!r}, got {v!r}"
                             for k, v in rank.instance.items() if self._instance[k] != v)
            raise PayloadError(f"rank disagrees with the registered instance: {diff}")
        self._instance = rank.instance
        self._ranks[rank.key] = rank.endpoint

    def server_info(self) -> dict[str, Any]:
        """The topology answer (``PrefillServerInfo``), with the decode-side fields SGLang sends as null."""
        return {**(self._instance or {}), "target_tp_rank": None, "target_tp_ranks": None, "target_cp_ranks": None,
                "target_pp_ranks": None, "required_dst_info_num": None, "required_prefill_response_num": None}

    def rank_info(self, dp: int, cp: int, tp: int, pp: int) -> dict[str, Any] | None:
        return self._ranks.get((dp, cp, tp, pp))

    def register_room(self, room: int, dp_rank: int, now: float, ttl_s: float = 120.0) -> None:
        """``POST /register_dp_rank``: which DP rank took ``room`` (kept ``ttl_s``, oldest first out)."""
        self.expire(now, ttl_s)
        self._rooms.pop(room, None)
        self._rooms[room] = (dp_rank, now)
        while len(self._rooms) > self.max_rooms:
            self._rooms.popitem(last=False)

    def query_rooms(self, rooms: list[int], now: float, ttl_s: float = 120.0) -> dict[str, int]:
        """``POST /query_dp_ranks``: the DP rank of each known room (unknown ones are left out)."""
        self.expire(now, ttl_s)
        return {str(r): self._rooms[r][0] for r in rooms if r in self._rooms}

    def expire(self, now: float, ttl_s: float) -> None:
        while self._rooms and next(iter(self._rooms.values()))[1] < now - ttl_s:
            self._rooms.popitem(last=False)
