"""The NIXL data plane's own sequences, against a recording fake agent (no NIXL needed).

The fake raises on a double release, on any use of a released handle, and on releasing a
handle still in flight: the failure modes behind the double free seen when a peer was
dropped and the manager closed while a write to it was in flight (NIXL cannot cancel an
in-flight transfer safely; asynckv parks such handles until they complete).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from asynckv.errors import ClosedError, PeerUnreachable, TransferTimeout
from asynckv.proto.topology import metadata_agent_name, stub_agent_metadata
from asynckv.transport.base import DescPiece, MemoryLayout, PreppedPiece, Write
from asynckv.transport.commands import PostCmd
from asynckv.transport.nixl import NixlDataPlane
from asynckv.transport.nixl_engine import _MIN_IDLE_WAIT_S, SETTLE_AT_CLOSE_S


class FakeAgent:
    """Records every call; handles stay PROC until ``finish`` is set."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.live: set[int] = set()
        self.released: set[int] = set()
        self.finish = False
        self.done: set[int] = set()
        """Handles that completed (all do once ``finish`` is set)."""
        self.sent_notifs: list[tuple[str, bytes]] = []
        """(peer, message) of every ``send_notif``."""
        self.copy_s = 0.0
        """How long transfer() blocks (a CMA copy happens inside the call)."""
        self._next = 0

    def _new(self, kind: str) -> int:
        self._next += 1
        self.live.add(self._next)
        self.calls.append((kind, self._next))
        return self._next

    def _use(self, what: str, h: int) -> None:
        if h in self.released or h not in self.live:
            raise AssertionError(f"{what} on released handle {h}")

    def register_memory(self, rows: Any, kind: str) -> int:
        return self._new("register_memory")

    def deregister_memory(self, h: int) -> None:
        self._release("deregister_memory", h)

    def prep_xfer_dlist(self, peer: str, rows: Any, kind: str) -> int:
        return self._new(f"prep_xfer_dlist {peer or 'local'}")

    def release_dlist_handle(self, h: int) -> None:
        self._release("release_dlist_handle", h)

    def get_agent_metadata(self) -> bytes:
        return b"meta"

    def add_remote_agent(self, metadata: bytes) -> bytes:
        self.calls.append(("add_remote_agent", metadata))
        name = metadata_agent_name(metadata)
        assert name is not None
        return name

    def remove_remote_agent(self, name: str) -> None:
        self.calls.append(("remove_remote_agent", name))

    def make_prepped_xfer(self, op: str, local: int, src: Any, remote: int, dst: Any) -> int:
        self._use("make_prepped_xfer", local)
        self._use("make_prepped_xfer", remote)
        return self._new("make_prepped_xfer")

    def get_xfer_descs(self, rows: Any, kind: str) -> Any:
        return rows

    def initialize_xfer(self, op: str, src: Any, dst: Any, peer: str) -> int:
        return self._new("initialize_xfer")

    def send_notif(self, peer: str, msg: bytes) -> None:
        self.sent_notifs.append((peer, msg))

    def transfer(self, h: int) -> str:
        self._use("transfer", h)
        time.sleep(self.copy_s)
        return "DONE" if self.finish else "PROC"

    def check_xfer_state(self, h: int) -> str:
        self._use("check_xfer_state", h)
        return "DONE" if self.finish or h in self.done else "PROC"

    def release_xfer_handle(self, h: int) -> None:
        if not (self.finish or h in self.done):
            raise AssertionError(f"release_xfer_handle of {h} while it is still in flight")
        self._release("release_xfer_handle", h)

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        return {}

    def _release(self, what: str, h: int) -> None:
        if h in self.released:
            raise AssertionError(f"double {what} of {h}")
        self._use(what, h)
        self.released.add(h)
        self.calls.append((what, h))


def rows(n: int) -> np.ndarray:
    return np.array([[0x1000 * (i + 1), 64, 0] for i in range(n)], dtype=np.uint64)


def prepped(n: int = 2) -> Write:
    return Write((PreppedPiece(np.arange(n, dtype=np.int32), np.arange(n, dtype=np.int32)),), n, 64 * n)


async def started(agent: FakeAgent) -> tuple[NixlDataPlane, list[tuple[int, BaseException | None]]]:
    plane = NixlDataPlane("me", agent_factory=lambda name, backend: agent)
    settled: list[tuple[int, BaseException | None]] = []
    plane.on_settled = settled.extend
    await plane.start(MemoryLayout((("DRAM", rows(2)),), rows(4), "DRAM", (0x9000, 64)))
    await plane.connect_peer("peer", stub_agent_metadata("peer"), rows(4), "DRAM")
    plane.set_lease("peer", time.monotonic() + 60)
    return plane, settled


