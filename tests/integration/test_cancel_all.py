"""A shutdown handler that cancels every task on the loop, then closes the managers: the pattern of
many serving stacks' SIGTERM handlers. Over real NIXL, control channels and bootstrap servers.

Before: a close cut by such a cancel-all left its manager half closed for good (every later
``close()`` raised ``CancelledError``; engine threads polled on, sockets and memory held), and a
prefill hosting the bootstrap server spent the HTTP timeout (5 s) unregistering from its own
server, whose handlers the cancel-all had ended. Also here: a close step that fails no longer ends
the close there."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from asynckv import KVManager, KVPoll
from asynckv.testing import fill_pages

from .conftest import Pair, check_landed, make_pair, transfer_room

PREFILL_STEPS = ("_close_service", "_unregister", "_http", "_control", "_data", "bootstrap_server")
DECODE_STEPS = PREFILL_STEPS[:-1]


async def cancel_all_but_me(before_waiting: Callable[[], None] = lambda: None) -> None:
    me = asyncio.current_task()
    others = [task for task in asyncio.all_tasks() if task is not me]
    for task in others:
        task.cancel()
    before_waiting()
    await asyncio.gather(*others, return_exceptions=True)


def assert_released(mgr: KVManager) -> None:
    """Closed to its end: engine threads gone, every channel and server closed, no room left."""
    assert mgr._closer.finished and not mgr.healthy
    assert not mgr.data_plane.alive
    engines = [t.name for t in threading.enumerate() if t.name.startswith("asynckv-nixl-") and mgr.name[:8] in t.name]
    assert not engines, engines
    control = mgr._control
    assert control is not None and control._closed and not control.reader_alive  # type: ignore[attr-defined]
    assert getattr(control, "_server", None) is None and getattr(control, "_ctx", None) is None
    assert mgr._http._session is None
    if mgr.bootstrap_server is not None:
        assert mgr.bootstrap_server._http is None
    assert all(count == 0 for count in mgr.room_counts().values()), mgr.room_counts()


def hold_step(mgr: KVManager, step: str, monkeypatch: pytest.MonkeyPatch) -> asyncio.Event:
    """Make ``step`` of ``mgr``'s close wait (as one waiting on a stalled peer would); returns the event
    set once the close is in it."""
    held = asyncio.Event()

    async def hold(*args: Any) -> None:
        held.set()
        await asyncio.Event().wait()
    if step.startswith("_close") or step == "_unregister":
        monkeypatch.setattr(mgr, step, hold)
    else:
        monkeypatch.setattr(getattr(mgr, step), "close", hold)
    return held


@pytest.mark.parametrize("side, step", [*(("prefill", s) for s in PREFILL_STEPS),
                                        *(("decode", s) for s in DECODE_STEPS)])
async def test_a_close_cut_by_a_cancel_all_at_any_step_is_finished_by_the_next_close(
        side: str, step: str, monkeypatch: pytest.MonkeyPatch) -> None:
    async with make_pair() as pair:
        assert await transfer_room(pair, 1, [1, 2], [3, 4]) == (KVPoll.Success, KVPoll.Success)
        mgr = getattr(pair, side)
        held = hold_step(mgr, step, monkeypatch)
        closing = asyncio.ensure_future(mgr.close())
        await held.wait()
        await cancel_all_but_me()
        assert closing.cancelled() and mgr._closer.task is not None and mgr._closer.task.cancelled()
        assert not mgr._closer.finished
        monkeypatch.undo()  # (the step no longer waits)
        await asyncio.wait_for(mgr.close(), 10)
        assert_released(mgr)
        await asyncio.wait_for(mgr.close(), 1)  # (finished: at once)


async def test_managers_closed_after_a_cancel_all_close_at_once_and_release_everything() -> None:
    """The shutdown handler's order: cancel everything, then close. The prefill hosting the bootstrap
    server no longer asks its own server (whose handlers are cancelled) to unregister it."""
    async with make_pair() as pair:
        assert await transfer_room(pair, 1, [1, 2], [3, 4]) == (KVPoll.Success, KVPoll.Success)
        check_landed(pair, 1, [3, 4])
        await cancel_all_but_me()
        started = time.monotonic()
        await asyncio.wait_for(pair.prefill.close(), 10)
        await asyncio.wait_for(pair.decode.close(), 10)
        assert time.monotonic() - started < 3.0  # (before: 5 s, the HTTP timeout, on the unregister)
        for mgr in (pair.prefill, pair.decode):
            assert_released(mgr)


async def test_a_decode_close_cut_while_it_fences_a_room_resumes_and_fails_the_room(pair_fast_fence: Pair) -> None:
    """Cut inside the service's close: the decode fails its waiting room and waits for the prefill to
    fence it, the prefill not reading (stopped reader), and a cancel-all comes. The next close waits out
    the rest of the bound and ends with the room failed and everything released."""
    pair = pair_fast_fence
    receiver = pair.decode.receiver(pair.addr, 7)
    assert await receiver.init([5, 6], -1) == KVPoll.WaitingForInput
    pair.prefill._control.stop_reader()  # type: ignore[union-attr]
    closing = asyncio.ensure_future(pair.decode.close())
    svc = pair.decode._svc
    assert svc is not None
    for _ in range(100):
        await asyncio.sleep(0.01)
        if svc.core.fencing:  # type: ignore[union-attr]
            break
    assert svc.core.fencing and not closing.done()  # type: ignore[union-attr]
    await cancel_all_but_me()
    assert not pair.decode._closer.finished
    await asyncio.wait_for(pair.decode.close(), pair.decode.config.close_bound_s + 5)
    assert receiver.poll() == KVPoll.Failed and "closed" in str(receiver.failure_reason)
    assert_released(pair.decode)


OWED = {
    "build": "the write was cancelled while its descriptors were built",
    "check": "its destination check was cancelled",
    "connect": "connecting decode peer",
    "fetch": "the topology look-up was cancelled",
}


@pytest.mark.parametrize("work", list(OWED))
async def test_a_cancel_all_on_the_services_own_work_still_decides_the_room_and_closes_at_once(
        work: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cancel-all comes (no close running) while a service task the core waits on is at work: a
    large write's descriptors built off the loop, a destination checked off the loop, a decode peer
    being connected, a topology look-up. Before, the core never heard back: the room stayed open, the
    prefill's close sat out its whole bound (9.5 s, the room left behind) and the decode heard of it
    only from missed heartbeats, or a look-up stayed in the decode's tables. Now the cancelled task's
    answer is given: the room fails with the reason, and both close in milliseconds."""
    from asynckv.proto.destinations import CheckDestination
    from asynckv.service.writes import WriteBuilder

    entered, go = threading.Event(), threading.Event()

    def held(real: Any) -> Any:
        def run(*args: Any) -> Any:
            if threading.current_thread() is not threading.main_thread():  # (the worker threads only)
                entered.set()
                go.wait(10)
            return real(*args)
        return run
    async with make_pair(offload_min_descs=1) as pair:
        if work == "fetch":
            async def stalled(*args: Any) -> Any:  # (a bootstrap server that never answers)
                entered.set()
                await asyncio.Event().wait()
            monkeypatch.setattr(pair.decode._http, "fetch_instance", stalled)
        else:
            target = {"build": (WriteBuilder, "build"), "check": (CheckDestination, "run"),
                      "connect": (WriteBuilder, "add_peer")}[work]
            monkeypatch.setattr(*target, held(getattr(*target)))
        fill_pages(pair.ppool, 1, np.arange(8))
        receiver = pair.decode.receiver(pair.addr, 1)
        sender = pair.prefill.sender(1)
        init = asyncio.ensure_future(receiver.init(np.arange(8, 16), -1))
        ours: list[asyncio.Future[Any]] = [init]
        if work == "build":
            assert await init == KVPoll.WaitingForInput and await sender.wait_ready(10) == KVPoll.WaitingForInput
            sender.init(8, -1)
            ours.append(asyncio.ensure_future(sender.send(np.arange(8))))
        for _ in range(1000):
            if entered.is_set():
                break
            await asyncio.sleep(0.005)
        assert entered.is_set()
        await cancel_all_but_me(go.set)  # (then the thread's work ends: a cancelled task waits for it to end)
        assert all(task.done() for task in ours)
        assert await asyncio.wait_for(receiver.wait(), 5) == KVPoll.Failed
        assert OWED[work] in str(receiver.failure_reason), receiver.failure_reason
        if work == "connect":  # (the thread adding its rows ended before the answer removed them: none came back)
            builder = pair.prefill._svc.builder  # type: ignore[union-attr]
            await asyncio.sleep(0.05)
            assert pair.decode.name not in builder._peers
        started = time.monotonic()
        await asyncio.wait_for(pair.prefill.close(), 10)
        await asyncio.wait_for(pair.decode.close(), 10)
        assert time.monotonic() - started < 3.0  # (before: the prefill's 9.5 s bound, for build and connect)
        for mgr in (pair.prefill, pair.decode):
            assert_released(mgr)


