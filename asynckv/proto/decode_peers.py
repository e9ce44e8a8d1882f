"""Decode rules about prefill ranks: registration sessions, liveness, lease grants, goodbyes.

A mixin of ``DecodeCore``. Decode registers once per prefill incarnation and session; it
grants leases only to a registered session (a Pong), never to a prefill it gave up on
(its pings get ``Bye``). Declaring a prefill dead fails exactly the rooms that still wait
for it; their pages are handed back once every lease granted to it has run out, at once
when it said goodbye itself (a prefill says goodbye only after its writes settled).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ..errors import AsyncKVError, LayoutMismatch, PeerRestarted, PeerUnreachable, RemoteProtocolError
from .actions import ForgetEndpoint, PeerDown, PeerUp, Send
from .bootstrap import PrefillRank
from .core import Core
from .messages import Bye, Ping, Pong, Register, RegisterResult
from .receiver import ReceiverRoom, Registration
from .topology import PrefillInstance, TargetPlan

__all__ = ["RegistrationRules"]

log = logging.getLogger("asynckv.decode")


class RegistrationRules(Core):
    """Prefill ranks of a decode rank (see the module docstring)."""

    if TYPE_CHECKING:
        rooms: dict[int, ReceiverRoom]
        fencing: dict[tuple[int, int], ReceiverRoom]
        registrations: dict[str, Registration]
        instances: dict[str, PrefillInstance]
        fetched_at: dict[str, float]
        _register: Register
        _sessions: Iterator[int]
        closing: bool

        def fail(self, room: ReceiverRoom, error: BaseException, now: float) -> None: ...

        def _maybe_fenced(self, room: ReceiverRoom, now: float) -> None: ...

        def _maybe_send_destination(self, room: ReceiverRoom, now: float) -> None: ...

        def _target_plan(self, addr: str, instance: PrefillInstance, room: int) -> TargetPlan: ...

        def _staged_register(self, rank: PrefillRank, addr: str) -> dict[str, Any] | None: ...

    def preconnect(self, addr: str, now: float) -> int:
        """Register now with every rank of the fetched instance at ``addr`` that this rank's rooms
        would write from (each DP group's), so the first room does not wait for first contact;
        returns how many registrations started. A registration with no room behaves as one whose
        rooms are done: it times out without failing anything, and a refused one fails nothing."""
        instance = self.instances.get(addr)
        if instance is None or self.closing:
            return 0
        started = 0
        for group in range(instance.dp_size):
            try:
                plan = self._target_plan(addr, instance, group)  # (rooms of DP group g: room % dp_size == g)
            except (LayoutMismatch, RemoteProtocolError):
                continue  # (the rooms of that group fail with the reason when they come)
            for rank in plan.ranks:
                started += rank.agent_id not in self.registrations
                self._ensure_registration(rank, addr, now)
        return started

    def _ensure_registration(self, rank: PrefillRank, addr: str, now: float) -> Registration:
        reg = self.registrations.get(rank.agent_id)
        if reg is not None:
            return reg
        reg = self.registrations[rank.agent_id] = Registration(rank, addr, next(self._sessions), now)
        self.deadlines.arm(reg, now + self.config.handshake_timeout_s)
        staged = self._staged_register(rank, addr)
        reg.staged = staged is not None
        self._emit(Send(rank.endpoint, dataclasses.replace(
            self._register, prefill_id=rank.agent_id, session=reg.session,
            lease_ms=int(self.liveness.lease_s * 1000), **(staged or {}))))
        return reg

    def _registration_timeout(self, reg: Registration, now: float) -> None:
        if reg.registered or self.registrations.get(reg.rank.agent_id) is not reg:
            return
        del self.registrations[reg.rank.agent_id]
        self.instances.pop(reg.addr, None)  # it may have restarted: look the instance up again next time
        exc = PeerUnreachable(f"prefill rank tp={reg.rank.tp_rank} at {reg.rank.endpoint} did not answer "
                              f"registration within {self.config.handshake_timeout_s:.1f}s")
        for room in reg.rooms:
            self.fail(room, exc, now)

    def _on_register_result(self, msg: RegisterResult, now: float) -> None:
        reg = self.registrations.get(msg.prefill_id)
        if msg.decode_id != self.name or reg is None or reg.session != msg.session or reg.registered:
            self._drop("stale", f"registration result from {msg.prefill_id[:8]}")
            return
        self.deadlines.arm(reg, None)
        rooms, reg.rooms = reg.rooms, []
        if msg.ok:
            reg.registered = True
            self.liveness.add(msg.prefill_id, reg.rank.endpoint, reg.session, now)  # grants the first lease
            self._emit(PeerUp(msg.prefill_id, now - reg.started))
            for room in rooms:
                self._maybe_send_destination(room, now)
            return
        del self.registrations[msg.prefill_id]
        self.instances.pop(reg.addr, None)  # look the instance (maybe a new incarnation) up on the next room
        exc: BaseException
        if msg.reason.startswith("prefill restarted"):
            exc = PeerRestarted(msg.reason)
        else:
            exc = LayoutMismatch(f"prefill refused registration: {msg.reason}")
        if not rooms:  # (say why now: no room waits on it, e.g. one made ahead of rooms; the next room hears it too)
            log.warning("prefill rank %s refused a registration no room waits on: %s", msg.prefill_id[:8], exc)
        for room in rooms:
            self.fail(room, exc, now)

    def declare_dead(self, peer_id: str, error: BaseException, now: float, *, fenced_at: float | None = None,
                     farewell: bool = False) -> None:
        """Stop working with a prefill incarnation: fail exactly the rooms it still owes something to.

        Its writes are taken to end at ``fenced_at`` (a goodbye promises that), else when every lease
        granted to it has run out."""
        state = self.liveness.remove(peer_id)
        reg = self.registrations.pop(peer_id, None)
        if fenced_at is None:
            fenced_at = max(now, state.fence_time) if state is not None else now
        if reg is not None:
            self.deadlines.arm(reg, None)
            self.instances.pop(reg.addr, None)  # a new incarnation behind that address is looked up afresh
            for room in reg.rooms:
                self.fail(room, error, now)
        for room in [*self.rooms.values(), *self.fencing.values()]:
            prog = room.ranks.get(peer_id)
            if prog is None or prog.done or prog.fenced_at is not None:
                continue
            prog.fenced_at = fenced_at
            if room.active:
                self.fail(room, error, now)
            else:
                self._maybe_fenced(room, now)
        if reg is None:
            return
        self.stats["peers_dead"] += 1
        self._emit(PeerDown(peer_id, error, farewell))
        if not farewell:  # if it is alive after all, it must stop writing and forget this session
            self._emit(Send(reg.rank.endpoint, Bye(self.name, reg.session, f"declared dead: {error}")))
        self._emit(ForgetEndpoint(reg.rank.endpoint))

    def _stale(self, room: ReceiverRoom, instance: PrefillInstance, now: float) -> bool:
        """The cached topology may name a rank of this room that restarted: it has been quiet for over
        1.5 heartbeats, or it has no live session here and the look-up is older than that. The room
        then looks the instance up again (cheap: one GET)."""
        try:
            ranks = self._target_plan(room.addr, instance, room.room).ranks
        except AsyncKVError:
            return False  # planning the room will fail it with the reason
        limit = 1.5 * self.config.heartbeat_interval_s
        fetched_at = self.fetched_at.get(room.addr, now)
        for rank in ranks:
            state = self.liveness.get(rank.agent_id)
            if now - (fetched_at if state is None else state.last_seen) > limit:
                return True
        return False

    def _retire_replaced(self, old: PrefillInstance, new: PrefillInstance, now: float) -> None:
        for key, rank in old.ranks.items():
            current = new.ranks.get(key)
            if current is not None and current.agent_id != rank.agent_id and rank.agent_id in self.registrations:
                self.declare_dead(rank.agent_id, PeerRestarted(
                    f"prefill rank dp={key[0]} tp={key[1]} pp={key[2]} restarted: incarnation "
                    f"{rank.agent_id[:8]} replaced by {current.agent_id[:8]}"), now)

    def _heartbeat(self, now: float) -> None:
        for state in self._beat(now):  # no grant without hearing a peer: a silent one's leases ran out
            self.declare_dead(state.peer_id, PeerUnreachable(self._silence(state, now)), now,
                              fenced_at=max(now, state.fence_time))
        self._ping_all(now)

    def _on_ping(self, msg: Ping, now: float) -> None:
        reg = self.registrations.get(msg.sender_id)
        if reg is not None and reg.registered and reg.session == msg.session and not self.closed:
            self.liveness.heard(msg.sender_id, now)
            self.liveness.granted(msg.sender_id, now)  # this pong lets prefill write until its ping time + lease
            self._emit(Send(reg.rank.endpoint, Pong(self.name, msg.session, msg.seq)))
            return
        self._emit(Send(msg.endpoint, Bye(self.name, msg.session, "no such registration session here"),
                        transient=True))
        self._drop("stale", f"ping from unknown session of {msg.sender_id[:8]}")

    def _on_pong(self, msg: Pong, now: float) -> None:
        state = self.liveness.get(msg.sender_id)
        if state is None or state.session != msg.session:
            self._drop("stale", f"pong from untracked {msg.sender_id[:8]}")
            return
        self.liveness.heard(msg.sender_id, now)

    def _on_bye(self, msg: Bye, now: float) -> None:
        reg = self.registrations.get(msg.sender_id)
        if reg is None or reg.session != msg.session:
            self._drop("stale", f"bye from {msg.sender_id[:8]} for another session")
            return
        # A prefill says goodbye only once none of its writes can still land.
        self.declare_dead(msg.sender_id, PeerUnreachable(f"peer {msg.sender_id[:8]} closed: {msg.reason}"), now,
                          fenced_at=now, farewell=True)
