"""``CloseOnce``: a close runs once, as a task; callers giving up cut nothing; a close whose own task
was cancelled (a cancel-all on the loop) resumes at the next call. Scripted with events, no sleeps."""

from __future__ import annotations

import asyncio
import sys

import pytest

from asynckv.transport.closing import CloseOnce


class Steps:
    """A close of three steps, each held at an event until the test lets it go."""

    def __init__(self) -> None:
        self.gates = [asyncio.Event() for _ in range(3)]
        self.at = [asyncio.Event() for _ in range(3)]
        self.done: list[int] = []
        self.runs = 0

    async def close(self) -> None:
        self.runs += 1
        for i in range(len(self.done), 3):  # (from the first step not done: each step can run again)
            self.at[i].set()
            await self.gates[i].wait()
            self.done.append(i)

    def open_all(self) -> None:
        for gate in self.gates:
            gate.set()


async def test_a_second_close_waits_for_the_first_and_the_close_runs_once() -> None:
    steps = Steps()
    closer = CloseOnce(steps.close)
    first, second = asyncio.ensure_future(closer()), asyncio.ensure_future(closer())
    steps.gates[0].set()
    await steps.at[1].wait()
    assert not first.done() and not second.done() and closer.begun and not closer.finished
    steps.open_all()
    await asyncio.gather(first, second)
    assert steps.runs == 1 and steps.done == [0, 1, 2] and closer.finished
    await closer()  # (finished: returns at once, runs nothing)
    assert steps.runs == 1


async def test_a_caller_that_gives_up_cuts_nothing_short() -> None:
    steps = Steps()
    closer = CloseOnce(steps.close)
    caller = asyncio.ensure_future(closer())
    await steps.at[0].wait()
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert closer.task is not None and not closer.task.done()  # (it goes on)
    steps.open_all()
    await closer()
    assert steps.runs == 1 and steps.done == [0, 1, 2]


@pytest.mark.parametrize("cut_at", [0, 1, 2])
async def test_a_cancel_all_that_cuts_the_close_leaves_the_next_close_to_resume_it(cut_at: int) -> None:
    """Every task on the loop cancelled while the close waits in step ``cut_at``: its caller and its
    own task. Before, every later close raised ``CancelledError`` for good (half closed)."""
    steps = Steps()
    closer = CloseOnce(steps.close)
    caller = asyncio.ensure_future(closer())
    for i in range(cut_at):
        steps.gates[i].set()
    await steps.at[cut_at].wait()
    first = closer.task
    assert first is not None
    caller.cancel()
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert first.cancelled() and steps.done == list(range(cut_at)) and not closer.finished
    steps.open_all()
    await closer()
    assert closer.task is not first and closer.finished
    assert steps.runs == 2 and steps.done == [0, 1, 2]  # (each step once: the second run took up at cut_at)


async def test_a_close_cancelled_before_it_ran_at_all_runs_at_the_next_call() -> None:
    steps = Steps()
    closer = CloseOnce(steps.close)
    caller = asyncio.ensure_future(closer())
    await asyncio.sleep(0)  # (the caller made the task; it has not run yet)
    assert closer.task is not None and steps.runs == 0
    closer.task.cancel()
    caller.cancel()
    await asyncio.gather(caller, return_exceptions=True)
    steps.open_all()
    await closer()
    assert steps.runs == 1 and steps.done == [0, 1, 2]


@pytest.mark.skipif(sys.version_info < (3, 11), reason="Task.cancelling() tells a caller's own cancel apart (3.11)")
async def test_a_caller_not_cancelled_itself_sees_the_close_through_when_only_its_task_is_cancelled() -> None:
    steps = Steps()
    closer = CloseOnce(steps.close)
    caller = asyncio.ensure_future(closer())
    steps.gates[0].set()
    await steps.at[1].wait()
    first = closer.task
    assert first is not None
    first.cancel()  # (only the close's task: its caller still waits for a closed part)
    await asyncio.sleep(0)
    await steps.at[1].wait()
    steps.open_all()
    await caller  # (no CancelledError: it started the close again)
    assert closer.task is not first and closer.finished and steps.done == [0, 1, 2] and steps.runs == 2


async def test_a_failed_close_is_finished_and_raises_its_error_to_every_caller() -> None:
    async def boom() -> None:
        raise OSError("broken")

    closer = CloseOnce(boom)
    with pytest.raises(OSError, match="broken"):
        await closer()
    assert closer.finished
    with pytest.raises(OSError, match="broken"):
        await closer()  # (not run again)