async def until(cond: Any, timeout: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.002)


async def test_a_forgotten_peers_write_settles_only_once_its_handles_finished_then_the_agent_goes() -> None:
    agent = FakeAgent()
    plane, settled = await started(agent)
    plane.post(1, "peer", prepped(), 30.0)
    await until(lambda: plane.posts_in_flight == 1)
    plane.forget_peer("peer")
    await asyncio.sleep(0.05)
    assert settled == []  # its bytes may still land: it has not settled (NIXL cannot stop the handle)
    names = [c[0] for c in agent.calls]
    assert "release_xfer_handle" not in names and "remove_remote_agent" not in names  # nothing torn down
    agent.finish = True  # the transfer completes
    await until(lambda: settled)
    assert settled[0][0] == 1 and isinstance(settled[0][1], PeerUnreachable)  # settles, as failed, after
    await until(lambda: any(c[0] == "remove_remote_agent" for c in agent.calls))
    await plane.close()
    names = [c[0] for c in agent.calls]
    xfer = names.index("make_prepped_xfer")
    assert names[xfer:] == ["make_prepped_xfer", "release_xfer_handle", "release_dlist_handle",
                            "remove_remote_agent", "release_dlist_handle", "deregister_memory"]
    assert agent.live == agent.released  # everything made was released, nothing twice (the fake checks)


async def test_a_failing_dlist_release_neither_loses_the_settle_nor_ends_the_engine() -> None:
    """Releasing a forgotten peer's dlist runs in the same round that finishes its last write: a
    failure there used to end the thread with that settle in hand (never delivered, never orphaned)."""
    agent = FakeAgent()
    plane, settled = await started(agent)
    plane.post(1, "peer", prepped(), 30.0)
    await until(lambda: plane.posts_in_flight == 1)
    plane.forget_peer("peer")

    def failing_release(h: int) -> None:
        raise RuntimeError("nixl: release_dlist_handle failed")
    agent.release_dlist_handle = failing_release  # type: ignore[method-assign]
    agent.finish = True
    await until(lambda: settled)
    assert settled[0][0] == 1 and isinstance(settled[0][1], PeerUnreachable)
    await until(lambda: any(c[0] == "remove_remote_agent" for c in agent.calls))  # (the rest still ran)
    assert plane.alive
    assert await plane.call(lambda a: "still serving") == "still serving"
    await plane.close()


async def test_closing_with_writes_that_complete_meanwhile_releases_everything_in_order() -> None:
    agent = FakeAgent()
    plane, settled = await started(agent)
    for post_id in range(1, 4):
        plane.post(post_id, "peer", prepped(), 30.0)
    await until(lambda: plane.posts_in_flight == 3)
    asyncio.get_running_loop().call_later(0.02, setattr, agent, "finish", True)  # during close's settle window
    await plane.close()
    names = [c[0] for c in agent.calls]
    last_xfer_release = max(i for i, n in enumerate(names) if n == "release_xfer_handle")
    assert last_xfer_release < names.index("remove_remote_agent") < names.index("deregister_memory")
    assert sorted(p for p, _ in settled) == [1, 2, 3] and agent.live == agent.released


async def test_closing_with_a_peer_stopped_for_good_keeps_the_agent_instead_of_tearing_it_down() -> None:
    from asynckv.transport import agent as agent_module

    agent = FakeAgent()
    plane, settled = await started(agent)
    plane.post(1, "peer", prepped(), 30.0)
    await until(lambda: plane.posts_in_flight == 1)
    await plane.close()
    assert settled == [(1, settled[0][1])] and "closed" in str(settled[0][1])
    names = [c[0] for c in agent.calls]
    assert "release_xfer_handle" not in names and "deregister_memory" not in names
    assert any(kept[0] is agent for kept in agent_module._KEPT_UNTIL_EXIT)


