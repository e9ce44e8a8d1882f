"""Decode rules for staged head slices: prefill ranks that hold fewer heads than this decode rank.

A prefill rank at a larger TP holds a slice of every token row of our pages (its heads). Written
in place that is one NIXL descriptor per token and entry. With a staging area
(``Config.decode_staging_bytes``) decode registers with such a rank *as a decode rank of the
prefill's own TP* whose pages are slots of that area, shaped like the prefill's pages: the
prefill writes whole pages (one descriptor per page, runs merged) and needs nothing new, on
either side of the wire. When every sender of a room has succeeded, the room is ``SCATTERING``:
the pump copies each slot's rows into the slice of its page's token rows (``Scatter``) and
answers ``scattered``; only then is it Succeeded, and its slots are given back as it finishes.
The PP stages of one prefill TP rank share its slots: each writes its own layers' entries of them.
Prefills at several larger TPs share the area: ranks holding ``r`` times fewer heads than a slot
(half ours, see the service) put ``r`` of their pages in it, ``r`` TP ranks of a room sharing its
slots, each with a run of pages of its own (``StagingSlots.part``). Ranks holding more heads than a
slot, or a share that does not divide it (odd head counts), are written per token, with a warning.

A room whose staged ranks find too few free slots waits in ``RESOLVING`` (first come, first
served) until a finishing room gives its slots back; a room needing more slots than the area
holds fails at once, naming the setting. Failed and cleared rooms keep their slots until their
fence completes, as they keep their pages: a rank may still be writing into them.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import numpy.typing as npt

from ..errors import ClosedError, InvalidArgument
from .actions import Scatter
from .core import Core
from .receiver import ReceiverRoom
from .states import Event, ReceiverState

if TYPE_CHECKING:
    from ..layout import KVArgs
    from .bootstrap import PrefillRank
    from .topology import PrefillInstance

__all__ = ["StagedSlice", "StagingRules", "StagingSlots"]

log = logging.getLogger("asynckv.decode")

I32 = npt.NDArray[np.int32]
U64 = npt.NDArray[np.uint64]


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class StagedSlice:
    """What one prefill TP rank (all its PP stages) wrote into staging for one room: page ``indices[k]``
    holds, for every entry, the rows of the room's ``k``-th page that go to bytes ``[dst_offs[e],
    dst_offs[e] + nbytes[e])`` of each token row of entry ``e``; ``slots``: the slots those pages are in
    (shared with other TP ranks of its prefill where a slot holds several). ``agent_id``: its first
    stage's rank."""

    agent_id: str
    slots: I32
    dst_offs: U64
    nbytes: U64
    indices: I32
    """The pages of the area its ranks write (of their size, as their Register describes the area:
    one or more to a slot), told in the TransferInfo: the room's ``k``-th page goes to ``indices[k]``."""
    sub: int
    """Its place among the TP ranks sharing ``slots`` (0 when a slot holds one page); 0 gives them back."""


class StagingSlots(Protocol):
    """Decode's staging area as the core uses it (``asynckv.service.decode_staging``)."""

    def usable(self, tp_prefill: int) -> bool:
        """Whether ranks of a prefill at this TP can write whole pages into the area (the first TP
        it says yes to shapes the slots; a later one must fit them)."""

    def register_fields(self, rank: PrefillRank) -> dict[str, Any]:
        """The fields of our ``Register`` that describe the area to ``rank`` as its own TP's pages."""

    def per_slot(self, tp_prefill: int) -> int:
        """How many pages of a rank at this (usable) TP one slot holds: the slot's heads over the rank's."""

    def part(self, rank: PrefillRank, slots: I32, sub: int) -> StagedSlice:
        """``rank``'s pages in ``slots`` (``sub``: its place among the ``per_slot`` TP ranks sharing them),
        marked unwritten (see the service)."""

    @property
    def slots(self) -> int:
        """Slots in all."""

    def take(self, n: int) -> I32 | None:
        """``n`` free slots, or None when fewer are free."""

    def give(self, slots: I32) -> None:
        """Slots no rank can still write into."""


