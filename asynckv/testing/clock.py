"""A clock tests move by hand."""

from __future__ import annotations

__all__ = ["ManualClock"]


class ManualClock:
    """Monotonic seconds that only move when told: ``clock()`` reads, ``advance()`` moves."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        if seconds < 0:
            raise ValueError("a monotonic clock does not go back")
        self.now += seconds
        return self.now

    def advance_ms(self, ms: float) -> float:
        return self.advance(ms / 1000)
