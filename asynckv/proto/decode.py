"""DecodeCore: every rule of the decode side, sans-IO.

Feed it events (``receive``, ``topology_fetched``, ``handle_timer`` and the receiver API
calls, each with ``now``) and run the actions it returns (``actions()``). It owns the
room table, the prefill topologies, the registration sessions with prefill ranks,
liveness and the lease grants.

The fencing rules it keeps:

- a failed room is ``FENCING`` until every prefill rank that got its destination has
  answered its ``Abort`` with a status, or was declared dead *and* every lease decode
  granted it has run out; only then is it Failed and the pages may be reused;
- a prefill declared dead is never granted another lease in that session (its pings are
  answered with ``Bye``); the next room registers a new session;
- the death of a rank that already reported success does not fail the room;
- ``Status`` and ``Abort`` name the room's incarnation (``epoch``), so a room id reused
  after ``clear()`` is never completed by the old room's messages.
"""

from __future__ import annotations

import collections
import itertools
import logging
import secrets
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..config import Config
from ..errors import (
    Aborted,
    ClosedError,
    InvalidArgument,
    LayoutMismatch,
    LocalProtocolError,
    PeerUnreachable,
    RemoteProtocolError,
    TransferFailed,
    WaitingTimeout,
)
from ..kernels import validate_pages
from ..layout import KVArgs
from .actions import Closed, FetchTopology, Finished, InitDone, Send
from .core import check_int, check_new_room
from .decode_peers import RegistrationRules
from .decode_staging import StagingRules, StagingSlots
from .messages import Abort, Bye, Ping, Pong, Register, RegisterResult, Status, TransferInfo
from .receiver import RankProgress, ReceiverRoom, Registration
from .states import Event, ReceiverState
from .timers import earliest
from .topology import PrefillInstance, TargetPlan, check_compatible, plan_targets

__all__ = ["DecodeCore", "random_sessions"]

log = logging.getLogger("asynckv.decode")


def random_sessions() -> Iterator[int]:
    """Unguessable registration session numbers (63 random bits, never 0)."""
    while True:
        yield secrets.randbits(63) or 1


