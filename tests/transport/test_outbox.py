"""The outbox that hands settled posts from an engine thread to the loop: every item is taken
once, in order, at most ``batch`` per loop round, with one wake-up per drain (scripted against a
recording loop), and nothing is stranded when puts race the drain (a real thread and loop)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

from asynckv.transport.commands import Outbox


class ScriptedLoop:
    """Records what is scheduled; the test runs the callbacks itself, one loop round at a time."""

    def __init__(self) -> None:
        self.threadsafe: list[Callable[[], None]] = []
        self.soon: list[Callable[[], None]] = []

    def call_soon_threadsafe(self, fn: Callable[[], None]) -> None:
        self.threadsafe.append(fn)

    def call_soon(self, fn: Callable[[], None]) -> None:
        self.soon.append(fn)

    def round(self) -> int:
        """Run what is scheduled now (what it schedules waits for the next round)."""
        due, self.threadsafe, self.soon = self.threadsafe + self.soon, [], []
        for fn in due:
            fn()
        return len(due)


def scripted(batch: int) -> tuple[ScriptedLoop, Outbox, list[list[int]]]:
    loop = ScriptedLoop()
    taken: list[list[int]] = []
    return loop, Outbox(loop, taken.append, batch), taken  # type: ignore[arg-type]


def test_puts_before_a_drain_share_one_wake_up_and_rounds_take_at_most_batch() -> None:
    loop, box, taken = scripted(4)
    box.put([1, 2, 3])
    box.put([4, 5])
    box.put([6])
    assert len(loop.threadsafe) == 1  # one wake-up for the three puts
    assert loop.round() == 1 and taken == [[1, 2, 3, 4]]
    assert loop.threadsafe == [] and len(loop.soon) == 1  # the rest waits for the next round
    box.put([7])  # (the drain is due already: no second wake-up)
    assert loop.threadsafe == []
    assert loop.round() == 1 and taken == [[1, 2, 3, 4], [5, 6, 7]]
    assert loop.round() == 0  # nothing left, nothing scheduled


def test_a_put_during_the_take_is_taken_by_the_drain_it_schedules() -> None:
    """The take callback runs after the drain decided whether to come back: a put made inside it
    (as the engine thread may, between the GIL switches) must schedule its own drain."""
    loop, taken = ScriptedLoop(), []
    box: Outbox

    def take(items: list[Any]) -> None:
        taken.append(items)
        if items == [1]:
            box.put([2])

    box = Outbox(loop, take, 4)  # type: ignore[arg-type]
    box.put([1])
    loop.round()
    assert len(loop.threadsafe) == 1
    loop.round()
    assert taken == [[1], [2]] and loop.round() == 0


def test_a_put_after_the_flag_cleared_but_before_the_take_is_not_stranded() -> None:
    """Interleaving: the drain clears its flag, then the thread puts (seeing no drain due, it
    schedules one), then the drain takes. The item is taken now; the extra drain finds nothing."""
    loop, box, taken = scripted(4)
    box.put([1])
    drain = loop.threadsafe.pop()
    box._due = False  # (the first statement of _drain)
    box.put([2])
    drain()
    loop.round()
    assert taken == [[1, 2]]  # (the extra drain found nothing and took nothing)
    assert loop.round() == 0


async def test_a_thread_hammering_puts_loses_and_repeats_nothing() -> None:
    loop = asyncio.get_running_loop()
    taken: list[int] = []
    box = Outbox(loop, taken.extend, 4)
    n = 20_000

    def producer() -> None:
        for i in range(0, n, 3):
            box.put(list(range(i, min(i + 3, n))))

    thread = threading.Thread(target=producer)
    thread.start()

    async def all_taken() -> None:
        while len(taken) < n:
            await asyncio.sleep(0.0005)

    await asyncio.wait_for(all_taken(), 30)
    thread.join()
    await asyncio.sleep(0.01)  # (anything extra would be taken by now)
    assert taken == list(range(n))
