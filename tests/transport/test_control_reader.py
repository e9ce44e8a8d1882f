"""The control channel's reader, a callback on ZMQ's fd: every message is handled once and in
order, at most ``READ_BATCH_MAX`` (twice that when a new message comes mid-round) per loop round, a
message that comes after the queue ran dry is still read (ZMQ's fd only signals changes), and
nothing is read once the reader is stopped or the channel closed. It survives a failing receive,
a bug and a ``BaseException`` escaping at any step; it stops for good when its socket is gone; a
stopped or closed channel never touches an fd again. Real ZMQ sockets on loopback; the faults a
live socket cannot produce are injected."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import itertools
import json
import logging
import time
from collections.abc import AsyncIterator, Callable

import pytest
import zmq

from asynckv.proto.messages import Ping, encode, pack, unpack
from asynckv.transport import channel
from asynckv.transport.control import READ_BATCH, READ_BATCH_MAX, ControlChannel
from asynckv.transport.pacing import LONG_S, SHORT_S, Pacer

from .waiting import until

pytestmark = pytest.mark.timeout(60)


class Escaping(BaseException):
    """Not an ``Exception``: what the reader's own boundary does not catch."""


class Rounds:
    """Counts event-loop rounds: a callback that schedules itself again every round."""

    def __init__(self) -> None:
        self.n = 0
        self._handle: asyncio.Handle | None = None

    def start(self) -> None:
        self.n += 1
        self._handle = asyncio.get_running_loop().call_soon(self.start)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()


@dataclasses.dataclass
class Setup:
    chan: ControlChannel
    got: list[tuple[int, int]]
    """(seq, loop round) per message handled."""
    rounds: Rounds
    push: zmq.Socket[bytes]
    """A plain PUSH socket connected to the channel (it sends as a peer does: one frame a message)."""

    def send(self, seq: int) -> None:
        self.push.send(pack(ping(seq)))

    def seqs(self) -> list[int]:
        return [seq for seq, _ in self.got]


@contextlib.asynccontextmanager
async def started(on_message: Callable[[Ping], None]) -> AsyncIterator[tuple[ControlChannel, zmq.Socket[bytes]]]:
    """A started channel and a plain PUSH socket connected to it; both closed after."""
    chan = ControlChannel("127.0.0.1", on_message)
    await chan.start()
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(chan.endpoint)
    try:
        yield chan, push
    finally:
        push.close()
        ctx.term()
        await chan.close(flush_s=0.1)


@pytest.fixture
async def setup() -> AsyncIterator[Setup]:
    rounds = Rounds()
    got: list[tuple[int, int]] = []
    async with started(lambda msg: got.append((msg.seq, rounds.n))) as (chan, push):
        try:
            yield Setup(chan, got, rounds, push)
        finally:
            rounds.stop()


def ping(seq: int) -> list[bytes]:
    return encode(Ping("p" * 8, "tcp://127.0.0.1:1", 1, seq))


async def test_a_burst_is_read_in_order_a_batch_per_round(setup: Setup) -> None:
    setup.rounds.start()
    for seq in range(200):
        setup.send(seq)
    time.sleep(0.05)  # (the loop held: the burst queues up at the reader, as under load)
    await until(lambda: len(setup.got) == 200, "200 messages")
    assert setup.seqs() == list(range(200))
    assert setup.chan.received == 200 and sum(setup.chan.dropped.values()) == 0
    per_round = collections.Counter(r for _, r in setup.got)
    assert max(per_round.values()) <= 2 * READ_BATCH_MAX, per_round
    assert len(per_round) >= 200 // (2 * READ_BATCH_MAX)


@pytest.mark.parametrize(("wait", "size"), [(SHORT_S / 2, READ_BATCH_MAX), (LONG_S * 2, READ_BATCH)])
async def test_a_burst_is_read_as_the_readers_pacer_says(setup: Setup, wait: float, size: int) -> None:
    """The reader's turns feed its pacer: through a burst whose turns come back within ``SHORT_S`` it
    reads ``READ_BATCH_MAX`` a turn, past ``LONG_S`` ``READ_BATCH`` (a clock that moves ``wait`` a call)."""
    ticks = itertools.count()
    setup.chan._pacer = Pacer(READ_BATCH, READ_BATCH_MAX, lambda: next(ticks) * wait)
    for seq in range(100):
        setup.send(seq)
    time.sleep(0.05)  # (the loop held: the burst queues up at the reader)
    await until(lambda: len(setup.got) == 100, "100 messages")
    assert setup.seqs() == list(range(100))
    assert setup.chan._pacer.size == size


async def test_a_message_after_the_queue_ran_dry_is_read(setup: Setup) -> None:
    def handled(n: int) -> Callable[[], bool]:
        return lambda: len(setup.got) == n

    for seq in range(100):  # one at a time: each one finds the reader idle, its queue empty
        setup.send(seq)
        await until(handled(seq + 1), f"message {seq}")
        if seq % 10 == 9:  # and two at once
            setup.send(1000 + seq)
            setup.send(2000 + seq)
            await until(handled(seq + 3), f"the pair after {seq}")
            del setup.got[-2:]
    assert setup.seqs() == list(range(100))


