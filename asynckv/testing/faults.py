"""Fault injection for the NIXL data plane, for faults that cannot be produced for real.

    injector = FaultInjector()
    inject(manager, injector)
    injector.fail_next(1)        # the next post raises TransportError
    injector.stall_next(1)       # the next post never completes: only its deadline ends it
    injector.delay_posts(0.05)   # every post waits 50 ms on the engine thread first

Real faults (a dead or frozen process) come from ``PeerProcess.kill()`` / ``stop()``.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from ..errors import TransportError

__all__ = ["FaultInjector", "inject"]


class FaultInjector:
    """Consulted by the engine thread before every post (thread-safe counters)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fail = 0
        self._stall = 0
        self._delay_s = 0.0
        self.seen: list[str] = []

    def fail_next(self, n: int = 1) -> None:
        with self._lock:
            self._fail += n

    def stall_next(self, n: int = 1) -> None:
        with self._lock:
            self._stall += n

    def delay_posts(self, seconds: float) -> None:
        with self._lock:
            self._delay_s = seconds

    def before_post(self, what: str) -> bool:
        """Called on the engine thread; returns True to stall the post, raises to fail it."""
        with self._lock:
            self.seen.append(what)
            delay = self._delay_s
            if self._fail:
                self._fail -= 1
                raise TransportError(f"{what}: injected failure")
            stall = self._stall > 0
            if stall:
                self._stall -= 1
        if delay:
            time.sleep(delay)
        return stall


def inject(manager: Any, injector: FaultInjector | None) -> None:
    """Install (or with None remove) a fault injector on a started KVManager's data plane."""
    manager._engine.faults = injector
