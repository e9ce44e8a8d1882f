"""Relayed parts (``transport.lanes``): on a host with no more cores than lanes, a split write's other
parts reach their lanes through the first lane's thread. Scripted interleavings against recording
fake agents: the engine threads are held at chosen points with blocking calls, never by sleeping."""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any

import pytest

from asynckv.errors import RemoteProtocolError
from asynckv.transport import lanes as lanes_mod
from asynckv.transport.base import Write
from asynckv.transport.lanes import SMALL_POST_BYTES, LanedDataPlane
from asynckv.transport.nixl import NixlDataPlane

from .test_lanes import ended, laned, transfers
from .test_nixl_plane import FakeAgent, prepped, until


def split_write(handles: int = 2) -> Write:
    return Write(prepped().pieces * handles, 2 * handles, SMALL_POST_BYTES)


class Held:
    """Holds a lane's engine thread inside a call until released (what a long copy does to it)."""

    def __init__(self, lane: NixlDataPlane) -> None:
        self.entered, self.release = threading.Event(), threading.Event()
        self.task = asyncio.ensure_future(lane.call(lambda agent: self._hold()))

    def _hold(self) -> None:
        self.entered.set()
        if not self.release.wait(5):
            raise AssertionError("never released")

    async def held(self) -> Held:
        await until(self.entered.is_set)
        return self

    async def let_go(self) -> None:
        self.release.set()
        await self.task


class HeldInProgress:
    """Holds a lane's engine thread in its next progress call (``get_new_notifs``, as UCX's progress
    can take a while) until released: the lane stays idle to the loop (no post, no call pending)."""

    def __init__(self, agent: FakeAgent) -> None:
        self.entered, self.release = threading.Event(), threading.Event()
        real = agent.get_new_notifs

        def notifs() -> dict[str, list[bytes]]:
            if not self.release.is_set():
                self.entered.set()
                if not self.release.wait(5):
                    raise AssertionError("never released")
            return dict(real())
        agent.get_new_notifs = notifs  # type: ignore[method-assign]

    async def held(self) -> HeldInProgress:
        await until(self.entered.is_set)
        return self

    async def let_go(self) -> None:
        self.release.set()


def record_accepts(plane: LanedDataPlane, seen: list[Any] | None = None) -> list[Any]:
    """(lane, name of the thread that handed the command on) for every relayed command."""
    seen = [] if seen is None else seen
    for i, lane in enumerate(plane.lanes):
        def accept(cmd: Any, i: int = i, real: Any = lane.accept) -> None:
            seen.append((i, threading.current_thread().name))
            real(cmd)
        lane.accept = accept  # type: ignore[method-assign]
    return seen


@pytest.mark.parametrize(("cpus", "relay"), [(1, True), (2, True), (3, False), (64, False)])
def test_parts_are_relayed_by_default_only_where_the_lanes_outnumber_no_core(
        monkeypatch: pytest.MonkeyPatch, cpus: int, relay: bool) -> None:
    assert 1 <= lanes_mod.usable_cpus() <= (os.cpu_count() or 1)  # (the real one: this process's mask)
    monkeypatch.setattr(lanes_mod, "usable_cpus", lambda: cpus)
    plane = LanedDataPlane([NixlDataPlane("me"), NixlDataPlane("me.1")])
    assert plane.relay is relay
    assert LanedDataPlane([NixlDataPlane("me"), NixlDataPlane("me.1")], relay=not relay).relay is not relay


async def test_the_other_part_reaches_its_lane_through_the_idle_first_lanes_thread_before_its_own_copy() -> None:
    a, b = FakeAgent(), FakeAgent()
    a.finish = b.finish = True
    events: list[Any] = []
    for name, agent in (("a", a), ("b", b)):
        def transfer(h: int, name: str = name, real: Any = agent.transfer) -> str:
            events.append(f"{name} copies")
            return str(real(h))
        agent.transfer = transfer  # type: ignore[method-assign]
    plane, settled = await laned([a, b], relay=True)
    record_accepts(plane, events)
    hold = await Held(plane.lanes[1]).held()  # lane 1 busy: its part waits, so lane 0's copy comes first
    plane.post(1, "peer", split_write(), 30.0)
    await until(lambda: "a copies" in events)
    carrier = plane.lanes[0]._thread
    assert carrier is not None and events == [(1, carrier.name), "a copies"]  # by lane 0's thread, before its copy
    await hold.let_go()
    await until(lambda: settled == [(1, None)])
    assert transfers(a) == transfers(b) == 1 and plane._load == [0, 0] and plane._owner == {}
    await plane.close()


