"""Prefill rules about destinations: a decode's ``TransferInfo`` from arrival to its room.

A mixin of ``PrefillCore``. A destination is checked against the geometry its peer registered
before it is kept anywhere (``destinations``): O(1) checks at once, its indices at once when
few, else on a worker thread (``CheckDestination``), while that peer's later messages wait
behind it, in order (a TransferInfo followed by an Abort is still acted on in that order).
Then it goes to its sender; or, when none exists yet, to the early table, within the room's
decode ranks and the table's byte budget; anything refused is answered ``Status(ok=False)``
at once, naming the limit, and counted.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import PeerUnreachable, RemoteProtocolError
from .actions import RoomReady
from .core import Core
from .destinations import (
    CheckDestination,
    DestinationLimits,
    check_destination_indices,
    destination_indices,
    footprint,
    precheck_destination,
    sender_of,
)
from .early import EarlyRoom, EarlyTable, info_bytes
from .messages import Message, TransferInfo
from .sender import ENDED_SEEN, DecodePeer, Destination, PeerPhase, SenderRoom
from .states import Event, SenderState

__all__ = ["DestinationRules", "ended_reason"]


def ended_reason(room: int, ended: DecodePeer, when: str) -> str:
    """Why a sender fails whose destination came in a registration session that ended."""
    return (f"room {room}: the destination from decode {ended.name[:8]} came in a registration session that "
            f"ended before {when} ({ended.bye_reason or 'the session was dropped'})")


@dataclasses.dataclass(eq=False, slots=True)
class _Check:
    """A destination whose indices are being checked off the loop, and what it reserved."""

    info: TransferInfo
    peer: DecodePeer
    nbytes: int


class DestinationRules(Core):
    """Destinations of a prefill rank (see the module docstring)."""

    if TYPE_CHECKING:
        rooms: dict[int, SenderRoom]
        peers: dict[str, DecodePeer]
        early: EarlyTable
        ended: collections.OrderedDict[str, DecodePeer]

        def fail(self, room: SenderRoom, error: BaseException, now: float) -> None: ...

        def _status(self, peer: DecodePeer, room: int, epoch: int, ok: bool, reason: str) -> None: ...

        def _answered(self, room: SenderRoom, decode_id: str, epoch: int, required: int) -> None: ...

        def _notice_answered(self, room: int, decode_id: str, epoch: int, required: int, now: float) -> None: ...

        def _check_page_counts(self, room: SenderRoom, now: float) -> None: ...

    def _init_destinations(self) -> None:
        self._checks: dict[int, _Check] = {}
        """Off-loop checks in flight, by token."""
        self._held: dict[str, collections.deque[tuple[Message, int]]] = {}
        """Per peer with a check in flight: its later messages (with the bytes each reserved), in order."""
        self._check_ids = itertools.count(1)

    def receive(self, msg: Any, now: float) -> None:
        """A decoded control message; one from a peer whose destination is being checked waits for it."""
        held = self._held.get(sender_of(msg) or "")
        if held is None:
            super().receive(msg, now)
            return
        nbytes = footprint(msg)
        if self.early.reserve(nbytes):
            held.append((msg, nbytes))
        elif isinstance(msg, TransferInfo):
            self._refuse_over_budget(msg)
        else:
            self._drop("held_full", f"{type(msg).__name__} behind a destination check (max_early_bytes)")

    def destination_checked(self, token: int, reason: str | None, now: float) -> None:
        """The answer to ``CheckDestination``: act on the destination, then on what waited behind it."""
        check = self._checks.pop(token, None)
        if check is None:
            return  # the core closed meanwhile
        self.early.release(check.nbytes)
        info, peer = check.info, check.peer
        if self.peers.get(peer.name) is peer and peer.phase is PeerPhase.CONNECTED:
            self._take_destination(info, peer, reason, now)
        else:  # its session ended during the check (which followed its duplicate filter and O(1) checks)
            self._ended_destination(info, peer, now, checked=True)
        held = self._held.pop(peer.name, collections.deque())
        while held:
            msg, nbytes = held.popleft()
            self.early.release(nbytes)
            self.receive(msg, now)
            again = self._held.get(peer.name)
            if again is not None:  # that one went off the loop too: the rest waits behind it, in order
                for rest in held:
                    again.append(rest)
                return

    def _drop_checks(self) -> None:
        """Closing: nothing waits for a check any more (the early table's reservations go with it)."""
        self._checks.clear()
        self._held.clear()

    def destination_checks(self) -> int:
        """Destinations being checked plus messages waiting behind them."""
        return len(self._checks) + sum(len(held) for held in self._held.values())

    # -- arrival -----------------------------------------------------------------------------

    def _on_transfer_info(self, info: TransferInfo, now: float, refused: str | None = None) -> None:
        """A destination; ``refused``: the wire already found it unusable (the room fails with it)."""
        if info.prefill_id != self.name:
            self._drop("stale_incarnation", f"room {info.room} meant for {info.prefill_id[:8]}")
            return
        peer = self.peers.get(info.decode_id)
        if peer is None or peer.phase is not PeerPhase.CONNECTED:
            ended = self.ended.get(info.decode_id)
            if ended is None:
                self._drop("unknown_peer", f"room {info.room} from unregistered {info.decode_id[:8]}")
            else:
                self._ended_destination(info, ended, now)
            return
        if not peer.first_time(info.room, info.epoch):
            self._drop("duplicate", f"room {info.room}#{info.epoch} destination again")
            return
        limits = peer.limits
        reason = refused or precheck_destination(info, limits)
        if reason is None and destination_indices(info) >= self.config.offload_min_descs:
            self._check_off_loop(info, peer, limits)
            return
        if reason is None:
            reason = check_destination_indices(info, limits)
        self._take_destination(info, peer, reason, now)

    def _check_off_loop(self, info: TransferInfo, peer: DecodePeer, limits: DestinationLimits) -> None:
        nbytes = info_bytes(info)
        if not self.early.reserve(nbytes):
            self._refuse_over_budget(info)
            return
        token = next(self._check_ids)
        self._checks[token] = _Check(info, peer, nbytes)
        self._held[peer.name] = collections.deque()
        self._emit(CheckDestination(token, info, limits))

    def _take_destination(self, info: TransferInfo, peer: DecodePeer, reason: str | None, now: float) -> None:
        """A destination whose check is done (``reason``: why it is invalid): to its sender, or to wait."""
        room, early = self.rooms.get(info.room), self.early.get(info.room)
        failed = self._owes_notice(early, room, info.decode_id, info.epoch)
        if failed is not None:
            self._status(peer, info.room, info.epoch, False, failed)  # the sender failed, was cleared
            self._notice_answered(info.room, info.decode_id, info.epoch, info.required_dst_info_num, now)
            return
        if room is not None and not self._later_request(room, info.decode_id, info.epoch):
            self._on_destination(room, info, peer, reason, now)
            return
        if reason is not None:  # decode hears it now rather than at its waiting timeout; nothing is kept
            self._refuse(info, "early_invalid", f"room {info.room}: {reason}")
            return
        early = self.early.get_or_add(info.room, now)  # for a sender not created yet
        if early is None:
            self._refuse(info, "early_full", f"room {info.room}: prefill rank has {self.config.max_early_infos} "
                         f"rooms waiting for their sender (max_early_infos)")
            return
        refused = self.early.park(early, Destination(info, peer))
        if refused is not None:
            self._refuse(info, *refused)
            self.early.discard_if_empty(info.room)

    def _ended_destination(self, info: TransferInfo, ended: DecodePeer, now: float, checked: bool = False) -> None:
        """A destination from a session of its decode that ended here before it arrived (it crossed the
        goodbye, or the decode registered again behind it). A decode sends destinations only in a session
        this rank answered, and messages of a pair arrive in order, so while no later session of that
        decode is connected it cannot be a later one's. That decode failed the request with its session
        and needs nothing more for it: the room's sender fails at once (now, or when it opens) rather
        than at its bootstrap timeout, and no failure notice waits for that rank (with nobody to read it,
        for the early table's TTL). Like a live one, it is acted on once, and one for a later request
        reusing the room id waits for that request's sender; one that fails the O(1) checks is dropped
        (its sender keeps its bootstrap timeout: a peer that lies gets no faster path)."""
        if not checked and not ended.first_time(info.room, info.epoch, keep=ENDED_SEEN):
            self._drop("duplicate", f"room {info.room}#{info.epoch} destination again (session ended)")
            return
        if not checked and precheck_destination(info, ended.limits) is not None:
            self._drop("ended_invalid", f"room {info.room}: destination of an ended session fails its checks")
            return
        self.stats["ended_session_info"] += 1
        if self.closing:
            return
        room, early = self.rooms.get(info.room), self.early.get(info.room)
        if self._owes_notice(early, room, info.decode_id, info.epoch) is not None:
            self._notice_answered(info.room, info.decode_id, info.epoch, info.required_dst_info_num, now)
            return
        if room is not None and not self._later_request(room, info.decode_id, info.epoch):
            if info.decode_id not in room.destinations:
                self._answered(room, info.decode_id, info.epoch, info.required_dst_info_num)
                if room.state is SenderState.BOOTSTRAPPING:
                    self.fail(room, PeerUnreachable(ended_reason(info.room, ended, "it arrived")), now)
            return
        early = self.early.get_or_add(info.room, now)  # the sender fails when it opens (``open_sender``)
        empty = np.empty(0, dtype=np.int32)  # (its pages are never used: not kept)
        stub = dataclasses.replace(info, dst_pages=empty, dst_state_indices=empty)
        if early is None or self.early.park(early, Destination(stub, ended)) is not None:
            self._drop("early_full", f"room {info.room}: destination of an ended session not kept (early bounds)")
            self.early.discard_if_empty(info.room)
            ended.seen.pop((info.room, info.epoch), None)  # (nobody was told: a copy may still act)

    def _refuse_over_budget(self, info: TransferInfo) -> None:
        self._refuse(info, "early_bytes", f"room {info.room}: prefill rank holds {self.early.max_bytes} bytes of "
                     f"destinations waiting, at most (max_early_bytes)")

    def _refuse(self, info: TransferInfo, kind: str, reason: str) -> None:
        """Answer a destination that is not kept with ``Status(ok=False)`` now, and count it."""
        self._drop(kind, reason)
        peer = self.peers.get(info.decode_id)
        if peer is not None:
            self._status(peer, info.room, info.epoch, False, reason)

    @staticmethod
    def _owes_notice(early: EarlyRoom | None, room: SenderRoom | None, decode_id: str, epoch: int) -> str | None:
        """The failure a notice holds, if a message of ``decode_id`` for the room id is for the request it answers:
        that rank was told of it with this epoch, or was never told and (when a later sender of the id
        opened meanwhile) never spoke to that sender. A decode rank sends, for each request on a room
        id, its destination or an abort before anything of a later one, so its first message after the
        notice is the notice's request (epochs of different ranks cannot tell requests apart)."""
        if early is None or early.failed is None:
            return None
        known = early.answered.get(decode_id)
        if known is not None:
            return early.failed if known == epoch else None
        owed = room is None or (decode_id not in room.destinations and decode_id not in room.answered)
        return early.failed if owed else None

    @staticmethod
    def _later_request(room: SenderRoom, decode_id: str, epoch: int) -> bool:
        """A message of a decode that already gave this sender another incarnation of the room (a
        destination, or an abort before one) is for a later request reusing the room id: it waits
        for that request's sender."""
        dest = room.destinations.get(decode_id)
        known = dest.epoch if dest is not None else room.answered.get(decode_id)
        return known is not None and known != epoch

    def _on_destination(self, room: SenderRoom, info: TransferInfo, peer: DecodePeer, reason: str | None,
                        now: float) -> None:
        old = room.destinations.get(info.decode_id)
        if room.state is not SenderState.BOOTSTRAPPING:
            self.stats["late_info"] += 1
            why = room.reason if room.exception is not None else "it already has its destinations"
            self._status(peer, room.room, info.epoch, False,
                         f"room {room.room} is {room.state.value} on this prefill rank: {why}")
            self._answered(room, info.decode_id, info.epoch, info.required_dst_info_num)
            return
        room.destinations[info.decode_id] = Destination(info, peer)
        if reason is not None:
            self.fail(room, RemoteProtocolError(f"room {room.room}: {reason}"), now)  # reaches that decode
            return
        room.required = info.required_dst_info_num
        if old is not None and old.epoch != info.epoch:
            self.stats["replaced_info"] += 1
        if len(room.destinations) >= room.required:
            room.move(Event.DESTINATIONS_KNOWN)
            self.deadlines.arm(room, None)
            if room.num_pages is not None:
                self._check_page_counts(room, now)
            if room.active:
                self._emit(RoomReady(room))
