"""Several NIXL engines behind one data plane, so that a prefill rank copies on several cores.

On one host UCX moves DRAM with CMA inside ``transfer()``: the engine thread that posts is
the thread that copies, so one engine copies on one core. Two threads may not share an
agent (its default sync mode segfaulted, and the thread-safe modes serialise the calls), so
each lane is a whole ``NixlDataPlane``: its own agent, registrations, prepared dlists and
thread. Measured on the 2-core VM, raw NIXL, 16 requests of 64 buffers x 32 pages of 32 KiB
into another process: one agent 3.5-4.1 GB/s scattered and 4.7-5.3 contiguous; two agents on
two threads 6.3-6.6 and 8.4-9.2 (``benchmarks/bench_scaling.py`` measures it through asynckv).

A small post (under ``SMALL_POST_BYTES``, 1 MiB, and ``SMALL_POST_DESCRIPTORS``, 256 descriptors
at some 4 us each) goes whole to the first live lane holding no large post that has not settled
yet: lane 0 unless a large copy is under way there (a small post would wait for it); when every
lane holds one, whole to the least loaded. Its copy (about 0.2 ms) takes less time than the loop
spends on its room, so a second copying thread cannot raise the rate; it only wakes and takes
the GIL beside the loop. At 1,000 rooms in flight of 256 KiB each (11 interleaved pairs of runs),
spreading them over two lanes put the prefill's loop lag p99 at 10.9-18.1 ms (median 12.5) and
keeping them on one at 6.8-14.5 (median 9.1, lower in 10 pairs); rooms/s went 1,225 -> 1,276 and
the prefill's CPU per room 0.86 -> 0.81 ms (medians).
A larger post goes to the lane with the fewest posts in flight. A post of several handles (the
write builder cuts a large write into one handle per lane) is split: its handles go round-robin to
several lanes as parts, and it settles once every part did, with the first error; a cancel
reaches every part. Every rule of ``NixlEngine`` still holds per part (one handle in flight,
lease and cancel checked before each handle), so a cancelled or lease-lapsed write can still
land at most one handle per lane. A write with a notification (SGLang's wire) is never split:
the notification goes once all of it landed. Posts of one room may land in any order, as they
already could over TCP. Peers are connected, leased, warmed up and forgotten on every lane.
On a host with no more cores than lanes, the other parts of a split write reach their lanes through
the first lane's thread when that lane is idle, with no post unsettled and no call pending
(``Relay``): it hands them on as it wakes, before its own copy. Woken by the loop, the second thread
often found both cores taken (the loop still running, the first lane starting to copy) and waited in
the run queue behind that copy, which the kernel does not preempt, while the loop's core then sat
idle: traced on the 2-vCPU VM (``perf sched``), the second lane started 0.6-0.7 ms after the first
in most 16 MiB rooms, so the two halves copied one after the other. Woken by the first lane once the
loop has gone back to its poll, it finds that core free: 0.05-0.07 ms apart, and a 16 MiB room took
1.76-1.82 ms instead of 2.18-2.27 (interleaved runs of ``benchmarks/trace_room.py``). A part reaches
its lane after a cancel or a ``forget_peer`` sent to that lane directly; their marks therefore stay
until the post's settle reaches the loop (``NixlDataPlane``). Where there are more cores than lanes,
each woken thread finds one, and the relay would only delay the others. On a 2-vCPU AMD EPYC VM the
relay alone did not do it: the kernel queued the woken thread on the first lane's own CPU, behind its
copy, while the other CPU sat idle (0.6-0.8 ms apart in most rooms). So the first lane's thread also
takes its CPU out of the second thread's affinity mask for the moment of the wake-up (``steer.py``):
0.05-0.11 ms apart, and Q1's 16 MiB one request went 0.56-0.59x -> 0.65-0.72x raw NIXL (from
``send()``: 0.71-0.79x -> 0.91-1.01x) in three interleaved pairs.
Lane 0's agent carries the manager's name; lane ``i`` is ``<name>.<i>`` (a decode never loads
a prefill's metadata, and SGLang's decode matches notifications by their text, not their
sender; asynckv's SGLang decode core counts a writer's lanes as the writer).
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import Callable, Sequence
from typing import Any

from . import steer as steering
from .base import U64, MemoryLayout, Notified, PreppedPiece, Settled, Write
from .nixl import NixlDataPlane

__all__ = ["SMALL_POST_BYTES", "SMALL_POST_DESCRIPTORS", "LanedDataPlane", "usable_cpus"]

SMALL_POST_BYTES, SMALL_POST_DESCRIPTORS = 1 << 20, 256
"""A post under both goes whole to the first live lane with no large post unsettled (lane 0,
mostly): the other lanes' threads stay asleep (see the module docstring)."""


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # (no affinity masks on this OS)
        return os.cpu_count() or 1


