"""Deadlines of many objects behind one timer (the pump re-arms a single loop timer).

Each owner keeps its one current deadline in ``owner.deadline``; re-arming pushes a new
heap entry and leaves the old one stale. Stale entries are skipped when they reach the top
and swept out when they outnumber the live ones, so millions of re-armed rooms cost
``O(log n)`` each and bounded memory.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Any, Protocol

__all__ = ["Deadlines", "Timed", "earliest"]


def earliest(a: float | None, b: float | None) -> float | None:
    """The earlier of two optional times (a core's ``get_timer`` runs after every event it is fed)."""
    if a is None:
        return b
    return a if b is None or a <= b else b


class Timed(Protocol):
    deadline: float | None


class Deadlines:
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Any]] = []
        self._seq = itertools.count()
        self._sweep_at = 1024

    def __len__(self) -> int:
        return len(self._heap)

    def arm(self, owner: Timed, when: float | None) -> None:
        """Set (or with None cancel) ``owner``'s deadline."""
        owner.deadline = when
        if when is None:
            return
        heapq.heappush(self._heap, (when, next(self._seq), owner))
        if len(self._heap) > self._sweep_at:
            self._heap = [e for e in self._heap if e[2].deadline == e[0]]
            heapq.heapify(self._heap)
            self._sweep_at = max(1024, 2 * len(self._heap))

    def next(self) -> float | None:
        """The earliest live deadline, or None."""
        heap = self._heap
        while heap and heap[0][2].deadline != heap[0][0]:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def pop_due(self, now: float) -> list[Any]:
        """Owners whose deadline passed (their deadline is cleared), earliest first."""
        due = []
        heap = self._heap
        while heap and heap[0][0] <= now:
            when, _, owner = heapq.heappop(heap)
            if owner.deadline == when:
                owner.deadline = None
                due.append(owner)
        return due
