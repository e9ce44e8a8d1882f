"""A close that runs once, as a task, and outlives whoever asked for it.

The manager, the data plane and the control channels each close through one ``CloseOnce``:

- a second ``close()`` waits for the first (its caller may then free the registered memory);
- a caller that gives up (``wait_for`` timing out, its task cancelled) cuts nothing short: the
  close goes on;
- a close whose own task was cancelled (a shutdown handler cancelling every task on the loop
  reaches it too) starts again at the next ``close()``, from the step it had reached. Each
  close is written so that its step cut short can run again. Before, every later ``close()``
  raised ``CancelledError`` and the part stayed half closed for good: engine threads polling,
  sockets and memory held.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

__all__ = ["CloseOnce"]


class CloseOnce:
    def __init__(self, close: Callable[..., Coroutine[Any, Any, None]]) -> None:
        self._close = close
        self.task: asyncio.Task[None] | None = None

    @property
    def begun(self) -> bool:
        return self.task is not None

    @property
    def finished(self) -> bool:
        """The close ran to its end (or failed): not cut short."""
        return self.task is not None and self.task.done() and not self.task.cancelled()

    async def __call__(self, *args: Any) -> None:
        """Close (``args`` go to the close this call starts, if it starts one)."""
        while True:
            if self.task is None or self.task.cancelled():
                self.task = asyncio.ensure_future(self._close(*args))
            task = self.task
            try:
                await asyncio.shield(task)
                return
            except asyncio.CancelledError:
                me = asyncio.current_task()
                cancelling = getattr(me, "cancelling", None)  # (3.11: whether our caller itself is cancelled)
                if not task.cancelled() or cancelling is None or cancelling():
                    raise
                # Only the close's own task was cancelled: our caller still wants it closed; start it again.