async def test_a_cancelled_write_never_starts_and_a_lapsed_lease_stops_one_in_flight() -> None:
    agent = FakeAgent()
    agent.finish, agent.copy_s = True, 0.2
    plane, settled = await started(agent)
    plane.post(6, "peer", prepped(), 30.0)  # the engine copies this one for 200 ms
    await asyncio.sleep(0.05)
    plane.post(7, "peer", prepped(), 30.0)  # queued behind it...
    plane.cancel([7], TransferTimeout("cancelled while queued"))  # ...and cancelled before the engine gets to it
    await until(lambda: len(settled) == 2)
    assert settled == [(6, None), (7, settled[1][1])] and "cancelled while queued" in str(settled[1][1])
    assert sum(n == "make_prepped_xfer" for n, _ in agent.calls) == 1  # 7 never made a handle
    agent.finish, agent.copy_s = False, 0.0
    plane.post(8, "peer", prepped(), 30.0)
    await until(lambda: plane.posts_in_flight == 1)
    plane.set_lease("peer", time.monotonic() - 1)  # the lease ran out while it was in flight
    plane.post(9, "peer", prepped(), 30.0)  # no new handle starts without a lease
    await until(lambda: len(settled) == 3)
    assert settled[2][0] == 9 and "write lease" in str(settled[2][1])
    assert sum(n == "make_prepped_xfer" for n, _ in agent.calls) == 2
    await asyncio.sleep(0.05)
    assert len(settled) == 3  # 8 is still copying: it settles when its handle is done, not before
    agent.finish = True
    await until(lambda: len(settled) == 4)
    assert settled[3][0] == 8 and "write lease" in str(settled[3][1])
    await plane.close()
    assert agent.live == agent.released


async def test_each_handle_of_a_write_checks_the_lease_before_it_starts() -> None:
    agent = FakeAgent()
    agent.finish = True  # CMA-like: every handle completes inside transfer()
    plane, settled = await started(agent)
    pieces = tuple(DescPiece(rows(1), rows(1), "DRAM", "DRAM") for _ in range(3))
    plane.post(1, "peer", Write(pieces, 3, 192), 30.0)
    await until(lambda: settled)
    assert settled == [(1, None)] and sum(n == "initialize_xfer" for n, _ in agent.calls) == 3
    await plane.close()


async def test_a_write_over_tcp_keeps_one_handle_in_flight_so_a_cancel_stops_it_after_that_one() -> None:
    agent = FakeAgent()  # handles complete asynchronously (TCP, RDMA): transfer() returns PROC
    plane, settled = await started(agent)
    pieces = tuple(DescPiece(rows(1), rows(1), "DRAM", "DRAM") for _ in range(3))
    plane.post(1, "peer", Write(pieces, 3, 192), 30.0)
    made: Callable[[], list[Any]] = lambda: [h for n, h in agent.calls if n == "initialize_xfer"]  # noqa: E731
    await until(lambda: len(made()) == 1)
    await asyncio.sleep(0.02)
    assert len(made()) == 1  # the second handle waits for the first
    agent.done.add(made()[0])
    await until(lambda: len(made()) == 2)
    plane.cancel([1], TransferTimeout("aborted by decode"))  # while the second is in flight
    await asyncio.sleep(0.02)
    assert settled == []  # its bytes may still land: it settles once that handle is done
    agent.done.add(made()[1])
    await until(lambda: settled)
    assert settled[0][0] == 1 and "aborted by decode" in str(settled[0][1])
    assert len(made()) == 2  # the third handle never started
    await plane.close()
    assert agent.live == agent.released


@pytest.mark.parametrize("kind", ["descs", "prepped"])
@pytest.mark.parametrize("handles", [1, 3])
async def test_a_writes_notification_goes_once_it_all_landed_and_never_for_a_cancelled_write(
        kind: str, handles: int) -> None:
    agent = FakeAgent()  # handles complete only when the test says so (TCP, RDMA)
    plane, settled = await started(agent)
    pieces: tuple[PreppedPiece | DescPiece, ...] = (
        tuple(DescPiece(rows(1), rows(1), "DRAM", "DRAM") for _ in range(handles)) if kind == "descs"
        else tuple(PreppedPiece(np.array([i], dtype=np.int32), np.array([i], dtype=np.int32)) for i in range(handles)))

    def made() -> list[int]:
        return [h for n, h in agent.calls if n in ("initialize_xfer", "make_prepped_xfer")]

    plane.post(1, "peer", Write(pieces, handles, 64 * handles, notif=b"x"), 30.0)
    for i in range(handles):  # one handle at a time: each completes before the next is made
        await until(lambda i=i: len(made()) == i + 1)
        assert agent.sent_notifs == []  # not before the write's last byte landed
        agent.done.add(made()[i])
    await until(lambda: settled)
    assert settled == [(1, None)] and agent.sent_notifs == [("peer", b"x")]
    plane.post(2, "peer", Write(pieces, handles, 64 * handles, notif=b"y"), 30.0)
    await until(lambda: len(made()) == handles + 1)
    plane.cancel([2], TransferTimeout("its room failed"))  # while its first handle is in flight
    agent.done.add(made()[handles])  # that handle still lands (NIXL cannot stop it)
    await until(lambda: len(settled) == 2 or len(made()) > handles + 1)
    assert len(made()) == handles + 1, "a handle of the cancelled write started after the cancel"
    assert settled[1][0] == 2 and "its room failed" in str(settled[1][1])
    assert agent.sent_notifs == [("peer", b"x")]  # the cancelled write's notification never went
    await plane.close()
    assert agent.live == agent.released


