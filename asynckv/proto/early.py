"""Prefill: what is known of a room while no sender exists for it.

- destinations (``TransferInfo``) that arrived before the prefill scheduler created the sender;
- aborts from decode that arrived before the sender (a sender created later fails at once);
- a *failure notice*: the sender failed (aborted, timed out) and was cleared before its
  destinations arrived, so a destination arriving later is answered ``Status(ok=False)`` at
  once instead of waiting for decode's timeout.

Bounded three ways: by count of rooms and by age (``ttl_s``), oldest first, and when full,
records without a usable destination (one from a session still connected) make room first;
per room, by the decode ranks a room can have (destinations: its ``required_dst_info_num``,
which prefill checked against the sender's registered geometry; aborts and answered ranks:
``max_ranks``); and by bytes over the whole table (``max_bytes``), which also covers
destinations waiting for an off-loop check (``reserve``). What a bound refuses is the
caller's to answer at once.
"""

from __future__ import annotations

import collections
import dataclasses

from .messages import Abort, TransferInfo
from .sender import Destination, PeerPhase

__all__ = ["RECORD_BYTES", "EarlyRoom", "EarlyTable", "info_bytes"]

RECORD_BYTES = 256
"""What a record costs besides its arrays and strings (dict slots, objects): charged too, so that
many small records are bounded by bytes as well."""


def info_bytes(info: TransferInfo) -> int:
    """What keeping a destination costs: its index arrays, its identifiers and a record."""
    return int(info.dst_pages.nbytes + info.dst_state_indices.nbytes) + len(info.decode_id) + RECORD_BYTES


def _abort_bytes(abort: Abort) -> int:
    return len(abort.reason) + len(abort.decode_id) + RECORD_BYTES


@dataclasses.dataclass(eq=False, slots=True)
class EarlyRoom:
    deadline: float
    infos: dict[str, Destination] = dataclasses.field(default_factory=dict)
    """Destinations by decode_id, with the registration session (peer) they came in."""
    aborts: dict[str, Abort] = dataclasses.field(default_factory=dict)
    """decode_id -> the aborts that came before the sender."""
    failed: str | None = None
    """Why the cleared sender failed, for destinations that arrive late."""
    answered: dict[str, int] = dataclasses.field(default_factory=dict)
    """decode_id -> the room incarnation (epoch) told of ``failed``, or that aborted itself."""
    required: int | None = None
    nbytes: int = 0
    """What this record is charged against the table's byte budget."""