class LanedDataPlane:
    """``DataPlane`` over ``lanes`` NIXL engines; posts are spread, everything else goes to all."""

    def __init__(self, lanes: Sequence[NixlDataPlane], relay: bool | None = None, steer: bool | None = None) -> None:
        if not lanes:
            raise ValueError("a laned data plane needs at least one lane")
        self.lanes = tuple(lanes)
        self.relay = usable_cpus() <= len(self.lanes) if relay is None else relay
        """Whether a split write's other parts go through its first lane's thread when that lane is
        idle (see the module docstring); by default where the lanes' threads outnumber no core."""
        wanted = (self.relay and steering.steering_available()) if steer is None else steer
        for lane in self.lanes:
            lane.steer = steering.Steer(enabled=wanted)
        self.steer = all(lane.steer.enabled for lane in self.lanes)
        """Whether a relayed part wakes its lane's thread off the carrier's CPU (``steer.py``): by default
        with the relay; never where the OS has no affinity masks."""
        self.on_settled: Settled = lambda batch: None
        self._owner: dict[int, int] = {}
        """post id -> lane, until it settles (cancels go to that lane only)."""
        self._load = [0] * len(self.lanes)
        self._big = [0] * len(self.lanes)
        """Unsettled large posts (and parts) per lane (``_bigs``: their ids)."""
        self._bigs: set[int] = set()
        self._next = 0
        self._split: dict[int, _Split] = {}
        """part id -> the write it is a part of."""
        self._parts: dict[int, list[int]] = {}
        """post id of a split write -> its part ids (cancels reach every part)."""
        self._in_flight: set[int] = set()
        """Settled posts that left a handle in flight on some lane (``take_in_flight``)."""
        self._part_ids = itertools.count(1 << 62)
        """Part ids: far above any id the cores give a post."""
        for i, lane in enumerate(self.lanes):
            lane.on_settled = self._settled_on(i)

    @classmethod
    def make(cls, name: str, count: int, factory: Callable[[str], NixlDataPlane],
             relay: bool | None = None, steer: bool | None = None) -> LanedDataPlane:
        return cls([factory(name if i == 0 else f"{name}.{i}") for i in range(count)], relay, steer)

    @property
    def name(self) -> str:
        return self.lanes[0].name

    @property
    def alive(self) -> bool:
        return all(lane.alive for lane in self.lanes)

    @property
    def posts_in_flight(self) -> int:
        return sum(lane.posts_in_flight for lane in self.lanes)

    @property
    def on_notified(self) -> Notified | None:
        return self.lanes[0].on_notified

    @on_notified.setter
    def on_notified(self, fn: Notified | None) -> None:
        for lane in self.lanes:
            lane.on_notified = fn

    async def start(self, memory: MemoryLayout) -> bytes:
        """Start every lane (each registers the same memory); returns lane 0's metadata."""
        results = await asyncio.gather(*(lane.start(memory) for lane in self.lanes), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            await self.close()
            raise failed[0]
        return bytes(results[0])  # type: ignore[arg-type]

    async def connect_peer(self, peer: str, metadata: bytes, rows: U64 | None, mem_kind: str) -> None:
        lanes = self._live()  # (posts go to live lanes only; a dead one refuses commands)
        results = await asyncio.gather(*(lane.connect_peer(peer, metadata, rows, mem_kind) for lane in lanes),
                                       return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:  # undo it where it succeeded, so that the peer can be connected anew later
            for lane, result in zip(lanes, results, strict=True):
                if not isinstance(result, BaseException):
                    lane.forget_peer(peer)
            raise failed[0]

    async def warm_up(self, peer: str, dst: tuple[int, int], timeout_s: float) -> None:
        await asyncio.gather(*(lane.warm_up(peer, dst, timeout_s) for lane in self._live()))

    def _live(self) -> list[NixlDataPlane]:
        """The lanes whose engine threads run, or all of them when none does (each then refuses)."""
        return [lane for lane in self.lanes if lane.alive] or list(self.lanes)

    def post(self, post_id: int, peer: str, write: Write, timeout_s: float) -> None:
        """Post ``write`` (see the module docstring for the lane it goes to). ``post_id`` must not be that of a
        post not settled yet (the cores count them): one repeated is refused, as the tables would mix the two."""
        if post_id in self._owner or post_id in self._parts:
            raise ValueError(f"post {post_id} is not settled yet: its id cannot be posted again")
        big = write.nbytes >= SMALL_POST_BYTES or write.descriptors >= SMALL_POST_DESCRIPTORS
        if not big:  # (a small post copies in less time than the loop spends on its room: one lane is enough)
            for lane in range(len(self.lanes)):
                if self._big[lane] == 0 and self.lanes[lane].alive:
                    self._post_on(lane, post_id, peer, write, timeout_s)
                    return
        if not big or write.notif or len(write.pieces) < 2:  # (whole, to the least loaded lane)
            self._post_on(self._least_loaded(), post_id, peer, write, timeout_s, big)
            return
        alive = [i for i, lane in enumerate(self.lanes) if lane.alive] or list(range(len(self.lanes)))
        if len(alive) < 2:
            self._post_on(alive[0], post_id, peer, write, timeout_s, big)
            return
        # Its handles go round-robin to several lanes, as parts that settle it together.
        parts = [p for p in (write.pieces[i::len(alive)] for i in range(len(alive))) if p]
        group = _Split(post_id, len(parts))
        ids = self._parts[post_id] = [next(self._part_ids) for _ in parts]
        chosen = self._pick(alive, len(parts))
        first = self.lanes[chosen[0]]
        carrier = first if self.relay and self._load[chosen[0]] == 0 and not first.calls_pending else None
        shares = []
        for pieces, part_id in zip(parts, ids, strict=True):
            self._split[part_id] = group
            descs = sum(len(p.src_idx) if isinstance(p, PreppedPiece) else len(p.src) for p in pieces)
            # (its own pieces' count, and bytes by it: merged shares keep the bounds on one handle, but for an aux
            # row on the last)
            shares.append(Write(pieces, descs, -(-write.nbytes * descs // max(1, write.descriptors))))
        # Relayed parts first: the carrier hands them on before it starts its own (see the module docstring).
        for i in [*range(1, len(parts)), 0] if carrier is not None else range(len(parts)):
            self._post_on(chosen[i], ids[i], peer, shares[i], timeout_s, big, via=carrier if i else None)

    def _least_loaded(self) -> int:
        """``_pick(live lanes, 1)`` without building the lists (it runs once per post)."""
        load, lanes, n = self._load, self.lanes, len(self._load)
        best = -1
        for k in range(n):
            i = (self._next + k) % n
            if (best < 0 or load[i] < load[best]) and lanes[i].alive:
                best = i
        if best < 0:  # no lane alive: the next one (its engine settles the post at once, with the reason)
            best = self._next
        self._next = (best + 1) % n
        return best

    def _pick(self, alive: list[int], count: int) -> list[int]:
        """``count`` distinct live lanes, those with the fewest posts in flight first, ties in turn."""
        load, n = self._load, len(self._load)
        order = sorted((i for k in range(n) if (i := (self._next + k) % n) in alive), key=lambda i: load[i])
        chosen = order[:count]
        self._next = (chosen[-1] + 1) % n
        return chosen

    def _post_on(self, lane: int, post_id: int, peer: str, write: Write, timeout_s: float, big: bool = False,
                 via: NixlDataPlane | None = None) -> None:
        self._load[lane] += 1
        self._owner[post_id] = lane
        if big:
            self._big[lane] += 1
            self._bigs.add(post_id)
        if via is None:
            self.lanes[lane].post(post_id, peer, write, timeout_s)
        else:
            self.lanes[lane].relay_post(via, post_id, peer, write, timeout_s)

    def cancel(self, post_ids: Sequence[int], reason: BaseException) -> None:
        by_lane: dict[int, list[int]] = {}
        for post_id in [part for p in post_ids for part in self._parts.get(p, [p])]:
            lane = self._owner.get(post_id)
            if lane is not None:
                by_lane.setdefault(lane, []).append(post_id)
        for lane, ids in by_lane.items():
            self.lanes[lane].cancel(ids, reason)

    def set_lease(self, peer: str, until: float) -> None:
        for lane in self.lanes:
            lane.set_lease(peer, until)

    def forget_peer(self, peer: str) -> None:
        for lane in self.lanes:
            lane.forget_peer(peer)

    async def close(self) -> None:
        await asyncio.gather(*(lane.close() for lane in self.lanes))

    def take_in_flight(self, post_id: int) -> bool:
        """``NixlEngine.take_in_flight`` over the lanes (a split write: any of its parts)."""
        try:
            self._in_flight.remove(post_id)
        except KeyError:
            return False
        return True

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(agent, *args)`` on lane 0's engine thread."""
        return await self.lanes[0].call(fn, *args)

    def _settled_on(self, lane: int) -> Settled:
        def settled(batch: list[tuple[int, BaseException | None]]) -> None:
            out: list[tuple[int, BaseException | None]] = []
            for post_id, error in batch:
                if self._owner.pop(post_id, None) is not None:
                    self._load[lane] -= 1
                if post_id in self._bigs:
                    self._bigs.remove(post_id)
                    self._big[lane] -= 1
                in_flight = self.lanes[lane].take_in_flight(post_id)
                group = self._split.pop(post_id, None)
                if group is None:
                    if in_flight:
                        self._in_flight.add(post_id)
                    out.append((post_id, error))
                    continue
                group.left -= 1
                group.error = group.error or error
                group.in_flight = group.in_flight or in_flight  # (any part's handle counts)
                if group.left == 0:  # the write settles once every part did, with the first error
                    self._parts.pop(group.post_id, None)
                    if group.in_flight:
                        self._in_flight.add(group.post_id)
                    out.append((group.post_id, group.error))
            if out:
                self.on_settled(out)
        return settled


class _Split:
    """A write posted as parts on several lanes: it settles when the last part does."""

    __slots__ = ("error", "in_flight", "left", "post_id")

    def __init__(self, post_id: int, parts: int) -> None:
        self.post_id = post_id
        self.left = parts
        self.error: BaseException | None = None
        self.in_flight = False
