"""``LoopThread``: the one event loop a synchronous process (SGLang's scheduler) runs asynckv on."""

from __future__ import annotations

import threading

import pytest

from asynckv.integrations.loop_thread import LoopThread

from .transport.test_nixl_plane import FakeAgent, started


def test_calls_submitted_in_order_run_in_order_and_run_returns_a_result() -> None:
    lt = LoopThread("test-loop")
    seen: list[int] = []
    for i in range(50):
        lt.submit(seen.append, i)

    async def last() -> list[int]:
        return list(seen)
    assert lt.run(last(), 5) == list(range(50))


def test_a_loop_thread_that_ends_closes_its_loop_so_the_engines_on_it_stop(monkeypatch: pytest.MonkeyPatch) -> None:
    """Something escaping a callback (KeyboardInterrupt, SystemExit) ends ``run_forever``. The loop
    used to stay stopped but open: the managers' engine threads on it polled for ever, none of them
    told, while ``shared()`` quietly started another loop. Closed, the engines see it and stop."""
    died: list[type[BaseException]] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: died.append(args.exc_type))
    lt = LoopThread("test-loop")
    agent = FakeAgent()
    plane, _ = lt.run(started(agent), 5)

    def escape() -> None:
        raise KeyboardInterrupt
    lt.submit(escape)
    lt._thread.join(5)
    assert died == [KeyboardInterrupt] and lt.loop.is_closed() and not lt.alive
    assert plane._thread is not None
    plane._thread.join(5)
    assert not plane._thread.is_alive() and plane.thread_error is None  # (it kept its memory: see test_nixl_plane)
