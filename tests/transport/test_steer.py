"""Steering a relayed lane's thread off its waker's CPU (``transport.steer``): the mask arithmetic
against scripted CPUs and affinity calls, the real syscalls on a real thread, and where a laned
plane steers (only its relayed parts, from the carrier's thread, undone by the woken thread)."""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import pytest

from asynckv.transport import steer as steer_mod
from asynckv.transport.lanes import LanedDataPlane
from asynckv.transport.nixl import NixlDataPlane
from asynckv.transport.steer import Steer, steering_available

from .test_lane_relay import Held, split_write
from .test_lanes import laned, transfers
from .test_nixl_plane import FakeAgent, until


class Affinity:
    """Scripted ``sched_getaffinity`` / ``sched_setaffinity`` per thread id (0: the calling thread,
    here ``me``), and the CPU ``sched_getcpu`` reports."""

    def __init__(self, masks: dict[int, set[int]], cpu: int, me: int = 7) -> None:
        self.masks, self.cpu, self.me = masks, cpu, me
        self.calls: list[tuple[str, int, Any]] = []
        self.fail: set[str] = set()

    def get(self, tid: int) -> set[int]:
        self.calls.append(("get", tid, None))
        if "get" in self.fail:
            raise OSError(1, "not permitted")
        return set(self.masks[tid or self.me])

    def set(self, tid: int, mask: set[int]) -> None:
        self.calls.append(("set", tid, set(mask)))
        if "set" in self.fail:
            raise OSError(22, "invalid argument")
        self.masks[tid or self.me] = set(mask)

    def steer(self) -> Steer:
        return Steer(getcpu=lambda: self.cpu, setaffinity=self.set, getaffinity=self.get)


def test_away_keeps_the_woken_thread_off_this_cpu_and_back_restores_its_own_mask() -> None:
    aff = Affinity({7: {0, 1, 2, 3}}, cpu=2)
    steer = aff.steer()
    steer.away(7)
    assert aff.masks[7] == {0, 1, 3}
    steer.back()  # (on the thread itself: tid 0)
    assert aff.masks[7] == {0, 1, 2, 3} and aff.calls[-1] == ("set", 0, {0, 1, 2, 3})
    steer.back()  # nothing to undo now
    assert len([c for c in aff.calls if c[0] == "set"]) == 2


def test_a_second_away_before_back_restores_the_mask_of_before_the_first() -> None:
    aff = Affinity({7: {0, 1, 2}}, cpu=0)
    steer = aff.steer()
    steer.away(7)
    aff.cpu = 1  # (the next waker runs elsewhere)
    steer.away(7)
    assert aff.masks[7] == {0, 2}  # (its own mask less CPU 1, not the narrowed one less CPU 1)
    steer.back()
    assert aff.masks[7] == {0, 1, 2}


@pytest.mark.parametrize(("mask", "cpu"), [({3}, 3), ({0, 1}, 5)])
def test_no_steer_when_this_cpu_is_its_only_one_or_not_one_it_may_use(mask: set[int], cpu: int) -> None:
    aff = Affinity({7: mask}, cpu=cpu)
    steer = aff.steer()
    steer.away(7)
    steer.back()
    assert aff.masks[7] == mask and [c for c in aff.calls if c[0] == "set"] == [] and steer.enabled


def test_no_steer_while_off_or_for_a_thread_not_started() -> None:
    aff = Affinity({7: {0, 1}}, cpu=0)
    off = Steer(enabled=False, getcpu=lambda: 0, setaffinity=aff.set, getaffinity=aff.get)
    off.away(7)
    on = aff.steer()
    on.away(None)
    on.away(0)
    assert aff.calls == [] and not off.enabled and on.enabled


@pytest.mark.parametrize("failing", ["get", "set"])
def test_a_failing_affinity_call_turns_steering_off_quietly(failing: str) -> None:
    aff = Affinity({7: {0, 1}}, cpu=0)
    aff.fail.add(failing)
    steer = aff.steer()
    steer.away(7)  # (no exception: the wake-up goes on, plain)
    assert not steer.enabled and aff.masks[7] == {0, 1}
    calls = len(aff.calls)
    steer.away(7)
    steer.back()
    assert len(aff.calls) == calls


def test_a_failing_restore_is_logged_and_turns_steering_off(caplog: pytest.LogCaptureFixture) -> None:
    aff = Affinity({7: {0, 1}}, cpu=0)
    steer = aff.steer()
    steer.away(7)
    aff.fail.add("set")
    with caplog.at_level(logging.WARNING, "asynckv.nixl"):
        steer.back()
    assert not steer.enabled and "could not restore its CPU mask [0, 1]" in caplog.text


