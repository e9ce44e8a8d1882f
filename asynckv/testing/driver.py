"""The simulator's workload and process faults: it plays the prefill and decode schedulers.

Rooms: senders and receivers created in either order, chunks at random gaps, aborts from
either side, ``clear()`` mid-transfer, ids reused once decode cleared a room, decode pages
handed back the moment decode reports (so any late write is caught). Process faults:
stops longer than the heartbeat bound, kills, ``close()`` mid-transfer, restarts with a new
incarnation. Checks I2 (every room decided within its bound), I3 (on every success) and I5
(probe rooms after faults stopped).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..errors import Aborted
from ..proto import actions as act
from ..proto.receiver import ReceiverRoom
from ..proto.sender import SenderRoom
from ..proto.states import ReceiverState, SenderState
from .simulator import AUX_ROWS, PAGES, SimNode, World

__all__ = ["WORKLOAD_S", "Driver"]

WORKLOAD_S = 3.0
"""Rooms start and faults strike within this many simulated seconds."""


@dataclasses.dataclass
class _Side:
    node: SimNode
    room: SenderRoom | ReceiverRoom | None = None
    pages: list[int] = dataclasses.field(default_factory=list)
    aux: int = -1
    cleared: bool = False
    started: float = 0.0
    stopped_before: float = 0.0
    chunk_at: int = 0
    gone: bool = False
    """The process died: this side vanished with it."""


@dataclasses.dataclass
class _Room:
    room_id: int
    pgroup: int
    dgroup: int
    npages: int
    chunk: int
    senders: list[_Side] = dataclasses.field(default_factory=list)
    receivers: list[_Side] = dataclasses.field(default_factory=list)
    probe: bool = False
    reused: bool = False


class Driver:
    """Plays the prefill and decode schedulers' part, and the faults, on a ``World``."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.rng = world.rng
        self.rooms: list[_Room] = []
        self.by_room: dict[int, tuple[_Room, _Side]] = {}
        self.stopped_total: dict[str, float] = {}
        self.free_pages: dict[str, list[int]] = {}
        self.free_rows: dict[str, list[int]] = {}
        self.next_room = 1
        self.reuse = 0.0
        self.collisions = 0
        """Reused ids prefill cannot tell from a late destination of the old request, so such rooms
        may fail and leave a failure notice: the id went to another pair of groups while the old
        sender may still exist, or came back to the same pair before the old sender even opened."""
        self.ending = False
        """Every room was cleared: the schedulers open nothing more."""
        self.succeeded = self.failed = 0
        world.on_action = self.on_action

    # -- cluster -----------------------------------------------------------------------

    def build(self) -> None:
        rng, w = self.rng, self.world
        for g in range(rng.choice((1, 1, 2))):
            tp = rng.choice((1, 1, 2))
            for r in range(tp):
                self._track(w.add_prefill(g, r, tp))
        for g in range(rng.choice((1, 2))):
            tp = rng.choice((1, 1, 2))
            for r in range(tp):
                self._track(w.add_decode(g, r, tp))

    def _track(self, node: SimNode) -> None:
        self.free_pages[node.name] = list(range(PAGES))
        self.rng.shuffle(self.free_pages[node.name])
        self.free_rows[node.name] = list(range(AUX_ROWS))

    # -- rooms ---------------------------------------------------------------------------

    def start_room(self, when: float, room_id: int | None = None, probe: bool = False,
                   groups: tuple[int, int] | None = None) -> None:
        rng, w = self.rng, self.world
        if room_id is None:
            room_id, self.next_room = self.next_room, self.next_room + 1
        pg, dg = groups or (rng.randrange(len(w.prefill)), rng.randrange(len(w.decode)))
        n = rng.choice((0, 1, 2, 3, 5, 6)) if not probe else 3
        spec = _Room(room_id, pg, dg, n, rng.choice((1, 2, 4)), probe=probe)
        self.rooms.append(spec)
        d_at = when + rng.uniform(0, 0.3)
        p_at = when + rng.uniform(0, 0.3)  # either side may come first
        for node in w.decode[dg]:
            side = _Side(node)
            spec.receivers.append(side)
            w.on(node, d_at, self._open_receiver, spec, side)
        for node in w.prefill[pg]:
            side = _Side(node)
            spec.senders.append(side)
            w.on(node, p_at + rng.uniform(0, 0.05), self._open_sender, spec, side)
        if probe:
            return
        if rng.random() < 0.08:
            side = rng.choice(spec.receivers)
            w.on(side.node, d_at + rng.uniform(0, 0.6), self._abort, side)
        if rng.random() < 0.08:
            side = rng.choice(spec.senders)
            w.on(side.node, p_at + rng.uniform(0, 0.6), self._abort, side)
        if rng.random() < 0.1:
            side = rng.choice(spec.receivers)
            w.on(side.node, d_at + rng.uniform(0, 0.6), self._clear, side)
        if rng.random() < 0.05:
            side = rng.choice(spec.senders)
            w.on(side.node, p_at + rng.uniform(0, 0.6), self._clear, side)

    def _current(self, side: _Side) -> bool:
        return side.node.alive and not side.gone and not side.node.core.closing and not self.ending

    def _open_receiver(self, spec: _Room, side: _Side) -> None:
        node, w = side.node, self.world
        if not self._current(side):
            side.gone = True
            return
        pages, rows = self.free_pages[node.name], self.free_rows[node.name]
        if len(pages) < spec.npages or not rows:
            w.on(node, w.now + 0.05, self._open_receiver, spec, side)  # decode waits for memory
            return
        if spec.room_id in node.core.rooms:
            w.on(node, w.now + 0.05, self._open_receiver, spec, side)  # the old room of this id not cleared yet
            return
        room = w.drive(node, "open_receiver", w.addr(spec.pgroup), spec.room_id)
        side.room = room
        side.pages = [pages.pop() for _ in range(spec.npages)]
        side.aux = rows.pop()
        for page in side.pages:
            node.owner[page] = (spec.room_id, room.epoch)
        node.aux_owner[side.aux] = (spec.room_id, room.epoch)
        side.started = w.now
        side.stopped_before = self.stopped_total.get(node.name, 0.0)
        self.by_room[id(room)] = (spec, side)
        w.drive(node, "receiver_init", room, side.pages, side.aux, None, 0)

    def _open_sender(self, spec: _Room, side: _Side) -> None:
        node, w = side.node, self.world
        if not self._current(side):
            side.gone = True
            return
        pages = self.free_pages[node.name]
        if len(pages) < spec.npages or spec.room_id in node.core.rooms:
            w.on(node, w.now + 0.05, self._open_sender, spec, side)
            return
        side.pages = [pages.pop() for _ in range(spec.npages)]
        for position, page in enumerate(side.pages):
            node.src_owner[page] = (spec.room_id, position)
        side.started = w.now
        side.stopped_before = self.stopped_total.get(node.name, 0.0)
        room = w.drive(node, "open_sender", spec.room_id)
        side.room = room
        self.by_room[id(room)] = (spec, side)
        if room.state is SenderState.READY:
            self._sender_ready(spec, side)

    def _sender_ready(self, spec: _Room, side: _Side) -> None:
        room = side.room
        if not isinstance(room, SenderRoom) or room.num_pages is not None or not room.active:
            return
        self.world.drive(side.node, "sender_init", room, spec.npages, spec.room_id % AUX_ROWS)
        self._next_chunk(spec, side)

    def _next_chunk(self, spec: _Room, side: _Side) -> None:
        room, w = side.room, self.world
        if not isinstance(room, SenderRoom) or not room.active or room.last_queued or room.num_pages is None \
                or not self._current(side):
            return
        start = side.chunk_at
        end = min(start + spec.chunk, spec.npages)
        side.chunk_at = end
        w.drive(side.node, "send_chunk", room, np.asarray(side.pages[start:end], dtype=np.int64), None)

    def _abort(self, side: _Side) -> None:
        room = side.room
        if room is None or side.cleared or not self._current(side):
            return
        method = "abort_receiver" if isinstance(room, ReceiverRoom) else "abort_sender"
        self.world.drive(side.node, method, room, Aborted("aborted by the simulated scheduler"))

    def _clear(self, side: _Side) -> None:
        room = side.room
        if room is None or side.cleared or not self._current(side):
            return
        side.cleared = True
        if isinstance(room, ReceiverRoom):
            self.world.drive(side.node, "clear_receiver", room)
            spec = self.by_room.get(id(room))
            if spec is not None:
                self._maybe_reuse(spec[0])
        else:
            self.world.drive(side.node, "clear_sender", room)
            if not room.active:  # decided: its source pages may be reused
                self._free_src(side)

    def _free_src(self, side: _Side) -> None:
        if side.pages and side.room is not None and isinstance(side.room, SenderRoom):
            self.free_pages[side.node.name].extend(side.pages)
            side.pages = []

    # -- what the cores report ---------------------------------------------------------

    def on_action(self, node: SimNode, a: act.Action) -> None:
        if isinstance(a, act.RoomReady):
            found = self.by_room.get(id(a.room))
            if found is not None:
                self._sender_ready(*found)
        elif isinstance(a, act.ChunkPosted):
            found = self.by_room.get(id(a.room))
            if found is not None:
                self.world.on(node, self.world.now + self.rng.uniform(0, 0.2), self._next_chunk, *found)
        elif isinstance(a, act.Finished):
            found = self.by_room.get(id(a.room))
            if found is not None:
                self._finished(node, *found)

    def _finished(self, node: SimNode, spec: _Room, side: _Side) -> None:
        w, room = self.world, side.room
        stopped = self.stopped_total.get(node.name, 0.0) - side.stopped_before
        if isinstance(room, ReceiverRoom):
            bound = self.receiver_bound() + stopped
            if room.state is ReceiverState.SUCCEEDED:
                self.succeeded += 1
                w.check_success(node, room)
            else:
                self.failed += 1
            if spec.probe and room.state is not ReceiverState.SUCCEEDED:
                w.violation(f"I5: probe room {spec.room_id} from prefill group {spec.pgroup} to {node} failed "
                            f"after faults stopped: {room.reason}")
            for page in side.pages:  # decode hands the pages back at once: I1 catches any later write
                node.owner.pop(page, None)
            node.aux_owner.pop(side.aux, None)
            self.free_pages[node.name].extend(side.pages)
            self.free_rows[node.name].append(side.aux)
            side.pages = []
        else:
            bound = self.sender_bound() + stopped
            if side.cleared:
                self._free_src(side)
        if room is not None and room.finished is not None and room.finished - side.started > bound:
            w.violation(f"I2: {node} room {spec.room_id} took {room.finished - side.started:.2f}s "
                        f"(bound {bound:.2f}s)")
        if not side.cleared:
            w.on(node, w.now + self.rng.choice((0.0, 0.0, 0.01, 0.3)), self._clear_finished, spec, side)

    def _clear_finished(self, spec: _Room, side: _Side) -> None:
        self._clear(side)
        if isinstance(side.room, SenderRoom):
            self._free_src(side)
        self._maybe_reuse(spec)

    def _maybe_reuse(self, spec: _Room) -> None:
        """Once decode cleared a room, a new request may come with the same id (prefill's old sender
        may still be there: the new one waits for it to be cleared)."""
        if spec.probe or spec.reused or not all(s.cleared or s.gone for s in spec.receivers) \
                or self.world.now >= WORKLOAD_S or self.rng.random() >= self.reuse:
            return
        spec.reused = True
        groups = (spec.pgroup, spec.dgroup)
        if self.rng.random() < 0.2:
            groups = (self.rng.randrange(len(self.world.prefill)), self.rng.randrange(len(self.world.decode)))
        if groups != (spec.pgroup, spec.dgroup) or any(s.room is None and not s.gone for s in spec.senders):
            self.collisions += 1
        self.start_room(self.world.now + self.rng.uniform(0, 0.02), room_id=spec.room_id, groups=groups)

    def senders_unopened(self) -> int:
        """Prefill senders that have not opened (waiting for pages, or for an old sender of their room
        id to be cleared) and, once the workload ends, never will: their decode's destination or abort
        waits in prefill's early table for that sender, by design, until the table's TTL."""
        return sum(side.room is None and not side.gone for spec in self.rooms for side in spec.senders)

    def receiver_bound(self) -> float:
        c = self.world.config
        return c.waiting_timeout_s + c.fence_timeout_s + c.heartbeat_interval_s * c.heartbeat_max_failures + 0.5

    def sender_bound(self) -> float:
        c = self.world.config
        dead = c.heartbeat_interval_s * c.heartbeat_max_failures
        return c.bootstrap_timeout_s + 3 * (c.xfer_deadline_base_s + 1.0) + dead + 2.0

    # -- process faults ------------------------------------------------------------------

    def process_faults(self, count: int) -> None:
        rng, w = self.rng, self.world
        nodes = [n for g in w.prefill + w.decode for n in g]
        for _ in range(count):
            node = rng.choice(nodes)
            when = rng.uniform(0.2, WORKLOAD_S)
            kind = rng.choice(("stop", "stop", "stop", "kill", "close"))
            if kind == "stop":
                seconds = rng.choice((0.3, 1.5, 2.5, 4.0))  # some longer than the heartbeat bound
                w.at(when, self._stop, node, seconds)
            else:
                w.at(when, self._end, node, kind, when + rng.uniform(0.3, 2.0))

    def _stop(self, node: SimNode, seconds: float) -> None:
        if node.alive and node.stopped_until is None:
            self.stopped_total[node.name] = self.stopped_total.get(node.name, 0.0) + seconds
            self.world.stop(node, seconds)

    def _end(self, node: SimNode, kind: str, restart_at: float) -> None:
        w = self.world
        if not node.alive or node.core.closing or node.stopped_until is not None:
            return
        if kind == "kill":
            w.kill(node)
        else:
            w.drive(node, "close")
            w.unregister(node)  # a closing prefill removes itself from its bootstrap server
        for spec in self.rooms:
            for side in spec.senders + spec.receivers:
                if side.node is node and kind == "kill":
                    side.gone = True
        w.at(restart_at, self._restart, node)

    def _restart(self, node: SimNode) -> None:
        w = self.world
        if node.alive and not node.closed:
            w.at(w.now + 0.2, self._restart, node)  # a closing manager finishes first
            return
        w.kill(node)
        tp = len((w.prefill if node.kind == "prefill" else w.decode)[node.group])
        add = w.add_prefill if node.kind == "prefill" else w.add_decode
        new = add(node.group, node.rank, tp, node.incarnation + 1)
        self._track(new)
        for spec in self.rooms:
            for side in spec.senders + spec.receivers:
                if side.node is node:
                    side.gone = True

    # -- the end -------------------------------------------------------------------------

    def check_ends(self) -> None:
        """I2: every room of a live rank is decided."""
        for spec in self.rooms:
            for side in spec.senders + spec.receivers:
                room = side.room
                if room is None or side.gone or not side.node.alive or side.node.core.closing:
                    continue
                bound = self.receiver_bound() if isinstance(room, ReceiverRoom) else self.sender_bound()
                stopped = self.stopped_total.get(side.node.name, 0.0) - side.stopped_before
                if side.started + bound + stopped < self.world.now and room.state not in (
                        SenderState.SUCCEEDED, SenderState.FAILED, ReceiverState.SUCCEEDED, ReceiverState.FAILED):
                    self.world.violation(f"I2: {side.node} room {spec.room_id} still {room.state.name} at the end "
                                         f"(started at {side.started:.2f}s)")

    def clear_all(self) -> None:
        for spec in self.rooms:
            for side in spec.senders + spec.receivers:
                if self._current(side) and side.room is not None and side.node.stopped_until is None:
                    self._clear(side)
        self.ending = True

    def clear_all_and_close(self) -> None:
        w = self.world
        self.clear_all()
        for group in w.prefill + w.decode:
            for node in group:
                if node.alive and not node.core.closing:
                    w.drive(node, "close")