async def test_a_post_past_its_deadline_settles_marked_with_its_handle_still_in_flight() -> None:
    """Its handle is parked, still reading the post's source: the plane says so, once (a staging run
    must not be reused for it); a cancelled post settles only once its handle finished, unmarked."""
    agent = FakeAgent()
    plane, settled = await started(agent)
    plane.post(1, "peer", prepped(), 0.05)
    await until(lambda: len(settled) == 1)
    assert isinstance(settled[0][1], TransferTimeout) and plane.take_in_flight(1) and not plane.take_in_flight(1)
    plane.post(2, "peer", prepped(), 30.0)
    await until(lambda: plane.posts_in_flight == 1)
    plane.cancel([2], PeerUnreachable("aborted"))
    agent.finish = True
    await until(lambda: len(settled) == 2)
    assert not plane.take_in_flight(2)
    await plane.close()


class RecordingQueue:
    """The engine's command queue, recording in order each command it hands over and each wait it starts."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.events: list[tuple[str, Any]] = []

    def put(self, item: Any) -> None:
        self.inner.put(item)

    def get_nowait(self) -> Any:
        item = self.inner.get_nowait()
        self.events.append(("got", item))
        return item

    def get(self, timeout: float) -> Any:
        self.events.append(("wait", timeout))
        item = self.inner.get(timeout=timeout)
        self.events.append(("got", item))
        return item


@pytest.mark.parametrize(("expects", "inline", "notif", "first_wait"), [
    (False, True, b"", "deep idle"),  # a prefill's engine after a post that copied inside transfer() (CMA)
    (True, True, b"", "short"),  # a decode's, rooms waiting: notifications may come
    (False, False, b"", "short"),  # a post left in flight (UCX over TCP) after an idle wait
    (False, True, b"room 7 done", "short"),  # SGLang's wire: the notification sent may need progress to leave
])
async def test_the_engine_waits_short_after_a_post_only_when_something_but_its_commands_may_need_it(
        expects: bool, inline: bool, notif: bytes, first_wait: str) -> None:
    """The first wait for a command after the engine took a post. With nothing in flight or parked, no
    notification expected and none just sent, only a command (which ends any wait) can need the engine: polling
    at 20, 40, 80 ... us after every post took 6-15% off a prefill's rate of 1-page rooms. A handle in flight is
    polled at once, even after an idle wait (it waited a whole idle wait, 10 ms, before); so is a notification
    just sent (UCX may leave it half sent, for the next progress calls: it left 10 ms late when the engine waited
    as when idle, found by review)."""
    agent = FakeAgent()
    agent.finish = inline  # (inline: the copy happens inside transfer(), as CMA does on one host)
    plane = NixlDataPlane("me", agent_factory=lambda n, b: agent, expecting=lambda: expects, idle_poll_s=0.4,
                          deep_idle_s=0.5)
    commands = plane._commands = RecordingQueue(plane._commands)  # type: ignore[assignment]
    settled: list[tuple[int, BaseException | None]] = []
    plane.on_settled = settled.extend
    await plane.start(MemoryLayout((("DRAM", rows(2)),), rows(4), "DRAM", (0x9000, 64)))
    await plane.connect_peer("peer", stub_agent_metadata("peer"), rows(4), "DRAM")
    plane.set_lease("peer", time.monotonic() + 60)
    plane.post(7, "peer", dataclasses.replace(prepped(), notif=notif), 30.0)
    await until(lambda: any(what == "got" and isinstance(item, PostCmd) for what, item in commands.events))
    taken = next(i for i, (what, item) in enumerate(commands.events) if what == "got" and isinstance(item, PostCmd))
    await until(lambda: any(what == "wait" for what, _ in commands.events[taken:]))
    wait = next(value for what, value in commands.events[taken:] if what == "wait")
    assert wait == (_MIN_IDLE_WAIT_S if first_wait == "short" else 0.5)
    agent.finish = True
    await until(lambda: settled == [(7, None)])
    await plane.close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # (the point)
@pytest.mark.parametrize("kind", ["post", "call"])
async def test_a_command_that_woke_the_engine_just_before_its_thread_died_still_settles(kind: str) -> None:
    """The command that ends the engine's idle wait is the thread's until its next round; a thread
    that dies in between (here ``expecting()`` raising) must not take it along unsettled."""
    agent, state = FakeAgent(), {"die": False}

    def expecting() -> bool:
        if state["die"]:
            raise RuntimeError("engine bug")
        return False
    plane = NixlDataPlane("me", agent_factory=lambda n, b: agent, expecting=expecting, idle_poll_s=0.5,
                          deep_idle_s=0.5)  # long idle waits: the command below ends one
    settled: list[tuple[int, BaseException | None]] = []
    plane.on_settled = settled.extend
    await plane.start(MemoryLayout((("DRAM", rows(2)),), rows(4), "DRAM", (0x9000, 64)))
    await plane.connect_peer("peer", stub_agent_metadata("peer"), rows(4), "DRAM")
    plane.set_lease("peer", time.monotonic() + 60)
    await asyncio.sleep(0.3)  # deep in an idle wait now
    state["die"] = True  # the expecting() right after the wait kills the thread
    call = None
    if kind == "post":
        plane.post(7, "peer", prepped(), 30.0)
    else:
        call = asyncio.ensure_future(plane.call(lambda agent: "ok"))
    assert plane._thread is not None
    await until(lambda: not plane._thread.is_alive())
    await plane.close()
    if call is None:
        await until(lambda: len(settled) == 1)
        assert settled[0][0] == 7 and "engine thread died" in str(settled[0][1])
    else:
        with pytest.raises(Exception, match="engine thread died"):
            await asyncio.wait_for(call, 2.0)


class RecordingOutbox:
    """The engine's outbox, recording (on the engine thread) the post ids of each hand-over."""

    def __init__(self, inner: Any, events: list[tuple[str, Any]]) -> None:
        self.inner, self.events = inner, events

    def put(self, items: list[Any]) -> None:
        posts = [value for fut, value, _ in items if fut is None]  # (a call's result comes with its future)
        if posts:
            self.events.append(("handed", posts))
        self.inner.put(items)

    def flush(self) -> None:
        self.inner.flush()