async def test_nothing_is_read_once_the_reader_stopped(setup: Setup) -> None:
    setup.send(1)
    await until(lambda: len(setup.got) == 1, "the first message")
    setup.chan.stop_reader()
    assert not setup.chan.reader_alive
    for seq in range(2, 12):
        setup.send(seq)
    time.sleep(0.05)  # (what was sent is at the reader's socket by now)
    for _ in range(20):
        await asyncio.sleep(0)
    assert setup.seqs() == [1] and setup.chan.received == 1


async def test_close_with_a_turn_due_reads_nothing_more(setup: Setup) -> None:
    for seq in range(50):
        setup.send(seq)
    time.sleep(0.05)
    for _ in range(10):  # until a first batch is read (the fd's callback may come after this task's turn)
        if setup.got:
            break
        await asyncio.sleep(0)
    read = len(setup.got)
    assert 0 < read <= 2 * READ_BATCH_MAX  # (and the reader's next turn is due)
    await setup.chan.close(flush_s=0.1)
    for _ in range(20):
        await asyncio.sleep(0)
    assert len(setup.got) == read and not setup.chan.reader_alive


async def test_the_reader_survives_a_failing_receive_a_bug_and_an_escaping_exception(
        setup: Setup, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    real_recv, real_handle = ControlChannel._recv_now, ControlChannel._handle
    recv_failures = [zmq.ZMQError(zmq.EFAULT, "injected")]  # (a live socket cannot be made to raise one)
    handle_failures: dict[int, BaseException] = {1: RuntimeError("a bug"), 2: Escaping()}

    def flaky_recv(self: ControlChannel, sync: zmq.Socket[bytes]) -> tuple[list[bytes], str | None]:
        if recv_failures:
            raise recv_failures.pop(0)
        return real_recv(self, sync)

    def flaky_handle(self: ControlChannel, frames: list[bytes], origin: str | None = None) -> None:
        # After a receive, when ZMQ's fd no longer signals what is still queued: a bug past the
        # boundary, then what a signal handler raises (pytest-timeout's Failed is a BaseException).
        failure = handle_failures.pop(int(json.loads(unpack(frames[0])[1])["seq"]), None)
        if failure is not None:
            raise failure
        real_handle(self, frames, origin)

    monkeypatch.setattr(ControlChannel, "_recv_now", flaky_recv)
    monkeypatch.setattr(ControlChannel, "_handle", flaky_handle)
    with caplog.at_level(logging.WARNING, logger="asynckv.control"):  # (a simulator test may quiet "asynckv")
        for seq in range(7):
            setup.send(seq)
        await until(lambda: len(setup.got) == 5, "the messages after the failures")
    assert setup.seqs() == [0, 3, 4, 5, 6] and setup.chan.received == 7 and setup.chan.reader_alive
    assert not recv_failures and not handle_failures
    assert "recv failed" in caplog.text and "unexpected error" in caplog.text


@pytest.mark.parametrize("stop_at", [0, 1, 2, 3])  # (first or second of a turn's batch, whichever way they fall)
async def test_a_handler_that_stops_the_reader_gets_no_further_message(stop_at: int) -> None:
    got: list[int] = []

    def on_message(msg: Ping) -> None:
        got.append(msg.seq)
        if msg.seq == stop_at:
            chan.stop_reader()

    async with started(on_message) as (chan, push):
        for seq in range(10):
            push.send(pack(ping(seq)))
        time.sleep(0.05)  # (all ten queue up at the reader)
        await until(lambda: bool(got) and got[-1] >= stop_at, f"message {stop_at}")
        for _ in range(20):
            await asyncio.sleep(0)
        assert got == list(range(stop_at + 1)) and chan.received == stop_at + 1 and not chan.reader_alive


async def test_an_escape_while_handling_a_receive_failure_still_schedules_the_retry(
        setup: Setup, monkeypatch: pytest.MonkeyPatch) -> None:
    setup.send(0)
    await until(lambda: setup.seqs() == [0], "the first message")
    real_recv, real_warning = ControlChannel._recv_now, setup.chan._rl.warning
    recv_failures = [zmq.ZMQError(zmq.EFAULT, "injected")]
    log_failures = [Escaping()]  # (what a signal handler raises, landing while the failure is logged)

    def flaky_recv(self: ControlChannel, sync: zmq.Socket[bytes]) -> tuple[list[bytes], str | None]:
        frames = real_recv(self, sync)  # (a message taken: ZMQ's fd will not signal the ones behind it)
        if recv_failures:
            raise recv_failures.pop(0)
        return frames

    def flaky_warning(key: str, msg: str, *args: object) -> None:
        if log_failures:
            raise log_failures.pop(0)
        real_warning(key, msg, *args)

    monkeypatch.setattr(ControlChannel, "_recv_now", flaky_recv)
    monkeypatch.setattr(setup.chan._rl, "warning", flaky_warning)
    for seq in range(1, 6):
        setup.send(seq)
    await until(lambda: len(setup.got) == 5, "the messages behind the failure")
    assert setup.seqs() == [0, 2, 3, 4, 5] and not recv_failures and not log_failures and setup.chan.reader_alive


async def test_a_socket_gone_under_the_reader_stops_it_for_good(setup: Setup, monkeypatch: pytest.MonkeyPatch,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    real_recv = ControlChannel._recv_now
    readable = 0

    def gone(self: ControlChannel, sync: zmq.Socket[bytes]) -> tuple[list[bytes], str | None]:
        real_recv(self, sync)  # (its context terminated by someone else: a fake, the real one hangs close())
        raise zmq.ZMQError(zmq.ETERM)

    def counting(self: ControlChannel) -> None:
        nonlocal readable
        readable += 1

    monkeypatch.setattr(ControlChannel, "_recv_now", gone)
    with caplog.at_level(logging.ERROR, logger="asynckv.control"):
        setup.send(0)
        await until(lambda: not setup.chan.reader_alive, "the reader to stop")
    assert "its socket is gone" in caplog.text and setup.got == []
    monkeypatch.setattr(ControlChannel, "_read", counting)  # (the fd is no longer watched: never called)
    setup.send(1)
    time.sleep(0.05)
    for _ in range(20):
        await asyncio.sleep(0)
    assert readable == 0 and setup.got == [] and not setup.chan.reader_alive


async def test_stop_reader_off_the_loop_unwatches_the_fd(setup: Setup, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = 0

    def counting(self: ControlChannel) -> None:
        nonlocal calls
        calls += 1

    await asyncio.to_thread(setup.chan.stop_reader)  # (no running loop in that thread)
    assert not setup.chan.reader_alive
    monkeypatch.setattr(ControlChannel, "_read", counting)  # (what the fd's callback calls)
    setup.send(1)
    time.sleep(0.05)  # (unread, a still-watched fd would be readable every round from now on)
    for _ in range(50):
        await asyncio.sleep(0)
    assert calls == 0 and setup.got == []


async def test_an_escape_while_logging_a_gone_socket_still_stops_the_reader(
        setup: Setup, monkeypatch: pytest.MonkeyPatch) -> None:
    def gone(self: ControlChannel, sync: zmq.Socket[bytes]) -> tuple[list[bytes], str | None]:
        raise zmq.ZMQError(zmq.ETERM)

    def escaping(*args: object, **kwargs: object) -> None:
        raise Escaping()

    monkeypatch.setattr(ControlChannel, "_recv_now", gone)
    monkeypatch.setattr(channel.log, "error", escaping)  # (the logger control.py imports)
    setup.send(0)
    await until(lambda: not setup.chan.reader_alive, "the reader to stop")


async def test_a_closed_channel_never_touches_the_fd_number_another_channel_got() -> None:
    first = ControlChannel("127.0.0.1", lambda msg: None)
    await first.start()
    await first.close(flush_s=0.1)
    got: list[int] = []
    async with started(lambda msg: got.append(msg.seq)) as (second, push):  # (it may get the first's fd number)
        first.stop_reader()
        await first.close(flush_s=0.1)
        push.send(pack(ping(7)))
        await until(lambda: got == [7], "the second channel's message")
        assert second.reader_alive and not first.reader_alive
        with pytest.raises(RuntimeError, match="already started"):
            await first.start()  # (a channel is started once)
        with pytest.raises(RuntimeError, match="already started"):
            await second.start()


async def test_a_close_cut_by_a_cancel_all_while_the_context_terminates_waits_for_that_term() -> None:
    """A cancel-all (the caller and the close's own task) while ``term()`` runs on a worker thread.
    Before, the next close returned at once with the context not terminated yet, and the context left
    the set that keeps it alive at the cut, not once terminated (``Unclosed context`` warnings seen in
    a review's sweeps; a term that started after the rest of the manager closed never returned)."""
    import threading

    from asynckv.transport.control import _OPEN_CONTEXTS

    chan = ControlChannel("127.0.0.1", lambda msg: None)
    await chan.start()
    ctx = chan._ctx
    assert ctx is not None and ctx in _OPEN_CONTEXTS
    entered, go = threading.Event(), threading.Event()
    term = ctx.term

    def held_term() -> None:
        entered.set()
        go.wait(5)
        term()
    ctx.term = held_term  # type: ignore[method-assign]
    caller = asyncio.ensure_future(chan.close(flush_s=0.1))
    await until(entered.is_set, "term to run")
    first = chan._closer.task
    assert first is not None
    caller.cancel()
    first.cancel()
    await asyncio.gather(caller, return_exceptions=True)
    assert ctx in _OPEN_CONTEXTS  # (held while term runs)
    again = asyncio.ensure_future(chan.close(flush_s=0.1))
    await asyncio.sleep(0.05)
    assert not again.done() and not ctx.closed  # (it waits for that same term)
    go.set()
    await asyncio.wait_for(again, 5)
    assert ctx.closed and ctx not in _OPEN_CONTEXTS and chan._closer.finished
