"""How many items a queue's callback takes a loop round (``pacing.Pacer``), on simulated time: it
doubles while the loop comes back to it within ``SHORT_S``, halves when it comes back later than
``LONG_S``, keeps its number in between, stays within its bounds, and ignores the wait of a turn it
did not schedule itself (an idle queue's first turn). The outbox of settled posts, the stream
reader and the ZMQ reader take what their pacer says (scripted loop rounds)."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from asynckv.proto.messages import Ping, encode, pack
from asynckv.transport.channel import READ_BATCH, READ_BATCH_MAX
from asynckv.transport.commands import Outbox
from asynckv.transport.pacing import LONG_S, SHORT_S, Pacer
from asynckv.transport.stream_conns import HEADER

from .test_outbox import ScriptedLoop
from .test_stream_channel import channel, raw_client
from .waiting import until


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def turns(pacer: Pacer, clock: Clock, waits: list[float]) -> list[int]:
    """The take of each turn, each scheduled by the one before and coming back after its wait."""
    sizes = []
    for wait in waits:
        pacer.scheduled()
        clock.now += wait
        sizes.append(pacer.take())
    return sizes


def test_short_rounds_double_the_take_up_to_most_and_long_ones_halve_it_down_to_least() -> None:
    clock = Clock()
    pacer = Pacer(2, 16, clock)
    assert pacer.take() == 2  # (a first turn nobody scheduled: nothing measured)
    short, long_ = SHORT_S / 2, LONG_S * 2
    assert turns(pacer, clock, [short] * 5) == [4, 8, 16, 16, 16]
    assert turns(pacer, clock, [long_] * 4) == [8, 4, 2, 2]
    between = (SHORT_S + LONG_S) / 2
    assert turns(pacer, clock, [short, between, between, long_, between]) == [4, 4, 4, 2, 2]


def test_the_wait_of_a_turn_not_scheduled_by_the_last_one_counts_for_nothing() -> None:
    clock = Clock()
    pacer = Pacer(4, 16, clock)
    assert turns(pacer, clock, [0.0]) == [8]
    clock.now += 10.0  # the queue ran dry and sat idle; then an item came and woke a fresh turn
    assert pacer.take() == 8
    pacer.scheduled()
    clock.now += LONG_S * 2
    assert pacer.take() == 4
    assert pacer.take() == 4  # (each wait is counted once)


def test_bounds_are_checked() -> None:
    for least, most in [(0, 4), (4, 2), (-1, -1)]:
        with pytest.raises(ValueError, match="least <= most"):
            Pacer(least, most)
    assert Pacer(3, 3).take() == 3


def test_the_outbox_takes_more_a_round_while_the_loop_comes_back_fast_and_fewer_when_slow() -> None:
    loop, clock = ScriptedLoop(), Clock()
    taken: list[list[int]] = []
    box = Outbox(loop, taken.append, 4, 16, clock)  # type: ignore[arg-type]
    box.put(list(range(100)))
    sizes = []
    while loop.round():
        sizes.append(len(taken[-1]))
        clock.now += SHORT_S / 2  # each round short
    assert sizes == [4, 8, 16, 16, 16, 16, 16, 8]
    assert [x for batch in taken for x in batch] == list(range(100))  # every item once, in order
    taken.clear()
    box.put(list(range(60)))
    sizes = []
    while loop.round():
        sizes.append(len(taken[-1]))
        clock.now += LONG_S * 2  # each round long
    assert sizes == [16, 8] + [4] * 9  # (the idle queue's first turn kept the take)
    assert [x for batch in taken for x in batch] == list(range(60))


def test_an_outbox_without_most_takes_batch_whatever_the_rounds() -> None:
    loop, clock = ScriptedLoop(), Clock()
    taken: list[list[int]] = []
    box = Outbox(loop, taken.append, 4, clock=clock)  # type: ignore[arg-type]
    box.put(list(range(20)))
    while loop.round():
        assert len(taken[-1]) == 4


def frames(n: int) -> bytes:
    one = pack(encode(Ping("p" * 8, "tcp://127.0.0.1:1", 1, 1)))
    return (HEADER.pack(len(one)) + one) * n


@pytest.mark.parametrize("wait", [SHORT_S / 2, LONG_S * 2])
async def test_the_stream_reader_reads_what_its_pacer_says(wait: float) -> None:
    """A connection's queued messages are read ``READ_BATCH`` a turn, up to ``READ_BATCH_MAX``
    while its turns come back fast, on a clock the test moves between the reader's turns."""
    clock = Clock()
    got: list[object] = []
    async with channel(got) as rx:
        _, writer = await raw_client(rx.endpoint, b"")
        await until(lambda: len(rx._inbound) == 1, "the connection")
        (conn,) = rx._inbound
        conn._pacer = Pacer(READ_BATCH, READ_BATCH_MAX, clock)
        writer.write(frames(30))
        await writer.drain()
        seen: list[int] = []
        while len(got) < 30:
            seen.append(len(got))
            clock.now += wait
            await asyncio.sleep(0)
            assert len(seen) < 10_000
        seen.append(len(got))
        steps = [b - a for a, b in itertools.pairwise(seen) if b > a]
        assert max(steps) == (READ_BATCH_MAX if wait < SHORT_S else READ_BATCH), steps
        writer.close()
