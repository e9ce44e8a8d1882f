"""Prefill rules about decode peers: registration sessions, connection, liveness, goodbyes.

A mixin of ``PrefillCore`` (one home per rule: everything about a peer's lifecycle is here).
A decode's ``Register`` opens a session; a new session of the same decode voids the old one
(its rooms fail, its writes are cancelled) before the new one connects. A dropped peer's
writes are cancelled at once and it hears ``Bye`` only once they all settled; its pings are
answered with ``Bye`` too, never with a ``Pong``.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from typing import TYPE_CHECKING, Any

from ..errors import AsyncKVError, PeerRestarted, PeerUnreachable
from .actions import ConnectPeer, DisconnectPeer, ForgetEndpoint, PeerDown, PeerUp, Send, SetLease
from .core import Core
from .endpoints import is_endpoint
from .messages import Bye, Ping, Pong, Register, RegisterResult
from .sender import ENDED_SEEN, DecodePeer, PeerPhase, SenderRoom
from .topology import PeerPlan, plan_peer

__all__ = ["PeerRules"]

log = logging.getLogger("asynckv.prefill")

MAX_LEASE_S = 60.0
"""A decode cannot grant itself writes for longer than this, whatever its Register says."""
MAX_WAITING_REGISTRATIONS = 64
"""Registrations accepted but not yet connected, at most (each keeps its claims and its NIXL
metadata, up to 1 MiB, until its turn: a flood of them cost +1.1 GB before this bound)."""


class PeerRules(Core):
    """Decode peers of a prefill rank (see the module docstring)."""

    if TYPE_CHECKING:
        peers: dict[str, DecodePeer]
        retired: dict[DecodePeer, None]
        rooms: dict[int, SenderRoom]
        draining: dict[SenderRoom, None]
        _blocked: dict[str, DecodePeer]
        ended: collections.OrderedDict[str, DecodePeer]

        def fail(self, room: SenderRoom, error: BaseException, now: float) -> None: ...

        def _maybe_closed(self) -> None: ...

    def peer_connected(self, peer: DecodePeer, error: BaseException | None, now: float) -> None:
        """The data plane answered ``ConnectPeer`` (``error`` None: connected and warmed up)."""
        peer.connecting = False
        if peer.phase is PeerPhase.DRAINING:  # dropped while it was connecting
            if error is None:
                self._emit(DisconnectPeer(peer.name))
            self._peer_progress(peer)
            return
        if error is not None:
            if self.peers.get(peer.name) is peer:
                del self.peers[peer.name]
            self.stats["peers_refused"] += 1
            log.warning("refused decode peer %s at %s: %s", peer.name[:8], peer.endpoint, str(error))  # (not the
            # exception: a handler that keeps records would keep its traceback, and the rows in its frames)
            self._emit(Send(peer.endpoint, RegisterResult(self.name, peer.name, peer.session, False, str(error)),
                            transient=True))
            return
        peer.phase = PeerPhase.CONNECTED
        peer.reg = dataclasses.replace(peer.reg, agent_metadata=b"")  # NIXL holds it now: not kept twice
        self.ended.pop(peer.name, None)  # what this decode sends now belongs to this session
        self._watch(peer, now)  # (its write lease is set before decode can send a destination)
        self._emit(Send(peer.endpoint, RegisterResult(self.name, peer.name, peer.session, True, "")))
        self._emit(PeerUp(peer.name, now - peer.started))
        self.stats["peers_added"] += 1

    def _watch(self, peer: DecodePeer, now: float) -> None:
        """Start the heartbeat of a connected peer and grant its first write lease."""
        state = self.liveness.add(peer.name, peer.endpoint, peer.session, now, lease_s=peer.lease_s)
        self._emit(SetLease(peer.name, state.lease_until))

    def _plan_peer(self, reg: Register) -> PeerPlan:
        """Validate a registration and plan the writes into it (raises ``AsyncKVError`` to refuse it)."""
        return plan_peer(self.kv_args, reg, max_rows=self.config.max_peer_dlist_rows)

    def _new_peer(self, reg: Register, plan: PeerPlan, now: float) -> DecodePeer:
        return DecodePeer.from_register(reg, plan, now, MAX_LEASE_S, self.kv_args.tp_size)

    def declare_dead(self, peer_id: str, error: BaseException, now: float) -> None:
        """Drop a decode peer now: fail its rooms, cancel its writes, say goodbye once they settled."""
        peer = self.peers.get(peer_id)
        if peer is not None:
            self.drop_peer(peer, error, now, say_bye=True)

    def drop_peer(self, peer: DecodePeer, error: BaseException, now: float, *, say_bye: bool,
                  farewell: bool = False) -> None:
        if peer.phase is PeerPhase.DRAINING:
            return
        if peer.phase is PeerPhase.CONNECTED:  # its destinations still on the way mean "nothing more needed"
            self._remember_ended(peer)
        peer.phase, peer.say_bye = PeerPhase.DRAINING, say_bye
        peer.bye_reason = f"declared dead: {error}" if not farewell else str(error)
        if self.peers.get(peer.name) is peer:
            del self.peers[peer.name]
            state = self.liveness.get(peer.name)
            if state is not None and state.session == peer.session:
                self.liveness.remove(peer.name)
        if self._blocked.get(peer.name) is peer:  # it never started connecting
            del self._blocked[peer.name]
        self.retired[peer] = None
        self.stats["peers_dead"] += 1
        self._emit(PeerDown(peer.name, error, farewell))
        for room in [*self.rooms.values(), *self.draining]:  # (a failed room's posts are cancelled already)
            if any(d.peer is peer for d in room.destinations.values()):
                self.fail(room, error, now)
        if not peer.connecting:
            self._emit(DisconnectPeer(peer.name))
        self._peer_progress(peer)

    def _remember_ended(self, peer: DecodePeer) -> None:
        """Keep the last connected session of a decode that ended, until a later one connects (at most
        ``max_peers`` names, oldest first out): a destination it sent before it heard of the end can
        still arrive (``_ended_destination``). It keeps its registration and the last ``ENDED_SEEN`` of its
        duplicate filter (a copy of a destination taken before the end must not wait for a later sender of
        the room id), so each record is bounded whatever the session sent."""
        for _ in range(len(peer.seen) - ENDED_SEEN):
            peer.seen.popitem(last=False)
        self.ended[peer.name] = peer
        self.ended.move_to_end(peer.name)
        while len(self.ended) > self.config.max_peers:
            self.ended.popitem(last=False)

    def _peer_progress(self, peer: DecodePeer) -> None:
        """A dropped peer with nothing in flight: goodbye, then a waiting new session may connect."""
        if peer.phase is not PeerPhase.DRAINING or peer.posts or peer.connecting or peer not in self.retired:
            return
        del self.retired[peer]
        if peer.say_bye:
            self._emit(Send(peer.endpoint, Bye(self.name, peer.session, peer.bye_reason)))
        current = self.peers.get(peer.name)
        if current is None or current.endpoint != peer.endpoint:
            self._emit(ForgetEndpoint(peer.endpoint))
        # The session waiting for this name connects once no older one of the name is still connecting
        # (that one's late answer undoes the name in the data plane: connecting beside it wedged the pair).
        blocked = self._blocked.get(peer.name)
        if blocked is not None and not any(p.name == peer.name and p.connecting for p in self.retired):
            del self._blocked[peer.name]
            if self.peers.get(peer.name) is blocked:
                self._connect(blocked)
        self._maybe_closed()

    def _connect(self, peer: DecodePeer) -> None:
        peer.connecting = True
        self._emit(ConnectPeer(peer))

    def _heartbeat(self, now: float) -> None:
        for state in self._beat(now):
            peer = self.peers.get(state.peer_id)
            if peer is not None and peer.session == state.session:
                self.drop_peer(peer, PeerUnreachable(self._silence(state, now)), now, say_bye=True)
        self._ping_all(now)

    def _on_register(self, reg: Register, now: float) -> None:
        def refuse(reason: str) -> None:
            self.stats["peers_refused"] += 1
            self._emit(Send(reg.endpoint, RegisterResult(self.name, reg.decode_id, reg.session, False, reason),
                            transient=True))

        if reg.prefill_id != self.name:
            self._emit(Send(reg.endpoint, RegisterResult(reg.prefill_id, reg.decode_id, reg.session, False, (
                f"prefill restarted: decode expected incarnation {reg.prefill_id[:8]}, this is {self.name[:8]}")),
                transient=True))
            return
        if self.closing:
            refuse("prefill manager closing")
            return
        current = self.peers.get(reg.decode_id)
        if current is not None and current.session == reg.session:
            if current.phase is PeerPhase.CONNECTED:  # a duplicate: answer again
                self._emit(Send(reg.endpoint, RegisterResult(self.name, reg.decode_id, reg.session, True, "")))
            return
        if current is None and len(self.peers) + len(self.retired) >= self.config.max_peers:
            refuse(f"too many decode peers ({self.config.max_peers})")
            return
        if sum(p.phase is PeerPhase.CONNECTING for p in self.peers.values()) >= MAX_WAITING_REGISTRATIONS:
            refuse(f"too many registrations waiting to connect ({MAX_WAITING_REGISTRATIONS}); try again")
            return
        try:
            plan = self._plan_peer(reg)
        except AsyncKVError as exc:
            log.warning("refused decode peer %s at %s: %s", reg.decode_id[:8], reg.endpoint, exc)
            refuse(str(exc))
            return
        peer = self._new_peer(reg, plan, now)
        if current is not None:  # the decode forgot its old session with us: void it first
            self.drop_peer(current, PeerRestarted(
                f"decode {reg.decode_id[:8]} registered again (session {reg.session})"), now, say_bye=False)
        self.peers[reg.decode_id] = peer
        if any(p.name == reg.decode_id and p.connecting for p in self.retired):
            self._blocked[reg.decode_id] = peer  # connects once the old connection is undone
        else:
            self._connect(peer)

    def _on_ping(self, msg: Ping, now: float) -> None:
        state = self.liveness.get(msg.sender_id)
        if state is not None and state.session == msg.session:
            self.liveness.heard(msg.sender_id, now)
            self._emit(Send(state.endpoint, Pong(self.name, msg.session, msg.seq)))
        elif not any(p.name == msg.sender_id and p.session == msg.session for p in self.retired):
            self._emit(Send(msg.endpoint, Bye(self.name, msg.session, "no such registration session here"),
                            transient=True))
            self._drop("stale", f"ping from unknown session of {msg.sender_id[:8]}")

    def _on_pong(self, msg: Pong, now: float) -> None:
        lease = self.liveness.on_pong(msg.sender_id, msg.session, msg.seq, now)
        if lease is not None:
            self._emit(SetLease(msg.sender_id, lease))
        elif msg.sender_id not in self.liveness:
            self._drop("stale", f"pong from untracked {msg.sender_id[:8]}")

    def _on_bye(self, msg: Bye, now: float) -> None:
        peer = self.peers.get(msg.sender_id)
        if peer is None or peer.session != msg.session:
            self._drop("stale", f"bye from {msg.sender_id[:8]} for another session")
            return
        self.drop_peer(peer, PeerUnreachable(f"peer {msg.sender_id[:8]} closed: {msg.reason}"), now,
                       say_bye=False, farewell=True)

    def version_mismatch(self, msg_type: int, body: dict[str, Any] | None, reason: str, now: float) -> None:
        """A message in another protocol version: a registration is refused naming both versions."""
        body = body or {}
        endpoint, decode_id, session = body.get("endpoint"), body.get("decode_id"), body.get("session", 0)
        if msg_type == Register.TYPE and isinstance(endpoint, str) and isinstance(decode_id, str) \
                and is_endpoint(endpoint) and type(session) is int and session >= 0:
            self._emit(Send(endpoint, RegisterResult(self.name, decode_id, session, False, reason), transient=True))