async def test_a_post_that_copied_is_handed_to_the_loop_before_the_next_copy_of_its_round() -> None:
    """Three posts queue while the engine is busy, so that it takes them in one round; each copies
    inside ``transfer()`` (CMA). The first's settle must not wait for the other two copies."""
    agent = FakeAgent()
    events: list[tuple[str, Any]] = []
    agent.finish = True
    plane, settled = await started(agent)
    plane._outbox = RecordingOutbox(plane._outbox, events)  # type: ignore[assignment]
    transfer = agent.transfer

    def recorded(h: int) -> str:
        events.append(("copied", h))
        return transfer(h)
    agent.transfer = recorded  # type: ignore[method-assign]
    entered, gate = threading.Event(), threading.Event()

    def hold(agent: Any) -> bool:
        entered.set()
        return gate.wait(5)
    busy = asyncio.ensure_future(plane.call(hold))  # (it holds the engine until the posts wait)
    await until(entered.is_set)
    for post_id in (1, 2, 3):
        plane.post(post_id, "peer", prepped(), 30.0)
    gate.set()
    await busy
    await until(lambda: sorted(post_id for post_id, _ in settled) == [1, 2, 3])
    assert [what for what, _ in events] == ["copied", "handed", "copied", "handed", "copied", "handed"]
    assert [ids for what, ids in events if what == "handed"] == [[1], [2], [3]]
    assert all(error is None for _, error in settled)
    await plane.close()


async def test_close_returns_only_after_the_posts_taken_during_close_settled() -> None:
    """Posts handed over while close() waits for its shutdown call are taken (and settle) before the
    engine stops; the loop takes settles a few per round, so close() must flush the rest itself."""
    agent = FakeAgent()
    agent.finish = True
    plane, settled = await started(agent)
    close = asyncio.ensure_future(plane.close())
    await asyncio.sleep(0)  # close() has queued its shutdown call; the plane still takes posts
    for post_id in range(1, 401):
        plane.post(post_id, "peer", prepped(), 30.0)
    outbox = plane._outbox
    assert outbox is not None
    deadline = time.monotonic() + 5  # hold the loop until the engine handed back the call and all 400
    while len(outbox._items) < 401 and time.monotonic() < deadline:
        time.sleep(0.001)
    await close
    assert sorted(post_id for post_id, _ in settled) == list(range(1, 401))  # all, once, before close returned
    await asyncio.sleep(0.05)
    assert len(settled) == 400  # (and nothing again later)