class EarlyTable:
    def __init__(self, max_rooms: int, ttl_s: float, stats: collections.Counter[str], *,
                 max_bytes: int = 256 * 2**20, max_ranks: int = 4096) -> None:
        self.max_rooms = max_rooms
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self.max_ranks = max_ranks
        """Aborts and answered decode ranks kept per room (more decode ranks than peers cannot exist)."""
        self._rooms: collections.OrderedDict[int, EarlyRoom] = collections.OrderedDict()
        self.nbytes = 0
        """Bytes charged by the records of every room."""
        self.pending = 0
        """Bytes reserved by destinations (and messages) waiting for an off-loop check."""
        self.stats = stats
        """Counts ``early_expired`` and ``early_evicted`` records."""

    def __len__(self) -> int:
        return len(self._rooms)

    def get(self, room: int) -> EarlyRoom | None:
        return self._rooms.get(room)

    def pop(self, room: int) -> EarlyRoom | None:
        early = self._rooms.pop(room, None)
        if early is not None:
            self.nbytes -= early.nbytes
        return early

    def get_or_add(self, room: int, now: float) -> EarlyRoom | None:
        """The record of ``room``, made if needed. When the table is full the oldest record without a
        usable destination goes (notices, aborts and destinations from sessions that ended only make
        failures faster; a live destination is needed to transfer at all); None when every record
        holds one."""
        early = self._rooms.get(room)
        if early is not None:
            return early
        self.expire(now)
        if len(self._rooms) >= self.max_rooms:
            victim = next((r for r, e in self._rooms.items() if not any(
                d.peer.phase is PeerPhase.CONNECTED for d in e.infos.values())), None)
            if victim is None:
                return None
            self.pop(victim)
            self.stats["early_evicted"] += 1
        early = self._rooms[room] = EarlyRoom(now + self.ttl_s)
        return early

    def discard_if_empty(self, room: int) -> None:
        """Forget a record that ended up holding nothing (what it was made for was refused)."""
        early = self._rooms.get(room)
        if early is not None and not early.infos and not early.aborts and early.failed is None:
            self.pop(room)

    # -- what a room keeps, charged against the byte budget ----------------------------------

    def park(self, early: EarlyRoom, dest: Destination) -> tuple[str, str] | None:
        """Keep a destination for the sender to come; or which bound refused it (``early_room_full``,
        ``early_bytes``) and why, naming the limit."""
        info = dest.info
        old = early.infos.get(info.decode_id)
        if old is None and len(early.infos) >= info.required_dst_info_num:
            return "early_room_full", (
                f"room {info.room} already has {len(early.infos)} destinations waiting for its sender, as many as "
                f"its decode ranks (required_dst_info_num={info.required_dst_info_num})")
        cost, refund = info_bytes(info), 0 if old is None else info_bytes(old.info)
        if not self._fits(cost - refund):
            return "early_bytes", (
                f"room {info.room}: prefill rank holds {self.nbytes + self.pending} bytes of destinations waiting, "
                f"a destination of {cost} more exceeds max_early_bytes={self.max_bytes}")
        self._charge(early, cost - refund)
        early.infos[info.decode_id] = dest
        return None

    def unpark(self, early: EarlyRoom, decode_id: str) -> Destination | None:
        dest = early.infos.pop(decode_id, None)
        if dest is not None:
            self._charge(early, -info_bytes(dest.info))
        return dest

    def keep_abort(self, early: EarlyRoom, abort: Abort) -> bool:
        """Keep an abort for the sender to come (False: a bound refused it)."""
        old = early.aborts.get(abort.decode_id)
        if old is None and len(early.aborts) >= self.max_ranks:
            return False
        delta = _abort_bytes(abort) - (0 if old is None else _abort_bytes(old))
        if not self._fits(delta):
            return False
        self._charge(early, delta)
        early.aborts[abort.decode_id] = abort
        return True

    def mark_answered(self, early: EarlyRoom, decode_id: str, epoch: int) -> bool:
        """``decode_id`` learnt of the notice, or aborted (False: a bound refused to record it)."""
        if decode_id not in early.answered:
            if len(early.answered) >= self.max_ranks or not self._fits(len(decode_id) + RECORD_BYTES):
                return False
            self._charge(early, len(decode_id) + RECORD_BYTES)
        early.answered[decode_id] = epoch
        return True

    def leave_notice(self, early: EarlyRoom, failed: str, answered: dict[str, int], required: int | None) -> bool:
        """Record why a cleared sender failed, and the decode ranks already told (False: refused)."""
        answered = dict(list(answered.items())[:self.max_ranks])
        cost = len(failed) + RECORD_BYTES + sum(len(d) + RECORD_BYTES for d in answered)
        old = 0 if early.failed is None else len(early.failed) + RECORD_BYTES + sum(
            len(d) + RECORD_BYTES for d in early.answered)
        if not self._fits(cost - old):
            return False
        self._charge(early, cost - old)
        early.failed, early.answered, early.required = failed, answered, required
        return True

    def drop_notice(self, room: int, now: float) -> None:
        """The notice of ``room`` is spent (every decode rank was answered), or cannot be kept. What
        else waits in the record is for a later request reusing the room id: it stays, with a TTL
        of its own from now (not the notice's)."""
        early = self._rooms.get(room)
        if early is None:
            return
        if not early.infos and not early.aborts:
            self.pop(room)
            return
        spent = sum(len(d) + RECORD_BYTES for d in early.answered)
        self._charge(early, -(spent + (0 if early.failed is None else len(early.failed) + RECORD_BYTES)))
        early.failed, early.answered, early.required = None, {}, None
        early.deadline = now + self.ttl_s
        self._rooms.move_to_end(room)  # (expiry takes the oldest first)

    def reserve(self, nbytes: int) -> bool:
        """Charge bytes that wait outside any room (a destination being checked off the loop)."""
        if not self._fits(nbytes):
            return False
        self.pending += nbytes
        return True

    def release(self, nbytes: int) -> None:
        self.pending -= nbytes

    def _fits(self, nbytes: int) -> bool:
        return nbytes <= 0 or self.nbytes + self.pending + nbytes <= self.max_bytes

    def _charge(self, early: EarlyRoom, nbytes: int) -> None:
        early.nbytes += nbytes
        self.nbytes += nbytes

    # -- age -----------------------------------------------------------------------------------

    def expire(self, now: float) -> None:
        while self._rooms:
            room, early = next(iter(self._rooms.items()))
            if early.deadline > now:
                return
            self.pop(room)
            self.stats["early_expired"] += 1

    def clear(self) -> None:
        """Forget every room and every reservation (the core is closing)."""
        self._rooms.clear()
        self.nbytes = self.pending = 0

    def next_deadline(self) -> float | None:
        return next(iter(self._rooms.values())).deadline if self._rooms else None
