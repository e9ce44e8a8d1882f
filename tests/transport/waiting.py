"""Waiting in tests for a condition that real sockets make true a little later."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


async def until(cond: Callable[[], object], what: str, timeout_s: float = 10.0) -> None:
    """Poll ``cond`` every millisecond; fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.001)