async def test_close_returns_only_after_the_posts_in_flight_at_close_settled() -> None:
    agent = FakeAgent()
    plane, settled = await started(agent)
    for post_id in range(1, 401):
        plane.post(post_id, "peer", prepped(), 30.0)
    await until(lambda: plane.posts_in_flight == 400)
    await plane.close()
    assert sorted(post_id for post_id, _ in settled) == list(range(1, 401))



@pytest.mark.parametrize("cut", ["before its task ran", "in the engine's shutdown"])
async def test_a_close_cut_by_a_cancel_all_resumes_at_the_next_close(cut: str) -> None:
    """A shutdown handler cancels every task on the loop, the plane's close task too, while the close
    waits for the engine's shutdown. Before, every later close raised ``CancelledError`` and the engine
    thread polled on with the memory registered. Now the next close takes up where it was: the thread
    finishes the shutdown it took, ends, and every post settles once."""
    agent = FakeAgent()
    plane, settled = await started(agent)
    for post_id in range(1, 51):
        plane.post(post_id, "peer", prepped(), 30.0)
    await until(lambda: plane.posts_in_flight == 50)
    agent.finish = True
    entered, gate = threading.Event(), threading.Event()
    shutdown = plane._shutdown

    def held_shutdown(*args: Any) -> None:
        entered.set()
        gate.wait(5)
        shutdown(*args)
    plane._shutdown = held_shutdown  # type: ignore[method-assign,assignment]
    caller = asyncio.ensure_future(plane.close())
    await asyncio.sleep(0)
    if cut == "in the engine's shutdown":
        await until(entered.is_set)
    first = plane._closer.task
    assert first is not None and not first.done()
    caller.cancel()  # (the cancel-all: the caller and the close's own task)
    first.cancel()
    await asyncio.gather(caller, return_exceptions=True)
    assert first.cancelled() and plane._thread is not None and plane._thread.is_alive()
    again = asyncio.ensure_future(plane.close())
    await asyncio.sleep(0.01)
    assert not again.done()  # (it waits for the engine's shutdown)
    gate.set()
    await asyncio.wait_for(again, 5)
    assert not plane._thread.is_alive() and not plane.alive
    assert sorted(post_id for post_id, _ in settled) == list(range(1, 51))  # each once
    calls = [call for call, _ in agent.calls]
    assert calls.count("deregister_memory") == calls.count("register_memory") >= 1  # (each once, not twice)
    assert agent.live == agent.released  # (every handle, dlist and registration let go, once)
    await plane.close()  # (finished: at once)

@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # (the point)
async def test_settles_handed_over_before_the_thread_died_come_before_close_returns() -> None:
    """The engine settled ten posts, then died before the loop drained them (the loop was busy):
    close() delivers those, in order, before it returns."""
    agent, state = FakeAgent(), {"die": False}
    agent.finish = True

    def expecting() -> bool:
        if state["die"]:
            raise RuntimeError("engine bug")
        return False
    plane = NixlDataPlane("me", agent_factory=lambda n, b: agent, expecting=expecting, idle_poll_s=0.01,
                          deep_idle_s=0.01)
    settled: list[tuple[int, BaseException | None]] = []
    plane.on_settled = settled.extend
    await plane.start(MemoryLayout((("DRAM", rows(2)),), rows(4), "DRAM", (0x9000, 64)))
    await plane.connect_peer("peer", stub_agent_metadata("peer"), rows(4), "DRAM")
    plane.set_lease("peer", time.monotonic() + 60)
    for post_id in range(1, 11):
        plane.post(post_id, "peer", prepped(), 30.0)
    outbox, thread = plane._outbox, plane._thread
    assert outbox is not None and thread is not None
    deadline = time.monotonic() + 5  # the loop is held here (as by a long callback): nothing drains
    while len(outbox._items) < 10 and time.monotonic() < deadline:
        time.sleep(0.001)
    state["die"] = True
    thread.join(5)
    assert not thread.is_alive() and settled == []
    await plane.close()
    assert [post_id for post_id, _ in settled] == list(range(1, 11))
    assert all(error is None for _, error in settled)