@pytest.mark.skipif(not steering_available() or len(os.sched_getaffinity(0)) < 2,
                    reason="needs affinity masks and two CPUs")
def test_the_real_calls_narrow_a_real_threads_mask_and_the_thread_widens_it_again() -> None:
    mine = os.sched_getaffinity(0)
    steer = Steer()
    parked, go = threading.Event(), threading.Event()
    seen: list[Any] = []

    def thread() -> None:
        seen.append(threading.get_native_id())
        parked.set()
        go.wait(5)
        steer.back()
        seen.append(os.sched_getaffinity(0))

    t = threading.Thread(target=thread)
    t.start()
    assert parked.wait(5) and steer.enabled
    steer.away(t.native_id)
    narrowed = os.sched_getaffinity(seen[0])
    go.set()
    t.join(5)
    assert narrowed < mine and len(narrowed) == len(mine) - 1  # (whichever CPU this thread ran on then)
    assert seen[1] == mine and os.sched_getaffinity(0) == mine and steer.enabled


@pytest.mark.parametrize(("relay", "steer", "steered"), [(True, None, True), (False, None, False),
                                                         (True, False, False), (False, True, True)])
def test_a_laned_plane_steers_its_lanes_with_the_relay_by_default(
        monkeypatch: pytest.MonkeyPatch, relay: bool, steer: bool | None, steered: bool) -> None:
    monkeypatch.setattr(steer_mod, "steering_available", lambda: True)
    plane = LanedDataPlane([NixlDataPlane("me"), NixlDataPlane("me.1")], relay=relay, steer=steer)
    assert plane.steer is steered and all(lane.steer.enabled is steered for lane in plane.lanes)
    monkeypatch.setattr(steer_mod, "steering_available", lambda: False)  # (an OS without affinity masks)
    assert not LanedDataPlane([NixlDataPlane("me"), NixlDataPlane("me.1")], relay=True).steer


class Recording(Steer):
    """A lane's steer that records which thread calls it (``back`` only where an ``away`` came
    before: it runs every engine round), and never touches a real mask."""

    def __init__(self, events: list[Any]) -> None:
        super().__init__(enabled=False)
        self.events, self.steered = events, False

    def away(self, tid: int | None) -> None:
        self.events.append(("away", tid, threading.current_thread().name))
        self.steered = True

    def back(self) -> None:
        if self.steered:
            self.steered = False
            self.events.append(("back", threading.get_native_id(), threading.current_thread().name))


async def test_a_relayed_part_is_steered_by_the_carriers_thread_and_undone_by_its_lanes_own() -> None:
    a, b = FakeAgent(), FakeAgent()
    a.finish = b.finish = True
    plane, settled = await laned([a, b], relay=True)
    events: list[Any] = []
    steers = [Recording(events), Recording(events)]
    for lane, steer in zip(plane.lanes, steers, strict=True):
        lane.steer = steer
    hold = await Held(plane.lanes[1]).held()  # lane 1 busy: the part waits in its queue until let go
    plane.post(1, "peer", split_write(), 30.0)
    await until(lambda: transfers(a) == 1)
    carrier, woken = plane.lanes[0]._thread, plane.lanes[1]._thread
    assert carrier is not None and woken is not None
    assert events == [("away", woken.native_id, carrier.name)]  # (lane 1's steer, from lane 0's thread)
    await hold.let_go()
    await until(lambda: settled == [(1, None)])
    assert events[1] == ("back", woken.native_id, woken.name) and transfers(b) == 1
    plane.post(2, "peer", split_write(), 30.0)  # (lane 0 idle again: a new relay, steered again)
    await until(lambda: [p for p, _ in settled] == [1, 2])
    await until(lambda: len(events) == 4)
    assert events[2:] == [("away", woken.native_id, carrier.name), ("back", woken.native_id, woken.name)]
    await plane.close()


async def test_parts_posted_straight_are_not_steered() -> None:
    a, b = FakeAgent(), FakeAgent()
    a.finish = b.finish = True
    plane, settled = await laned([a, b], relay=False)
    events: list[Any] = []
    for lane in plane.lanes:
        lane.steer = Recording(events)
    plane.post(1, "peer", split_write(), 30.0)
    await until(lambda: settled == [(1, None)])
    assert events == [] and transfers(a) == transfers(b) == 1
    await plane.close()
