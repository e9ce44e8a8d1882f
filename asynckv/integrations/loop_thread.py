"""One asyncio event loop on a daemon thread, for processes whose own code is synchronous.

A synchronous scheduler (SGLang's) hands work to asynckv without waiting: ``submit`` queues a
callable for the loop (first in, first out, so calls made in order run in order), and
``run`` blocks for a coroutine's result only where blocking is fine (start-up, shutdown).
Everything asynckv owns (managers, their tasks, their NIXL engine threads) lives on this loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["LoopThread"]

T = TypeVar("T")


class LoopThread:
    """An event loop running forever on its own daemon thread (one per process: ``shared()``)."""

    _shared: LoopThread | None = None
    _shared_lock = threading.Lock()

    def __init__(self, name: str = "asynckv-loop") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @classmethod
    def shared(cls) -> LoopThread:
        """The process's loop thread, started on first use."""
        with cls._shared_lock:
            if cls._shared is None or not cls._shared._thread.is_alive():
                cls._shared = cls()
            return cls._shared

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:  # (ended, by whatever escaped a callback: closed, so what lives on it sees that it is gone)
            self.loop.close()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self.loop.is_closed()

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the loop soon, after everything submitted before it; never blocks."""
        self.loop.call_soon_threadsafe(fn, *args)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result (from any thread but the loop's)."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("LoopThread.run() called from its own loop: it would wait forever")
        future: concurrent.futures.Future[T] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return future.result(timeout)