@pytest.mark.parametrize("fails", ["deregister_memory", "get_new_notifs"])
async def test_posts_that_finish_while_a_close_fails_midway_still_settle(fails: str) -> None:
    """Close's own settles were a local list of its shutdown step, dropped when a later step raised
    (found by review): those posts never settled."""
    agent = FakeAgent()
    plane, settled = await started(agent)
    for post_id in (1, 2, 3):
        plane.post(post_id, "peer", prepped(), 30.0)
    await until(lambda: plane.posts_in_flight == 3)
    closing = {"now": False, "polls": 0}
    real_shutdown, real_notifs = plane._shutdown, agent.get_new_notifs

    def shutdown(settle_s: float = SETTLE_AT_CLOSE_S) -> None:
        closing["now"] = True
        real_shutdown(settle_s)
    plane._shutdown = shutdown  # type: ignore[method-assign]

    def notifs() -> dict[str, list[bytes]]:
        if closing["now"]:
            closing["polls"] += 1
            if fails == "deregister_memory":
                agent.finish = True  # every handle completes while close waits for them
            elif closing["polls"] == 1:
                agent.done.update(p.handle for p in plane._in_flight[:2])  # two of three complete
            elif closing["polls"] == 2:
                raise RuntimeError("get_new_notifs failed")
        return real_notifs()
    agent.get_new_notifs = notifs  # type: ignore[method-assign]
    if fails == "deregister_memory":
        def deregister(h: int) -> None:
            raise RuntimeError("deregister failed")
        agent.deregister_memory = deregister  # type: ignore[method-assign]
    await asyncio.wait_for(plane.close(), 10)
    await asyncio.sleep(0.05)
    assert sorted(p for p, _ in settled) == [1, 2, 3], settled  # (each once, stopped by the close)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # (the point)
async def test_a_settle_handler_that_raises_does_not_hold_back_a_dead_threads_orphans() -> None:
    agent = FakeAgent()
    plane, settled = await started(agent)
    handled = {"calls": 0}

    def on_settled(batch: list[tuple[int, BaseException | None]]) -> None:
        handled["calls"] += 1
        if batch == [(3, None)]:
            raise RuntimeError("a settle handler's bug")
        settled.extend(batch)
    plane.on_settled = on_settled
    plane.post(2, "peer", prepped(), 30.0)  # stays in flight
    await until(lambda: plane.posts_in_flight == 1)
    real_transfer, real_notifs, kill = agent.transfer, agent.get_new_notifs, {"now": False}

    def transfer(h: int) -> str:
        real_transfer(h)
        agent.done.add(h)
        kill["now"] = True
        return "DONE"  # post 3 copies inside transfer()...

    def notifs() -> dict[str, list[bytes]]:
        if kill["now"]:
            raise SystemExit("engine bug")  # ...and the thread dies later in that round
        return real_notifs()
    agent.transfer, agent.get_new_notifs = transfer, notifs  # type: ignore[method-assign]
    plane.post(3, "peer", prepped(), 30.0)
    await until(lambda: [p for p, _ in settled] == [2])  # before close: the held post settled (failed)
    assert isinstance(settled[0][1], Exception) and "engine thread died" in str(settled[0][1])
    assert plane._thread is not None
    await until(lambda: not plane._thread.is_alive())  # (its death is this test's, not the next's)
    await plane.close()


async def test_a_close_whose_shutdown_raises_early_parks_what_is_in_flight_and_keeps_the_agent() -> None:
    """Found by review: the posts settled, but their running handles were neither parked nor kept, so the
    agent could be torn down under them (the crash the parking exists to prevent)."""
    from asynckv.transport import agent as agent_module

    agent = FakeAgent()
    plane, settled = await started(agent)
    for post_id in (1, 2):
        plane.post(post_id, "peer", prepped(), 30.0)
    await until(lambda: plane.posts_in_flight == 2)

    def forget(peer: str, done: list[Any]) -> None:
        raise RuntimeError("forget failed")
    plane._forget = forget  # type: ignore[method-assign]
    kept = len(agent_module._KEPT_UNTIL_EXIT)
    await asyncio.wait_for(plane.close(), 10)
    await asyncio.sleep(0.05)
    assert sorted(p for p, _ in settled) == [1, 2] and all(isinstance(e, ClosedError) for _, e in settled)
    assert len(plane._parked) == 2 and not agent.released & {h for _, h in plane._parked}
    assert any(k[0] is agent for k in agent_module._KEPT_UNTIL_EXIT[kept:])


async def test_a_close_that_raises_while_checking_posts_settles_each_once() -> None:
    """Found by review: a post close had finished stayed in flight when the check raised midway, so
    it settled twice (once from close, once from the next engine round)."""
    agent = FakeAgent()
    plane, settled = await started(agent)
    for post_id in (1, 2):
        plane.post(post_id, "peer", prepped(), 30.0)
    await until(lambda: plane.posts_in_flight == 2)
    releases = {"closing": False, "n": 0}
    real_shutdown, real_release = plane._shutdown, agent.release_xfer_handle

    def shutdown(settle_s: float = SETTLE_AT_CLOSE_S) -> None:
        releases["closing"] = True
        agent.done.update(p.handle for p in plane._in_flight)  # both complete while close waits
        real_shutdown(settle_s)
    plane._shutdown = shutdown  # type: ignore[method-assign]

    def release(h: int) -> None:
        if releases["closing"]:
            releases["n"] += 1
            if releases["n"] == 2:
                raise SystemExit("a binding's bug on the second release")
        real_release(h)
    agent.release_xfer_handle = release  # type: ignore[method-assign]
    await asyncio.wait_for(plane.close(), 10)
    await asyncio.sleep(0.05)
    assert sorted(p for p, _ in settled) == [1, 2], settled