@pytest.mark.parametrize("relay", [False, True])
async def test_parts_go_straight_to_their_lanes_without_relay_or_when_the_first_lane_is_busy(relay: bool) -> None:
    a, b = FakeAgent(), FakeAgent()  # handles stay PROC until finish
    plane, settled = await laned([a, b], relay=relay)
    seen = record_accepts(plane)
    plane.post(1, "peer", Write(prepped().pieces, 2, SMALL_POST_BYTES), 30.0)  # one handle: whole, on lane 0
    await until(lambda: transfers(a) == 1)
    plane.post(2, "peer", split_write(), 30.0)  # lane 1 (idle) first: it carries lane 0's part
    plane.post(3, "peer", split_write(), 30.0)  # both lanes busy: no carrier
    await until(lambda: transfers(a) + transfers(b) == 5)  # each post's first handle (parts of 3 on both lanes)
    assert seen == ([(0, plane.lanes[1]._thread.name)] if relay else [])  # type: ignore[union-attr]
    a.finish = b.finish = True
    await until(lambda: sorted(p for p, _ in settled) == [1, 2, 3])
    assert all(err is None for _, err in settled) and plane._load == [0, 0]
    await plane.close()


async def test_a_cancel_that_reaches_a_lane_before_its_relayed_part_still_stops_that_part() -> None:
    """The cancel goes to the part's lane at once; the part comes later, through the carrier. The
    engine used to forget a cancel of a post it did not hold (meant for posts that had settled), so
    the part arriving after it copied."""
    a, b = FakeAgent(), FakeAgent()
    a.finish = b.finish = True
    plane, settled = await laned([a, b], relay=True)
    carrier = await HeldInProgress(a).held()  # lane 0's thread held: the part it carries stays in its queue
    plane.post(1, "peer", split_write(), 30.0)  # lane 0 carries lane 1's part
    reason = RemoteProtocolError("aborted")
    plane.cancel([1], reason)
    await plane.lanes[1].call(lambda agent: None)  # lane 1 has taken the cancel: its part has not come yet
    assert transfers(b) == 0 and plane.lanes[1]._cancelled  # (its mark kept for the part to come)
    carrier.release.set()  # lane 0 hands the part on, then takes its own
    await until(lambda: len(settled) == 1)
    assert settled == [(1, reason)] and transfers(a) == transfers(b) == 0  # neither part copied
    assert [lane._cancelled for lane in plane.lanes] == [{}, {}]  # and no mark stays behind
    await plane.close()


async def test_a_cancel_that_meets_its_post_settled_leaves_no_mark() -> None:
    """The engine finished the post; the loop cancels it before it has taken the settle. The mark is
    the loop's to drop when the settle comes (the engine no longer drops marks of posts it lacks)."""
    agent = FakeAgent()
    agent.finish = True
    finished, go_on = threading.Event(), threading.Event()
    real = agent.get_new_notifs

    def notifs() -> dict[str, list[bytes]]:
        if transfers(agent) == 1 and not go_on.is_set():  # (after the post's round finished it)
            finished.set()
            go_on.wait(5)
        return dict(real())
    agent.get_new_notifs = notifs  # type: ignore[method-assign]
    plane, settled = await laned([agent, FakeAgent()], relay=True)
    plane.post(1, "peer", prepped(), 30.0)
    assert finished.wait(5)  # (blocking the loop: the settle cannot be taken meanwhile)
    plane.cancel([1], RemoteProtocolError("aborted"))
    go_on.set()
    await until(lambda: settled == [(1, None)])  # it landed before the cancel
    await plane.lanes[0].call(lambda agent: None)  # (the engine has taken the cancel too)
    assert plane.lanes[0]._cancelled == {}
    await plane.close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # (the point)
@pytest.mark.parametrize("who", ["carrier", "target"])
async def test_a_relayed_part_settles_once_when_the_carrier_or_its_lane_dies_before_it_is_handed_on(
        who: str) -> None:
    """A carrier thread that dies holding the part hands it on as its orphans settle; a part handed on
    to a lane whose thread has ended settles with that lane's orphans (each checked after the put)."""
    a, b = FakeAgent(), FakeAgent()
    a.finish = b.finish = True
    kill = {"a": False, "b": False}
    for name, agent in (("a", a), ("b", b)):
        def notifs(name: str = name, real: Any = agent.get_new_notifs) -> dict[str, list[bytes]]:
            if kill[name]:
                raise SystemExit("engine bug")
            return dict(real())
        agent.get_new_notifs = notifs  # type: ignore[method-assign]
    plane, settled = await laned([a, b], relay=True)
    hold = await HeldInProgress(a).held()  # (wrapped over the killable progress call: it holds first)
    plane.post(1, "peer", split_write(), 30.0)  # the part for lane 1 waits in lane 0's queue
    if who == "carrier":
        kill["a"] = True  # lane 0 dies as the held progress call goes on, before it hands anything on
    else:
        kill["b"] = True  # lane 1 dies now; lane 0 hands the part on to it afterwards
        await ended(plane.lanes[1])
    hold.release.set()
    await until(lambda: len(settled) == 1)
    assert settled[0][0] == 1 and "engine thread" in str(settled[0][1])
    await ended(plane.lanes[0 if who == "carrier" else 1])
    if who == "carrier":
        assert transfers(b) == 1  # lane 1 still got its part, and copied it
    assert plane._owner == {} and plane._load == [0, 0] and plane._split == {} and plane._parts == {}
    await plane.close()
    await asyncio.sleep(0.01)
    assert len(settled) == 1  # once
