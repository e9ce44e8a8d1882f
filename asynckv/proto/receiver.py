"""Decode-side records: one ``ReceiverRoom`` per room, one ``Registration`` per prefill rank.

These hold state only; every decision about them is made by ``DecodeCore``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from .bootstrap import PrefillRank
from .states import RECEIVER_POLL, RECEIVER_TRANSITIONS, Event, KVPoll, Outcome, ReceiverState, transition
from .topology import TargetPlan

if TYPE_CHECKING:
    from .decode_staging import StagedSlice

__all__ = ["RankProgress", "ReceiverRoom", "Registration"]


@dataclasses.dataclass(eq=False, slots=True)
class RankProgress:
    """What one prefill rank has done for one room."""

    rank: PrefillRank
    dummy: bool
    sent: bool = False
    """The room's destination went to this rank (it may write, unless it is a dummy)."""
    session: int | None = None
    """The registration session the destination went in: only a status naming it counts."""
    done: bool = False
    """It reported a terminal status: it writes nothing more into the room."""
    fenced_at: float | None = None
    """It was declared dead: none of its writes can land after this time."""

    @property
    def may_write(self) -> bool:
        """Could still write into the room, as far as decode knows."""
        return not self.dummy and self.sent and not self.done


@dataclasses.dataclass(eq=False, slots=True)
class ReceiverRoom(Outcome):
    """The decode side of one room."""

    room: int
    addr: str
    epoch: int
    state: ReceiverState = ReceiverState.CREATED
    exception: BaseException | None = None
    deadline: float | None = None
    pages: npt.NDArray[np.int32] = dataclasses.field(default_factory=lambda: np.empty(0, dtype=np.int32))
    aux_index: int = -1
    state_indices: npt.NDArray[np.int32] = dataclasses.field(default_factory=lambda: np.empty(0, dtype=np.int32))
    prefix_len: int = 0
    initialized: bool = False
    plan: TargetPlan | None = None
    ranks: dict[str, RankProgress] = dataclasses.field(default_factory=dict)
    """By prefill agent id (incarnation)."""
    responses: set[str] = dataclasses.field(default_factory=set)
    """Real senders (prefill agent ids) that reported success. By agent, not by the ``sender_rank`` a
    status names: a rank could name another's number, and that one's own success would then count for
    nothing."""
    cleared: bool = False
    started: float | None = None
    finished: float | None = None
    staged: dict[str, StagedSlice] = dataclasses.field(default_factory=dict)
    """By prefill agent id: the staging slots that rank writes instead of our pages (``decode_staging``)."""

    def poll(self) -> KVPoll:
        return RECEIVER_POLL[self.state]

    @property
    def active(self) -> bool:
        """Not failed or failing, not succeeded."""
        return self.state in (ReceiverState.CREATED, ReceiverState.RESOLVING, ReceiverState.WAITING)

    @property
    def terminal(self) -> bool:
        return self.state in (ReceiverState.SUCCEEDED, ReceiverState.FAILED)

    def move(self, event: Event) -> None:
        self.state = transition(RECEIVER_TRANSITIONS, self.state, event)

    @property
    def required_responses(self) -> int:
        """Senders whose success the room waits for: its plan's, less state-only ranks when it has no state."""
        return sum(not p.dummy for p in self.ranks.values())

    def __repr__(self) -> str:
        need = self.required_responses if self.plan else "?"
        return (f"<ReceiverRoom {self.room}#{self.epoch} {self.state.name} {len(self.responses)}/{need} senders "
                f"from {self.addr}>")


@dataclasses.dataclass(eq=False, slots=True)
class Registration:
    """Decode's registration session with one prefill rank (incarnation)."""

    rank: PrefillRank
    addr: str
    session: int
    started: float
    registered: bool = False
    staged: bool = False
    """We registered as a decode of the prefill's TP whose pages are staging slots (``decode_staging``)."""
    deadline: float | None = None
    rooms: list[ReceiverRoom] = dataclasses.field(default_factory=list)
    """Rooms waiting for this registration to complete."""
