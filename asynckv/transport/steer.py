"""Steering a woken thread off its waker's CPU, for the moment of the wake-up.

A split write's second part reaches its lane through the first lane's thread (``lanes.py``:
``Relay``), which wakes the second lane's thread and then starts its own copy, a millisecond or
more without a pause. Linux places a woken thread on its last CPU or the waker's unless it finds
an idle one, and when the cores have been busy lately it does not look for one (the scheduler's
``SIS_UTIL``). Traced on a 2-vCPU AMD EPYC VM (``perf sched``, 16 MiB rooms of
``benchmarks/trace_room.py --interleave``), the second lane was queued behind the first lane's
copy on the same CPU in every room, 0.7-1.0 ms, while the other CPU sat idle: the halves copied
one after the other, the relay notwithstanding.

So the waker first takes its own CPU out of the woken thread's affinity mask: the kernel then
queues it on another CPU. The woken thread puts its mask back at the start of its next round:
from then on it runs where it was placed, and may move as the kernel likes. A steer and its restore
cost about 3 us per relayed part (``sched_getcpu`` 0.1 us through the vDSO, reading a mask 0.5 us,
setting one 1.3 us, twice). Where a call fails (no affinity masks, a seccomp
filter, a mask changed meanwhile) steering stops for that thread, and the wake-up is plain.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Callable

__all__ = ["Steer", "steering_available"]

log = logging.getLogger("asynckv.nixl")


def _load_getcpu() -> Callable[[], int] | None:
    """libc's ``sched_getcpu``, or None where there is none."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    try:
        fn = ctypes.CDLL(None).sched_getcpu
    except (AttributeError, OSError):
        return None
    fn.restype, fn.argtypes = ctypes.c_int, []
    return fn if fn() >= 0 else None


_getcpu = _load_getcpu()


def steering_available() -> bool:
    """Whether this OS lets a thread choose where another thread may run (Linux)."""
    return _getcpu is not None


class Steer:
    """One thread's steering: ``away`` from a thread about to wake it, ``back`` on the thread itself.

    Both run under one lock, so a steer and a restore never interleave: the mask ``back`` restores is
    always the one the thread had before the first ``away`` since its last restore (read then; a mask
    set on the thread while it is steered is replaced by it). ``back`` looks at the flag without the
    lock first: it runs every engine round. A thread that ``away`` narrowed gets its mask back in its
    next round, which the command put after every ``away`` brings (an idle engine also starts a round
    at least every ``deep_idle_s``)."""

    __slots__ = ("_get", "_getcpu", "_lock", "_mask", "_moved", "_set", "enabled")

    def __init__(self, enabled: bool = True, getcpu: Callable[[], int] | None = None,
                 setaffinity: Callable[[int, set[int]], None] | None = None,
                 getaffinity: Callable[[int], set[int]] | None = None) -> None:
        self._getcpu = getcpu or _getcpu
        self._set = setaffinity or getattr(os, "sched_setaffinity", None)
        self._get = getaffinity or getattr(os, "sched_getaffinity", None)
        self.enabled = enabled and None not in (self._getcpu, self._set, self._get)
        self._lock = threading.Lock()
        self._mask: set[int] = set()
        """The thread's own mask, as it was before the first ``away`` since the last ``back``."""
        self._moved = False

    def away(self, tid: int | None) -> None:
        """Before waking thread ``tid``: let it run anywhere its mask allows but on this CPU."""
        if not self.enabled or not tid:
            return
        with self._lock:
            try:
                cpu = self._getcpu()  # type: ignore[misc]
                mask = self._mask if self._moved else set(self._get(tid))  # type: ignore[misc]
                others = mask - {cpu}
                if cpu not in mask or not others:
                    return  # (this CPU is not one it may use, or the only one)
                self._set(tid, others)  # type: ignore[misc]
            except OSError as exc:
                self.enabled = False
                log.debug("thread %s: steering off (%s)", tid, exc)
                return
            self._mask, self._moved = mask, True

    def back(self) -> None:
        """On the steered thread, running: its own mask again."""
        if not self._moved:
            return
        with self._lock:
            if not self._moved:
                return
            self._moved = False
            try:
                self._set(0, self._mask)  # type: ignore[misc]
            except OSError as exc:  # (its mask stays the narrower one: say so)
                self.enabled = False
                log.warning("engine thread: could not restore its CPU mask %s (%s); steering off",
                            sorted(self._mask), exc)
