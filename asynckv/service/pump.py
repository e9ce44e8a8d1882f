"""The pump: feeds one sans-IO core, runs the actions it returns, re-arms its one timer.

Nothing here decides anything about a room; every rule lives in ``asynckv.proto``. The
pump only turns events into core calls (with ``now`` from its clock) and actions into I/O.
Actions run strictly in the order the core produced them, even when running one feeds the
core again (that feed's actions queue behind the rest).
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any, Generic, TypeVar

from ..proto import actions as act
from ..transport.base import ControlPlane
from . import metrics

__all__ = ["Outcome", "Pump", "outcome"]

log = logging.getLogger("asynckv.pump")
T = TypeVar("T")


async def outcome(fut: asyncio.Future[T], timeout: float | None = None) -> T:
    """``fut``'s result, waited for at most ``timeout`` seconds without ever cancelling ``fut`` (a
    waiter that is cancelled or times out leaves the room alone). A room's future that is done
    already is answered at once: the shield and ``wait_for`` cost about 5 us per call."""
    if fut.done():
        return fut.result()
    if timeout is None:
        return await asyncio.shield(fut)
    return await asyncio.wait_for(asyncio.shield(fut), timeout)


class Outcome(Generic[T]):
    """A room's result (ready, initialised, done), set once and awaited by any number of tasks.

    Each waiter awaits a future of its own, set directly with the result, so a waiter that is
    cancelled or times out cancels only its own future and leaves the result alone, as
    ``asyncio.shield`` over one shared future did; a shield relays the result through a callback
    of its own, a loop round later. One await of a result set a round later, uvloop: 4.3 us with a
    shield, 2.5 us this way (asyncio: 9.8 and 5.8 us). Callbacks run as a future's do: from the
    loop, never inside ``set_result``, in the context they were added in, and before the waiters
    resume (as they did behind the shield)."""

    __slots__ = ("_callbacks", "_loop", "_set", "_value", "_waiters")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._set = False
        self._value: T | None = None
        self._waiters: list[asyncio.Future[T]] = []
        self._callbacks: list[tuple[Callable[[T], None], contextvars.Context]] = []

    def done(self) -> bool:
        return self._set

    def result(self) -> T:
        if not self._set:
            raise asyncio.InvalidStateError("result is not set")
        return self._value  # type: ignore[return-value]

    def set_result(self, value: T) -> None:
        if self._set:
            raise asyncio.InvalidStateError("result already set")
        self._set, self._value = True, value
        callbacks, self._callbacks = self._callbacks, []
        for callback, context in callbacks:
            self._loop.call_soon(callback, value, context=context)
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(value)

    def add_done_callback(self, callback: Callable[[T], None]) -> None:
        """Call ``callback(result)`` from the loop once the result is set (soon, if it is)."""
        if self._set:
            self._loop.call_soon(callback, self._value)  # type: ignore[arg-type]
        else:
            self._callbacks.append((callback, contextvars.copy_context()))

    async def wait(self, timeout: float | None = None) -> T:
        """The result, waited for at most ``timeout`` seconds (``TimeoutError`` then)."""
        if self._set:
            return self._value  # type: ignore[return-value]
        waiter: asyncio.Future[T] = self._loop.create_future()
        self._waiters.append(waiter)
        try:
            return await (waiter if timeout is None else asyncio.wait_for(waiter, timeout))
        finally:
            if not self._set:  # (cancelled or timed out: nothing will set this waiter)
                self._waiters.remove(waiter)


async def wait_out(work: asyncio.Future[Any]) -> None:
    """Wait until ``work`` (a worker thread's) is done, through any number of cancels: a cancelled task whose
    thread still uses our memory or tables must not end before it (its owed answer follows its end). A second
    cancel-all used to cut that wait: staged bytes landed in pages whose room had failed, a build thread
    outlived the close, a cancelled peer's rows came back after it was removed. Its error is retrieved (moot
    now; asyncio logged it as never retrieved)."""
    while not work.done():
        try:
            await asyncio.wait([work])
        except asyncio.CancelledError:
            continue
    if not work.cancelled():
        work.exception()


class Pump:
    """Base of the prefill and decode services (one per ``KVManager``)."""

    mode = ""

    def __init__(self, core: Any, control: ControlPlane, labels: tuple[str, str],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.core = core
        self.control = control
        self.clock = clock
        self.labels = labels
        """(mode, manager) metric labels."""
        self.loop = asyncio.get_running_loop()
        self._pending: collections.deque[act.Action] = collections.deque()
        self._flushing = False
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._owed: dict[asyncio.Task[Any], Callable[[], None]] = {}
        self._cancelling = False
        """This service's close cancels its tasks: the core has closed, nothing is owed to it any more."""
        self.closed: asyncio.Future[None] = self.loop.create_future()
        self.handlers: dict[type[act.Action], Callable[[Any], None]] = {
            act.Send: self._on_send, act.ForgetEndpoint: self._on_forget_endpoint, act.PeerUp: self._on_peer_up,
            act.PeerDown: self._on_peer_down, act.Closed: self._on_closed,
        }

    # -- feeding ---------------------------------------------------------------------------

    def feed(self, method: str, *args: Any) -> Any:
        """Call ``core.<method>(*args, now)`` and run the actions it produced."""
        result = getattr(self.core, method)(*args, self.clock())
        self._run()
        return result

    def feed_each(self, method: str, calls: list[tuple[Any, ...]]) -> None:
        """Several calls of one method, then their actions (one flush for a batch of events)."""
        fn = getattr(self.core, method)
        now = self.clock()
        for args in calls:
            fn(*args, now)
        self._run()

    def _run(self) -> None:
        self._pending.extend(self.core.actions())
        if self._flushing:
            return  # the outer run takes them, after what it already had
        self._flushing = True
        try:
            while self._pending:
                action = self._pending.popleft()
                try:
                    self.handlers[type(action)](action)
                except Exception:
                    log.exception("%s: running %s failed", self.mode, type(action).__name__)
                self._pending.extend(self.core.actions())
        finally:
            self._flushing = False
        self._rearm()

    def _rearm(self) -> None:
        when = self.core.get_timer()
        if when == self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_at = when
        if when is not None:
            self._timer = self.loop.call_later(max(0.0, when - self.clock()), self._on_timer)

    def _on_timer(self) -> None:
        due, now = self._timer_at, self.clock()
        self._timer = None
        self._timer_at = None
        self.feed("handle_timer")  # (first: the timer is armed again whatever the metrics do)
        if due is not None:  # how late the loop ran it: its lag, sampled at every tick
            metrics.child(metrics.LOOP_LAG_SECONDS, *self.labels).observe(max(0.0, now - due))

    # -- tasks -------------------------------------------------------------------------------

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str,
              owed: Callable[[], None] | None = None) -> asyncio.Task[Any]:
        """Run ``coro`` as a task of this service. ``owed`` gives the core the answer the task owed it when the
        task is cancelled by anything but this service's own close (a shutdown handler cancelling every task on
        the loop). Without it the core waited for ever: a post never settled, a peer never connected, a look-up
        never answered, and a close then sat out its whole bound (9.5 s) with the room left behind."""
        task = self.loop.create_task(coro, name=name)
        self._tasks.add(task)
        if owed is not None:
            self._owed[task] = owed
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        owed = self._owed.pop(task, None)
        if task.cancelled():
            if owed is not None and not self._cancelling:  # (after the task's own clean-up: its threads ended)
                try:
                    owed()
                except Exception:
                    log.exception("%s: answering for cancelled task %s failed", self.mode, task.get_name())
        elif task.exception() is not None:
            log.error("task %s failed", task.get_name(), exc_info=task.exception())

    @property
    def tasks(self) -> int:
        return len(self._tasks)

    async def close(self, timeout_s: float) -> None:
        """Ask the core to close and wait (at most ``timeout_s``) until it says every write settled."""
        self.feed("close")
        try:
            await asyncio.wait_for(asyncio.shield(self.closed), timeout_s)
        except TimeoutError:
            log.warning("%s: close did not settle within %.1fs; closing anyway", self.mode, timeout_s)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._cancelling = True
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    # -- common actions ------------------------------------------------------------------

    def _on_send(self, a: act.Send) -> None:
        self.control.send(a.endpoint, a.msg, transient=a.transient)

    def _on_forget_endpoint(self, a: act.ForgetEndpoint) -> None:
        self.control.forget(a.endpoint)

    def _on_peer_up(self, a: act.PeerUp) -> None:
        metrics.FIRST_CONTACT_SECONDS.labels(*self.labels, a.peer[:8]).observe(a.seconds)

    def _on_peer_down(self, a: act.PeerDown) -> None:
        log.log(logging.INFO if a.farewell else logging.WARNING, "%s: %s", self.mode, a.error)
        metrics.PEERS_DEAD.labels(*self.labels, type(a.error).__name__).inc()
        metrics.forget_peer(self.labels, a.peer)

    def _on_closed(self, a: act.Closed) -> None:
        if not self.closed.done():
            self.closed.set_result(None)

    def room_finished(self, room: Any, peer: str) -> None:
        """Metrics of a room whose outcome was decided."""
        result = room.poll().name.lower()
        reason = "" if room.exception is None else type(room.exception).__name__
        metrics.child(metrics.ROOMS_FINISHED, *self.labels, result, reason).inc()
        if room.started is not None and room.finished is not None:
            metrics.child(metrics.ROOM_SECONDS, *self.labels, peer, result).observe(room.finished - room.started)
