"""Rate-limited warnings: what a peer can make a rank log stays bounded."""

from __future__ import annotations

import logging
import time

__all__ = ["RateLimitedLog"]


class RateLimitedLog:
    """Logs at most ``burst`` lines per ``period_s`` per key; counts what it suppressed."""

    def __init__(self, logger: logging.Logger, period_s: float = 10.0, burst: int = 5) -> None:
        self._log = logger
        self._period = period_s
        self._burst = burst
        self._window: dict[str, tuple[float, int]] = {}
        self.suppressed = 0

    def warning(self, key: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        start, count = self._window.get(key, (now, 0))
        if now - start > self._period:
            start, count = now, 0
        if count < self._burst:
            self._log.warning(msg, *args)
        else:
            self.suppressed += 1
        self._window[key] = (start, count + 1)
        if len(self._window) > 1024:
            self._window.clear()
