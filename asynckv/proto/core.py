"""What both cores share: the action queue, message dispatch, counters, deadlines and heartbeats."""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from ..config import Config
from ..errors import ClosedError, InvalidArgument, LocalProtocolError
from ..layout import KVArgs
from .actions import Action, Send
from .liveness import Liveness, PeerState
from .messages import MAX_ROOM, Ping
from .timers import Deadlines

__all__ = ["Core", "Integer", "check_int", "check_new_room"]

log = logging.getLogger("asynckv.core")


Integer = int | np.integer[Any]
"""What the API takes for a count or an index: a Python or numpy integer (``check_int`` refuses bool)."""


def check_int(value: Any, what: str, low: int = 0) -> int:
    """An integer (Python or numpy, never bool or float) >= ``low``, as a Python int."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < low:
        raise InvalidArgument(f"{what} must be an integer >= {low}, got {value!r}")
    return int(value)


def check_new_room(room: Any, rooms: dict[int, Any], max_rooms: int, closing: bool) -> None:
    """Refuse a room a core cannot open: the manager closed, a bad id, an id in use, the table full."""
    if closing:
        raise ClosedError("KVManager is closed")
    if type(room) is not int or not 0 <= room <= MAX_ROOM:
        raise InvalidArgument(f"room must be an int in [0, 2**63), got {room!r}")
    if room in rooms:
        raise LocalProtocolError(f"room {room} already exists on this manager (clear() it first)")
    if len(rooms) >= max_rooms:
        raise InvalidArgument(f"too many rooms ({len(rooms)}); raise Config.max_rooms or clear() rooms")


class Core:
    """Base of ``PrefillCore`` and ``DecodeCore``: events in (with ``now``), actions out."""

    mode = ""

    def __init__(self, name: str, endpoint: str, kv_args: KVArgs, config: Config) -> None:
        self.name = name
        self.endpoint = endpoint
        self.kv_args = kv_args
        self.num_pages, self.num_aux_rows = kv_args.num_pages, kv_args.num_aux_rows
        """Bounds of every room's indices (``KVArgs`` computes them over every entry on each call)."""
        self.config = config
        self.liveness = Liveness(config.heartbeat_interval_s, config.heartbeat_max_failures)
        self.deadlines = Deadlines()
        self.stats: collections.Counter[str] = collections.Counter()
        self.closing = False
        self.closed = False
        self._next_beat = 0.0
        self._out: list[Action] = []
        self._handlers: dict[type[Any], Callable[[Any, float], None]] = {}

    def actions(self) -> list[Action]:
        """Take the actions produced so far, in order."""
        out, self._out = self._out, []
        return out

    def receive(self, msg: Any, now: float) -> None:
        """A decoded control message (of the wire the manager speaks)."""
        self.stats[f"msg_{type(msg).__name__}"] += 1
        handler = self._handlers.get(type(msg))
        if handler is None:
            self._drop("unexpected", f"{self.mode} got {type(msg).__name__}")
            return
        handler(msg, now)

    def _beat_due(self, now: float) -> bool:
        return bool(len(self.liveness)) and now >= self._next_beat

    def _beat(self, now: float) -> list[PeerState]:
        """A heartbeat tick: the peers found silent for too long (removed from liveness)."""
        cfg = self.config
        stalled = now - self._next_beat > cfg.heartbeat_interval_s
        self._next_beat = now + cfg.heartbeat_interval_s
        # A tick that is itself late means this process was stalled: read what queued up before
        # blaming peers for a silence it caused (the next tick checks).
        return [] if stalled else self.liveness.expired(now)

    def _ping_all(self, now: float) -> None:
        for state, seq in self.liveness.pings_due(now):
            self._emit(Send(state.endpoint, Ping(self.name, self.endpoint, state.session, seq)))

    def _silence(self, state: PeerState, now: float) -> str:
        cfg = self.config
        return (f"peer {state.peer_id[:8]} at {state.endpoint} unheard for {now - state.last_seen:.1f}s "
                f"(heartbeat every {cfg.heartbeat_interval_s:g}s, {cfg.heartbeat_max_failures} misses allowed)")

    def _emit(self, action: Action) -> None:
        self._out.append(action)

    def _drop(self, reason: str, detail: str) -> None:
        self.stats[f"dropped_{reason}"] += 1
        log.debug("dropped control message (%s): %s", reason, detail)