class DecodeCore(StagingRules, RegistrationRules):
    """The decode side of one rank (see the module docstring). Rooms and their messages are here;
    registration sessions, liveness and lease grants in ``decode_peers``; staged head slices in
    ``decode_staging``."""

    mode = "decode"

    def __init__(self, name: str, endpoint: str, kv_args: KVArgs, config: Config, register: Register,
                 sessions: Iterator[int] | None = None, staging: StagingSlots | None = None) -> None:
        super().__init__(name, endpoint, kv_args, config)
        self._init_staging(staging)
        self._register = register
        """This rank's Register, sent with prefill_id, session and lease filled in per registration."""
        self.rooms: dict[int, ReceiverRoom] = {}
        self.fencing: dict[tuple[int, int], ReceiverRoom] = {}
        """Cleared rooms still fencing, by (room, epoch): their statuses must still reach them."""
        self.registrations: dict[str, Registration] = {}
        self.instances: dict[str, PrefillInstance] = {}
        self.fetched_at: dict[str, float] = {}
        self.fetching: dict[str, list[ReceiverRoom]] = {}
        self._plans: dict[tuple[str, int], tuple[PrefillInstance, TargetPlan]] = {}
        self._epochs = itertools.count(1)
        self._sessions = sessions if sessions is not None else itertools.count(1)
        """Registration session numbers. A manager draws them at random (``random_sessions``): only
        the prefill that received the Register knows its session, so no one else can complete a room
        (Status), renew liveness (Pong) or end the session (Bye) by naming the public prefill id."""
        self._handlers.update({
            RegisterResult: self._on_register_result, Status: self._on_status, Ping: self._on_ping,
            Pong: self._on_pong, Bye: self._on_bye,
        })

    # -- the surface the pump drives ---------------------------------------------------

    def get_timer(self) -> float | None:
        when = self.deadlines.next()
        return earliest(when, self._next_beat) if len(self.liveness) else when

    def handle_timer(self, now: float) -> None:
        with self._failing_several(now):
            for owner in self.deadlines.pop_due(now):
                if isinstance(owner, Registration):
                    self._registration_timeout(owner, now)
                elif owner.state is ReceiverState.FENCING:
                    self._fence_deadline(owner, now)
                elif owner.active:
                    self.fail(owner, WaitingTimeout(
                        f"room {owner.room}: no result from prefill {owner.addr} after "
                        f"{self.config.waiting_timeout_s:.1f}s in {owner.poll().name}"), now)
            if self._beat_due(now):
                self._heartbeat(now)

    def topology_fetched(self, addr: str, result: PrefillInstance | BaseException, now: float
                         ) -> LayoutMismatch | None:
        """The answer to ``FetchTopology`` (or to the application's look-up): the instance, or why it
        could not be had. Returns why an instance it got cannot pair with this rank, if it cannot."""
        waiting = self.fetching.pop(addr, [])
        if isinstance(result, BaseException):
            for room in waiting:
                self.fail(room, result, now)
            return None
        a = self.kv_args
        try:
            check_compatible(result, page_size=a.page_size, kv_dtype=a.kv_dtype, is_mla=a.is_mla,
                             endpoint=self.endpoint)
        except LayoutMismatch as exc:
            for room in waiting:
                self.fail(room, exc, now)
            return exc
        old = self.instances.get(addr)
        if old is not None:
            with self._failing_several(now):
                self._retire_replaced(old, result, now)
        self.instances[addr] = result
        self.fetched_at[addr] = now
        for room in waiting:
            if room.state is ReceiverState.RESOLVING:
                self._plan_room(room, result, now)
            elif room.plan is None:  # failed while the look-up was on its way
                self._abort_unplanned(room, result)
        return None

    def close(self, now: float) -> None:
        """Fail every room; ``Closed`` follows once every room is fenced, then goodbyes are queued."""
        if self.closing:
            return
        self.closing = True
        with self._failing_several(now):
            for room in list(self.rooms.values()):
                self.fail(room, ClosedError("manager closed"), now)
                self.clear_receiver(room, now)
        self._maybe_closed()

    # -- receiver API --------------------------------------------------------------------

    def open_receiver(self, addr: str, room: int, now: float) -> ReceiverRoom:
        check_new_room(room, self.rooms, self.config.max_rooms, self.closing)
        receiver = self.rooms[room] = ReceiverRoom(room, addr, next(self._epochs))
        return receiver

    def receiver_init(self, room: ReceiverRoom, page_indices: Any, aux_index: Any, state_indices: Any,
                      decode_prefix_len: Any, now: float) -> None:
        """Validate the destination and start sending it (``InitDone`` follows). Bad input raises."""
        if room.initialized:
            raise LocalProtocolError(f"room {room.room}: init() called twice")
        if not room.active:
            return  # failed (aborted) before init: nothing to do
        a = self.kv_args
        pages = validate_pages(page_indices, self.num_pages, "decode page indices")
        aux = check_int(aux_index, "aux_index", low=-1)
        if aux != -1 and aux >= self.num_aux_rows:
            raise InvalidArgument(f"aux_index {aux} outside the registered aux rows [0, {self.num_aux_rows})")
        state = validate_pages([] if state_indices is None else state_indices, a.num_state_slots,
                               "decode state indices")
        prefix = check_int(decode_prefix_len, "decode_prefix_len")
        if prefix % a.page_size:
            raise InvalidArgument(f"decode_prefix_len must be a multiple of page_size {a.page_size}, "
                                  f"got {decode_prefix_len!r}")
        room.pages, room.aux_index = pages.astype(np.int32), aux
        room.state_indices, room.prefix_len = state.astype(np.int32), prefix
        room.initialized, room.started = True, now
        room.move(Event.INIT_CALLED)
        self.deadlines.arm(room, now + self.config.waiting_timeout_s)
        instance = self.instances.get(room.addr)
        if instance is not None and not self._stale(room, instance, now):
            self._plan_room(room, instance, now)
            return
        waiting = self.fetching.setdefault(room.addr, [])
        waiting.append(room)
        if len(waiting) == 1:
            self._emit(FetchTopology(room.addr))

    def abort_receiver(self, room: ReceiverRoom, error: BaseException, now: float) -> None:
        self.fail(room, error, now)

    def clear_receiver(self, room: ReceiverRoom, now: float) -> None:
        """Forget the room; an unfinished one is aborted first (its fence still completes unseen)."""
        if room.cleared:
            return
        if room.active:
            self.fail(room, Aborted("cleared before completion"), now)
        room.cleared = True
        if self.rooms.get(room.room) is room:
            del self.rooms[room.room]
        if room.state in (ReceiverState.FENCING, ReceiverState.SCATTERING):  # (its pages are still written)
            self.fencing[(room.room, room.epoch)] = room

    def instance(self, addr: str) -> PrefillInstance | None:
        return self.instances.get(addr)

    # -- rooms -------------------------------------------------------------------------

    def _plan_room(self, room: ReceiverRoom, instance: PrefillInstance, now: float) -> None:
        try:
            plan = self._target_plan(room.addr, instance, room.room)
        except (LayoutMismatch, RemoteProtocolError) as exc:
            self.fail(room, exc, now)
            return
        room.plan = plan
        has_state = len(room.state_indices) > 0  # (state-only ranks take part as dummies in a room without)
        room.ranks = {t.rank.agent_id: RankProgress(t.rank, t.is_dummy and not (t.state_only and has_state))
                      for t in plan.targets}
        for rank in plan.ranks:
            reg = self._ensure_registration(rank, room.addr, now)
            if not reg.registered:
                reg.rooms.append(room)
        self._maybe_send_destination(room, now)

    def _target_plan(self, addr: str, instance: PrefillInstance, room: int) -> TargetPlan:
        """The rank mapping of a room: the same for every room of one DP group, so it is cached."""
        key = (addr, room % instance.dp_size)
        cached = self._plans.get(key)
        if cached is not None and cached[0] is instance:
            return cached[1]
        a = self.kv_args
        plan = plan_targets(instance, room=room, tp_size=a.tp_size, engine_rank=a.engine_rank, pp_size=a.pp_size,
                            pp_rank=a.pp_rank, is_mla=a.is_mla, total_kv_heads=a.total_kv_head_num,
                            split_state=a.state_split_by_tp)
        if len(self._plans) > 1024:
            self._plans.clear()
        self._plans[key] = (instance, plan)
        return plan

    def _maybe_send_destination(self, room: ReceiverRoom, now: float) -> None:
        if room.state is not ReceiverState.RESOLVING or room.plan is None:
            return
        regs = [self.registrations.get(agent_id) for agent_id in room.ranks]
        if not all(reg is not None and reg.registered for reg in regs):
            return
        empty = np.empty(0, dtype=np.int32)
        plan = room.plan
        staged = [t.rank for t in plan.targets if not t.is_dummy and self.registrations[t.rank.agent_id].staged] \
            if self.staging is not None else []
        if not self._take_slots(room, staged, now):
            return  # waiting for staging slots, or failed for want of them
        for target in plan.targets:
            agent_id = target.rank.agent_id
            prog = room.ranks[agent_id]
            prog.sent = True
            prog.session = self.registrations[agent_id].session
            part = room.staged.get(agent_id)
            pages = empty if target.is_dummy else room.pages if part is None else part.indices
            state = empty if prog.dummy else room.state_indices  # (a staged rank's Register names our state)
            self._emit(Send(target.rank.endpoint, TransferInfo(
                room.room, room.epoch, self.name, agent_id, room.aux_index, plan.required_dst_info_num,
                target.is_dummy, target.write_aux, room.prefix_len, pages, state)))
        room.move(Event.DESTINATION_SENT)
        self._emit(InitDone(room))

    def fail(self, room: ReceiverRoom, error: BaseException, now: float) -> None:
        """Start failing: tell every rank that may still act on the room, then wait for the fence."""
        if not room.active:
            return
        was_resolving = room.state is ReceiverState.RESOLVING
        room.exception = error
        log.info("room %d failing: %s", room.room, error)
        reason = str(error) or type(error).__name__
        required = room.plan.required_dst_info_num if room.plan is not None else 1
        for prog in room.ranks.values():  # dummies and ranks that never got the destination too:
            if not prog.done and prog.fenced_at is None:  # their senders fail now, not at their timeout
                abort = Abort(room.room, room.epoch, self.name, prog.sent, required, reason)
                self._emit(Send(prog.rank.endpoint, abort))
        if room.plan is None:
            self._abort_unplanned_soon(room)
        if any(p.may_write for p in room.ranks.values()):
            room.move(Event.FAILED_MAY_BE_WRITTEN)
            self.deadlines.arm(room, now + self.config.fence_timeout_s)
            self._maybe_fenced(room, now)
        else:
            room.move(Event.FAILED)
            self._finish(room, now)
        if was_resolving:
            self._emit(InitDone(room))

    def _abort_unplanned_soon(self, room: ReceiverRoom) -> None:
        instance = self.instances.get(room.addr)
        if instance is not None:
            self._abort_unplanned(room, instance)
        elif not room.initialized and not self.closing:  # (an initialized one is waiting for the look-up)
            waiting = self.fetching.setdefault(room.addr, [])
            waiting.append(room)
            if len(waiting) == 1:
                self._emit(FetchTopology(room.addr))

    def _abort_unplanned(self, room: ReceiverRoom, instance: PrefillInstance) -> None:
        """A room that failed before its ranks were known (aborted before or during ``init``): its
        senders may exist already, so each target rank hears an Abort now rather than waiting for
        its bootstrap timeout."""
        try:
            plan = self._target_plan(room.addr, instance, room.room)
        except (LayoutMismatch, RemoteProtocolError):
            return
        reason = room.reason or "aborted"
        for target in plan.targets:
            abort = Abort(room.room, room.epoch, self.name, False, plan.required_dst_info_num, reason)
            self._emit(Send(target.rank.endpoint, abort))

    def _maybe_fenced(self, room: ReceiverRoom, now: float) -> None:
        if room.state is not ReceiverState.FENCING:
            return
        pending = [p for p in room.ranks.values() if p.may_write]
        if any(p.fenced_at is None for p in pending):
            return  # an answer is still due (the fence deadline is armed)
        until = max((p.fenced_at or now for p in pending), default=now)
        if until > now:
            self.deadlines.arm(room, until)  # a dead rank's last lease is still running
            return
        room.move(Event.FENCED)
        self._finish(room, now)

    def _fence_deadline(self, room: ReceiverRoom, now: float) -> None:
        silent = [p for p in room.ranks.values() if p.may_write and p.fenced_at is None]
        for prog in silent:
            self.declare_dead(prog.rank.agent_id, PeerUnreachable(
                f"prefill {prog.rank.agent_id[:8]} did not confirm the abort of room {room.room} within "
                f"{self.config.fence_timeout_s:.1f}s"), now)
        self._maybe_fenced(room, now)

    def _finish(self, room: ReceiverRoom, now: float) -> None:
        room.finished = now
        self.deadlines.arm(room, None)
        self.fencing.pop((room.room, room.epoch), None)
        self._emit(Finished(room))
        self._release_slots(room, now)
        self._maybe_closed()

    # -- messages ---------------------------------------------------------------------------

    def _find(self, room: int, epoch: int) -> ReceiverRoom | None:
        current = self.rooms.get(room)
        if current is not None and current.epoch == epoch:
            return current
        return self.fencing.get((room, epoch))

    def _on_status(self, msg: Status, now: float) -> None:
        room = self._find(msg.room, msg.epoch)
        prog = None if room is None else room.ranks.get(msg.prefill_id)
        if room is None or prog is None:
            self._drop("late_status", f"room {msg.room}#{msg.epoch} status from {msg.prefill_id[:8]}")
            return
        reg = self.registrations.get(msg.prefill_id)
        if msg.session != (prog.session if prog.session is not None else reg.session if reg is not None else None):
            self._drop("wrong_session", f"room {msg.room} status from {msg.prefill_id[:8]} names session "
                                        f"{msg.session}, not the one its destination went in")
            return
        if msg.ok and not prog.may_write:
            self._drop("unexpected_status", f"room {msg.room} success from a rank that writes nothing")
            return
        prog.done = True  # a status, either way, means that rank writes no more
        if not msg.ok:
            self.fail(room, TransferFailed(f"prefill rank {msg.sender_rank}: {msg.reason}"), now)
        elif room.state is ReceiverState.WAITING and room.plan is not None:
            room.responses.add(msg.prefill_id)
            if len(room.responses) >= room.required_responses:
                self._senders_succeeded(room, now)
        self._maybe_fenced(room, now)

    # -- helpers ------------------------------------------------------------------------------

    def _maybe_closed(self) -> None:
        if not self.closing or self.closed:
            return
        if any(not r.terminal for r in self.rooms.values()) or self.fencing:
            return
        self.closed = True
        for prefill_id, reg in list(self.registrations.items()):
            self._emit(Send(reg.rank.endpoint, Bye(self.name, reg.session, "manager closed")))
            self.liveness.remove(prefill_id)
            self.deadlines.arm(reg, None)  # (a pending one: its timer stops with the service)
        self.registrations.clear()
        self._emit(Closed())

    def room_counts(self) -> dict[str, int]:
        return {"receivers": len(self.rooms), "fencing_rooms": len(self.fencing),
                "registrations_pending": sum(1 for r in self.registrations.values() if not r.registered),
                "topology_lookups": len(self.fetching), "waiting_for_staging": len(self._slot_waiters)}

    def snapshot(self, now: float) -> dict[str, Any]:
        """Rooms by state and peers with their unfinished rooms: plain JSON types only."""
        by_state = collections.Counter(room.poll().name for room in self.rooms.values())
        per_peer: collections.Counter[str] = collections.Counter()
        for room in self.rooms.values():
            if not room.terminal:
                per_peer.update(list(room.ranks))  # (a mapping would add its values)
        peers = []
        for prefill_id, reg in self.registrations.items():
            state = self.liveness.get(prefill_id)
            heard = None if state is None else now - state.last_seen
            peers.append({"peer": prefill_id, "endpoint": reg.rank.endpoint, "session": reg.session,
                          "phase": "connected" if reg.registered else "connecting", "last_heard_s_ago": heard,
                          "alive": heard is not None and heard <= 2 * self.config.heartbeat_interval_s,
                          "rooms": per_peer[prefill_id]})
        return {"mode": "decode", "name": self.name, "rooms": dict(by_state), "peers": peers,
                "tables": self.room_counts()}
