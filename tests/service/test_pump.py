"""The pump runs a core's actions strictly in order and re-arms one timer from the core's clock."""

from __future__ import annotations

import asyncio
import collections
import contextvars
from typing import Any, cast

import pytest

from asynckv.proto import actions as act
from asynckv.proto.messages import Bye
from asynckv.service.pump import Outcome, Pump, wait_out
from asynckv.testing import ManualClock


class FakeCore:
    def __init__(self) -> None:
        self.out: list[act.Action] = []
        self.calls: list[tuple[str, float]] = []
        self.timer: float | None = None

    def actions(self) -> list[act.Action]:
        out, self.out = self.out, []
        return out

    def get_timer(self) -> float | None:
        return self.timer

    def poke(self, tag: str, now: float) -> None:
        self.calls.append((tag, now))
        self.out += [act.Send(f"tcp://{tag}:{i}", Bye("x", 0, f"{tag}-{i}")) for i in (1, 2)]

    def handle_timer(self, now: float) -> None:
        self.calls.append(("timer", now))
        self.timer = None


class FakeControl:
    def __init__(self) -> None:
        self.sent: list[str] = []
        self.dropped: collections.Counter[str] = collections.Counter()

    def send(self, endpoint: str, msg: Any, transient: bool = False) -> None:
        self.sent.append(msg.reason)


async def test_actions_run_in_order_even_when_running_one_feeds_the_core_again() -> None:
    core, control = FakeCore(), FakeControl()
    pump = Pump(core, control, ("prefill", "test"), clock=ManualClock(5.0))  # type: ignore[arg-type]
    original = pump.handlers[act.Send]

    def send_then_feed(a: act.Send) -> None:
        original(a)
        if cast(Bye, a.msg).reason == "a-1":  # running a-1 feeds the core: its actions queue behind a-2
            pump.feed("poke", "b")

    pump.handlers[act.Send] = send_then_feed
    pump.feed("poke", "a")
    assert control.sent == ["a-1", "a-2", "b-1", "b-2"]
    assert core.calls == [("a", 5.0), ("b", 5.0)]  # every call gets the pump's clock


async def test_the_one_timer_follows_the_cores_deadline_and_gets_the_clocks_time() -> None:
    core, clock = FakeCore(), ManualClock(100.0)
    pump = Pump(core, FakeControl(), ("decode", "test"), clock=clock)  # type: ignore[arg-type]
    core.timer = 100.05
    pump.feed("poke", "a")  # re-arms: fires 50 ms later
    core.timer = 100.02
    pump.feed("poke", "b")  # an earlier deadline re-arms it again
    await asyncio.sleep(0.005)
    assert [c for c in core.calls if c[0] == "timer"] == []
    clock.advance(0.02)
    await asyncio.sleep(0.05)
    assert [c for c in core.calls if c[0] == "timer"] == [("timer", 100.02)]
    await asyncio.sleep(0.05)
    assert len([c for c in core.calls if c[0] == "timer"]) == 1  # the later one was replaced, not kept


async def test_a_cancelled_or_timed_out_waiter_of_an_outcome_leaves_the_result_to_the_others() -> None:
    loop = asyncio.get_running_loop()
    result: Outcome[str] = Outcome(loop)
    seen: list[str] = []
    result.add_done_callback(seen.append)
    cancelled, patient = loop.create_task(result.wait()), loop.create_task(result.wait())
    with_timeout = loop.create_task(result.wait(timeout=0.001))
    await asyncio.sleep(0)  # (all three wait now)
    cancelled.cancel()
    await asyncio.sleep(0.01)
    assert cancelled.cancelled() and isinstance(with_timeout.exception(), TimeoutError)
    assert not result.done() and len(result._waiters) == 1  # (the two that left took their waiters along)
    result.set_result("done")
    assert seen == []  # (callbacks run from the loop, never inside set_result)
    assert await patient == "done" and seen == ["done"] and result.result() == "done"
    assert await result.wait() == "done" and result._waiters == []


async def test_an_outcome_is_set_once_and_reports_a_missing_result() -> None:
    loop = asyncio.get_running_loop()
    result: Outcome[int] = Outcome(loop)
    with pytest.raises(asyncio.InvalidStateError):
        result.result()
    result.set_result(1)
    with pytest.raises(asyncio.InvalidStateError):
        result.set_result(2)
    late: list[int] = []
    result.add_done_callback(late.append)  # (set already: called soon, from the loop)
    assert late == []
    await asyncio.sleep(0)
    assert late == [1] and result.result() == 1


TAG: contextvars.ContextVar[str] = contextvars.ContextVar("tag", default="none")


async def test_outcome_callbacks_run_in_the_context_they_were_added_in_before_the_waiters_resume() -> None:
    loop = asyncio.get_running_loop()
    result: Outcome[int] = Outcome(loop)
    order: list[str] = []

    async def waiter() -> None:
        await result.wait()
        order.append("waiter resumed")

    task = loop.create_task(waiter())
    await asyncio.sleep(0)
    TAG.set("registrant")
    result.add_done_callback(lambda _: order.append(f"callback in {TAG.get()}"))
    TAG.set("setter")
    result.set_result(1)
    await task
    assert order == ["callback in registrant", "waiter resumed"]  # (as a future's callbacks, behind a shield)


async def test_wait_out_holds_a_cancelled_task_until_its_thread_ended_through_any_number_of_cancels() -> None:
    """A service task cancelled while its worker thread still uses our memory must end after the thread:
    its owed answer follows its end. A second cancel-all used to cut that wait (staged bytes landed in
    pages whose room had failed; a cancelled peer's rows came back after it was removed)."""
    import threading

    loop = asyncio.get_running_loop()
    go = threading.Event()

    def thread_work() -> None:
        go.wait(5)
        raise KeyError("moot")  # (retrieved by wait_out: asyncio logged it as never retrieved)
    work = loop.run_in_executor(None, thread_work)
    ended: list[bool] = []

    async def task_body() -> None:
        try:
            await asyncio.shield(work)
        except asyncio.CancelledError:
            await wait_out(work)
            ended.append(work.done())
            raise
    task = asyncio.ensure_future(task_body())
    await asyncio.sleep(0)
    for _ in range(3):  # (three cancel-alls, each once the task waits again)
        task.cancel()
        for _ in range(3):
            await asyncio.sleep(0)
        assert not task.done()
    go.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.cancelled() and ended == [True]
    assert work.done() and work._log_traceback is False
