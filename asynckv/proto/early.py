"""Prefill: what is known of a room while no sender exists for it.

- destinations (``TransferInfo``) that arrived before the prefill scheduler created the sender;
- aborts from decode that arrived before the sender (a sender created later fails at once);
- a *failure notice*: the sender failed (aborted, timed out) and was cleared before its
  destinations arrived, so a destination arriving later is answered ``Status(ok=False)`` at
  once instead of waiting for decode's timeout.

Bounded by count and by age (``ttl_s``), oldest first; when full, records without destinations
make room first.
"""

from __future__ import annotations

import collections
import dataclasses

from .messages import Abort
from .sender import Destination

__all__ = ["EarlyRoom", "EarlyTable"]


@dataclasses.dataclass(eq=False, slots=True)
class EarlyRoom:
    deadline: float
    infos: dict[str, Destination] = dataclasses.field(default_factory=dict)
    """Destinations by decode_id, with the registration session (peer) they came in."""
    aborts: dict[str, Abort] = dataclasses.field(default_factory=dict)
    """decode_id -> the aborts that came before the sender."""
    failed: str | None = None
    """Why the cleared sender failed, for destinations that arrive late."""
    answered: dict[str, int] = dataclasses.field(default_factory=dict)
    """decode_id -> the room incarnation (epoch) told of ``failed``, or that aborted itself."""
    required: int | None = None


class EarlyTable:
    def __init__(self, max_rooms: int, ttl_s: float, stats: collections.Counter[str]) -> None:
        self.max_rooms = max_rooms
        self.ttl_s = ttl_s
        self._rooms: collections.OrderedDict[int, EarlyRoom] = collections.OrderedDict()
        self.stats = stats
        """Counts ``early_expired`` and ``early_evicted`` records."""

    def __len__(self) -> int:
        return len(self._rooms)

    def get(self, room: int) -> EarlyRoom | None:
        return self._rooms.get(room)

    def pop(self, room: int) -> EarlyRoom | None:
        return self._rooms.pop(room, None)

    def get_or_add(self, room: int, now: float) -> EarlyRoom | None:
        """The record of ``room``, made if needed. When the table is full the oldest record without
        destinations goes (notices and aborts only make failures faster; a destination is needed
        to transfer at all); None when every record holds destinations."""
        early = self._rooms.get(room)
        if early is not None:
            return early
        self.expire(now)
        if len(self._rooms) >= self.max_rooms:
            victim = next((r for r, e in self._rooms.items() if not e.infos), None)
            if victim is None:
                return None
            del self._rooms[victim]
            self.stats["early_evicted"] += 1
        early = self._rooms[room] = EarlyRoom(now + self.ttl_s)
        return early

    def expire(self, now: float) -> None:
        while self._rooms:
            room, early = next(iter(self._rooms.items()))
            if early.deadline > now:
                return
            del self._rooms[room]
            self.stats["early_expired"] += 1

    def clear(self) -> None:
        self._rooms.clear()

    def next_deadline(self) -> float | None:
        return next(iter(self._rooms.values())).deadline if self._rooms else None