@pytest.mark.parametrize("step", ["_unregister", "_http", "_control"])
async def test_a_close_step_that_fails_is_logged_and_the_rest_still_run(
        step: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Before, the first step to raise ended the close there: the data plane's engine threads, the
    control channel and the servers stayed open for good, and a second close returned at once."""
    caplog.set_level(logging.ERROR, logger="asynckv.manager")
    async with make_pair() as pair:
        assert await transfer_room(pair, 1, [1, 2], [3, 4]) == (KVPoll.Success, KVPoll.Success)
        mgr = pair.prefill

        async def broken(*args: Any) -> None:
            raise OSError("injected")
        if step == "_unregister":
            monkeypatch.setattr(mgr, step, broken)
        else:
            monkeypatch.setattr(getattr(mgr, step), "close", broken)
        await asyncio.wait_for(mgr.close(), 10)
        monkeypatch.undo()
        assert [r.getMessage() for r in caplog.records if "closing" in r.getMessage()] == [
            f"prefill manager {mgr.name[:8]}: closing (test_a_close_step_that_fails_is_logged_and_the_rest_still_run."
            f"<locals>.broken) failed"]
        if step == "_http":
            await mgr._http.close()  # (the one step the injected failure skipped)
        if step == "_control":
            await mgr.control.close()
        assert_released(mgr)


@pytest.fixture
async def pair_fast_fence() -> Any:
    async with make_pair(fence_timeout_s=0.5, heartbeat_interval_s=0.1, heartbeat_max_failures=3) as pair:
        yield pair