class GatedAgent(FakeAgent):
    """``transfer()`` holds until ``go`` is set: the copy is still running as the test closes the loop."""

    def __init__(self) -> None:
        super().__init__()
        self.entered, self.go = threading.Event(), threading.Event()

    def transfer(self, h: int) -> str:
        self.entered.set()
        self.go.wait(5)
        return super().transfer(h)


LEFT_OPEN = ["idle", "a write in flight to a stopped peer", "a copy that returns after the loop closed"]


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
@pytest.mark.parametrize("when", LEFT_OPEN)
def test_a_plane_left_open_as_its_loop_closes_ends_its_thread_and_keeps_what_peers_may_write(
        when: str, loop_kind: str, caplog: pytest.LogCaptureFixture) -> None:
    """A manager never closed (a test fixture without ``close()``, a script ending ``asyncio.run``):
    its loop closes with the plane open. The engine thread must end on its own, once, without dying
    of a settle it can no longer hand over (before: a RuntimeError traceback, or an idle thread
    polling for ever). No fence can run now, so it releases nothing: a peer may still hold a lease
    on its memory (over CMA a deregistered range still takes writes), and a handle may be in flight.
    The agent and the memory with its owners are kept until the process exits."""
    import uvloop

    from asynckv.transport import agent as agent_module

    caplog.set_level(logging.WARNING, logger="asynckv.nixl")
    agent = GatedAgent()
    agent.finish = when != LEFT_OPEN[1]
    if when != LEFT_OPEN[2]:
        agent.go.set()
    loop = uvloop.new_event_loop() if loop_kind == "uvloop" else asyncio.new_event_loop()
    plane, settled = loop.run_until_complete(started(agent))
    if when != LEFT_OPEN[0]:
        plane.post(1, "peer", prepped(), 30.0)
        loop.run_until_complete(until(agent.entered.is_set))
    if when == LEFT_OPEN[1]:
        loop.run_until_complete(until(lambda: plane.posts_in_flight == 1))
    kept = len(agent_module._KEPT_UNTIL_EXIT)
    memory = plane._memory
    loop.close()
    agent.go.set()  # (the copy returns DONE into a closed loop)
    assert plane._thread is not None
    plane._thread.join(5.0)
    assert not plane._thread.is_alive() and plane.thread_error is None
    assert settled == []  # (nothing could reach the loop)
    said = [r.getMessage() for r in caplog.records if r.name == "asynckv.nixl" and r.levelname == "WARNING"]
    assert sum("event loop closed" in m for m in said) == 1
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]
    names = {c[0] for c in agent.calls}
    assert not {"deregister_memory", "release_dlist_handle", "remove_remote_agent"} & names
    assert ("release_xfer_handle" in names) == (when == LEFT_OPEN[2])  # (only the handle that completed)
    assert len(agent_module._KEPT_UNTIL_EXIT) == kept + 1
    assert agent_module._KEPT_UNTIL_EXIT[-1][:2] == (agent, memory) and memory is not None


def test_a_start_given_up_before_its_engine_answers_logs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    """``wait_for(manager.start(), t)`` timing out while the agent is made: the engine's answer then
    finds the start future cancelled, and used to log an InvalidStateError traceback from the loop."""
    agent, made, go = FakeAgent(), threading.Event(), threading.Event()

    def factory(name: str, backend: str) -> FakeAgent:
        made.set()
        go.wait(5)
        return agent

    async def scenario() -> None:
        plane = NixlDataPlane("me", agent_factory=factory)
        start = asyncio.ensure_future(plane.start(MemoryLayout((("DRAM", rows(2)),), rows(4), "DRAM", (0x9000, 64))))
        await until(made.is_set)
        start.cancel()
        go.set()
        with pytest.raises(asyncio.CancelledError):
            await start
        await until(lambda: plane._agent is agent)
        await asyncio.sleep(0.05)  # (the answer's callback has run)
        await plane.close()

    asyncio.run(scenario())
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")], caplog.text