class StagingRules(Core):
    """The staged-slice rules of ``DecodeCore`` (see the module docstring)."""

    if TYPE_CHECKING:
        kv_args: KVArgs
        rooms: dict[int, ReceiverRoom]
        instances: dict[str, PrefillInstance]
        closing: bool

        def fail(self, room: ReceiverRoom, error: BaseException, now: float) -> None: ...

        def _finish(self, room: ReceiverRoom, now: float) -> None: ...

        def _maybe_send_destination(self, room: ReceiverRoom, now: float) -> None: ...

    staging: StagingSlots | None = None
    _slot_waiters: collections.deque[ReceiverRoom]

    def _init_staging(self, staging: StagingSlots | None) -> None:
        self.staging = staging
        self._slot_waiters = collections.deque()
        """Rooms waiting for free slots, in arrival order."""
        self._batching = 0
        self._retry_due = False
        self._told_per_token: dict[str, PrefillInstance] = {}
        """The instance at each address whose ranks were found to go per token (warned once); an address
        whose instance was replaced or dropped leaves it at the next warning."""

    @contextlib.contextmanager
    def _failing_several(self, now: float) -> Iterator[None]:
        """While a loop fails several rooms (close, a timer tick or heartbeat, a replaced instance), the
        slots they free go to waiting rooms only after it: a waiting room handed slots midway could be
        the next one the loop fails, its destination just sent (it would then fence on a transfer
        started by its own failure)."""
        self._batching += 1
        try:
            yield
        finally:
            self._batching -= 1
            if not self._batching and self._retry_due:
                self._retry_due = False
                self._serve_waiters(now)

    def _staged_register(self, rank: PrefillRank, addr: str) -> dict[str, Any] | None:
        """Our Register's fields for ``rank`` when it writes into staging, else None."""
        instance = self.instances.get(addr)
        if self.staging is None or instance is None:
            return None
        if self.staging.usable(instance.tp_size):
            return self.staging.register_fields(rank)
        if instance.tp_size > self.kv_args.tp_size and self._told_per_token.get(addr) is not instance:
            # Once an instance, whichever of its ranks we pair with; entries of replaced instances go.
            told = {a: i for a, i in self._told_per_token.items() if self.instances.get(a) is i}
            self._told_per_token = {**told, addr: instance}
            log.warning("prefill %s (TP %d) writes into this rank per token, one descriptor per token and entry: its "
                        "ranks' pages do not fit the decode staging area's slots (ranks holding more heads than a "
                        "slot, or a share that does not divide it, go per token)", addr, instance.tp_size)
        return None

    def _take_slots(self, room: ReceiverRoom, staged: list[PrefillRank], now: float) -> bool:
        """Slots for ``staged`` (the room's real ranks that write into staging): ``len(pages)`` for each
        prefill TP rank, shared by its PP stages (each writes its own layers' entries), or for each
        ``per_slot`` of them where a slot holds that many of their pages. True when taken (or none
        needed); False when the room waits for slots or failed for want of them."""
        n, staging = len(room.pages), self.staging
        if not staged or n == 0 or room.staged or staging is None:  # (ranks are staged only with an area)
            return True
        stages: dict[int, list[PrefillRank]] = {}
        for rank in staged:
            stages.setdefault(rank.tp_rank, []).append(rank)
        per_slot = staging.per_slot(staged[0].tp_size)  # (one instance: one TP)
        groups = -(-len(stages) // per_slot)
        need = n * groups
        if need > staging.slots:
            shared = f", {per_slot} to a slot" if per_slot > 1 else ""
            self.fail(room, InvalidArgument(
                f"room {room.room} needs {need} staging slots ({n} pages from each of {len(stages)} prefill TP "
                f"ranks holding fewer heads{shared}), the decode staging area holds {staging.slots}: raise "
                f"decode_staging_bytes"), now)
            return False
        if self._slot_waiters and self._slot_waiters[0] is not room:
            if room not in self._slot_waiters:
                self._slot_waiters.append(room)
            return False  # first come, first served
        taken: list[I32] = []
        for _ in range(groups):
            slots = staging.take(n)
            if slots is None:
                for got in taken:
                    staging.give(got)  # (never written: the destination has not gone out)
                if room not in self._slot_waiters:
                    self._slot_waiters.append(room)
                return False
            taken.append(slots)
        if self._slot_waiters and self._slot_waiters[0] is room:
            self._slot_waiters.popleft()
        for i, ranks in enumerate(stages.values()):
            part = staging.part(ranks[0], taken[i // per_slot], i % per_slot)
            for rank in ranks:
                room.staged[rank.agent_id] = part
        return True

    def _senders_succeeded(self, room: ReceiverRoom, now: float) -> None:
        """Every real sender succeeded: scatter what was staged, else the room has succeeded."""
        if room.staged:
            room.move(Event.SENDERS_STAGED)
            self.deadlines.arm(room, None)  # (a local copy: it ends, and nothing may abort it midway)
            self._emit(Scatter(room, tuple(dict.fromkeys(room.staged.values()))))  # (one per TP rank)
            return
        room.move(Event.SENDERS_SUCCEEDED)
        self._finish(room, now)

    def scattered(self, room: ReceiverRoom, error: BaseException | None, now: float) -> None:
        """The answer to ``Scatter``: the staged slices are in the pages, or copying them raised."""
        if room.state is not ReceiverState.SCATTERING:
            raise ValueError(f"room {room.room} is not scattering ({room.state.name})")
        if error is not None:
            room.exception = error
            log.log(logging.INFO if isinstance(error, ClosedError) else logging.ERROR,  # (a cancel, not a fault)
                    "room %d: copying its staged head slices failed: %s", room.room, error)
            room.move(Event.FAILED)
        else:
            room.move(Event.SCATTERED)
        self._finish(room, now)

    def _release_slots(self, room: ReceiverRoom, now: float) -> None:
        """A finished room's slots are free (no rank can write into them), and waiting rooms may go on."""
        if room.staged and self.staging is not None:
            for part in dict.fromkeys(room.staged.values()):  # (a TP rank's PP stages share one)
                if part.sub == 0:  # (the TP ranks sharing slots: once)
                    self.staging.give(part.slots)
            room.staged.clear()
        if room in self._slot_waiters:
            self._slot_waiters.remove(room)
        if self._batching:
            self._retry_due = bool(self._slot_waiters)
            return
        self._serve_waiters(now)

    def _serve_waiters(self, now: float) -> None:
        """Send the destinations of waiting rooms, first come first served, while slots last (none
        once closing: close fails them all)."""
        while self._slot_waiters and not self.closing:
            head = self._slot_waiters[0]
            if head.state is not ReceiverState.RESOLVING:
                self._slot_waiters.popleft()
                continue
            self._maybe_send_destination(head, now)
            if self._slot_waiters and self._slot_waiters[0] is head:
                return  # still too few slots
