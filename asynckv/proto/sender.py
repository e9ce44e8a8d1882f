"""Prefill-side records: one ``SenderRoom`` per room, one ``DecodePeer`` per registered decode rank.

These hold state only; every decision about them is made by ``PrefillCore``.
"""

from __future__ import annotations

import collections
import dataclasses
import enum

from .destinations import DestinationLimits
from .messages import Register, TransferInfo
from .registration import registered_slots
from .states import SENDER_POLL, SENDER_TRANSITIONS, Event, KVPoll, Outcome, SenderState, transition
from .topology import PeerPlan

__all__ = ["ENDED_SEEN", "SEEN_DESTINATIONS", "DecodePeer", "Destination", "PeerPhase", "SenderRoom"]

SEEN_DESTINATIONS = 4096
ENDED_SEEN = 256
"""What a session that ended keeps of its duplicate filter (its latest, those still on the way when it ended)."""


class PeerPhase(enum.Enum):
    CONNECTING = "connecting"
    """The data plane is importing its metadata and warming the connection up."""
    CONNECTED = "connected"
    DRAINING = "draining"
    """Dropped: its rooms failed, its posts are being cancelled; goodbye once they settled."""


@dataclasses.dataclass(eq=False, slots=True)
class DecodePeer:
    """Prefill's view of one registration session of one decode rank."""

    reg: Register
    plan: PeerPlan
    num_pages: int
    num_aux_rows: int
    num_state_slots: int
    lease_s: float
    started: float
    required: int = 1
    """Decode ranks that send each room's destination, for this peer's TP size and ours (as decode's
    ``plan_targets`` computes it): what its destinations must say, and how many a room can have."""
    pool_known: bool = True
    """The registration says how many pages the decode has (asynckv's wire). A stock SGLang decode's
    does not: its destinations are bounded by NIXL's check of its registered memory, and no
    destination dlist is prepared for it."""
    phase: PeerPhase = PeerPhase.CONNECTING
    connecting: bool = False
    """A ConnectPeer was emitted and the data plane has not answered yet."""
    posts: set[int] = dataclasses.field(default_factory=set)
    say_bye: bool = False
    bye_reason: str = ""
    seen: collections.OrderedDict[tuple[int, int], None] = dataclasses.field(default_factory=collections.OrderedDict)
    """(room, epoch) of the destinations this session sent, the last ``SEEN_DESTINATIONS``: each is acted
    on once, so a duplicated one can never reach a later sender of a reused room id."""

    def first_time(self, room: int, epoch: int, keep: int = SEEN_DESTINATIONS) -> bool:
        """Whether ``(room, epoch)`` is new from this session; remembered, with the last ``keep`` at most."""
        key = (room, epoch)
        if key in self.seen:
            return False
        self.seen[key] = None
        while len(self.seen) > keep:
            self.seen.popitem(last=False)
        return True

    @property
    def name(self) -> str:
        return self.reg.decode_id

    @property
    def endpoint(self) -> str:
        return self.reg.endpoint

    @property
    def session(self) -> int:
        return self.reg.session

    @property
    def limits(self) -> DestinationLimits:
        """What this peer's destinations are checked against."""
        return DestinationLimits(self.num_pages, self.num_state_slots, self.num_aux_rows, self.required,
                                 self.reg.page_size)

    @classmethod
    def from_register(cls, reg: Register, plan: PeerPlan, now: float, max_lease_s: float,
                      local_tp: int = 1) -> DecodePeer:
        pages = registered_slots(reg.kv_lens, reg.kv_item_lens)
        aux = registered_slots(reg.aux_lens, reg.aux_item_lens)
        state = registered_slots(reg.state_lens, reg.state_item_lens)
        required = reg.tp_size // local_tp if reg.tp_size >= local_tp else 1
        return cls(reg, plan, pages, aux, state, min(reg.lease_ms / 1000, max_lease_s), now, required)


@dataclasses.dataclass(eq=False, slots=True)
class Destination:
    """Where one decode rank wants a room written."""

    info: TransferInfo
    peer: DecodePeer

    @property
    def epoch(self) -> int:
        return self.info.epoch


@dataclasses.dataclass(eq=False, slots=True)
class SenderRoom(Outcome):
    """The prefill side of one room."""

    room: int
    state: SenderState = SenderState.BOOTSTRAPPING
    exception: BaseException | None = None
    deadline: float | None = None
    destinations: dict[str, Destination] = dataclasses.field(default_factory=dict)
    required: int | None = None
    """How many decode ranks send a destination (from their TransferInfo or Abort)."""
    answered: dict[str, int] = dataclasses.field(default_factory=dict)
    """decode_id -> epoch of decode ranks that are not destinations yet need nothing more: a late
    destination was answered with the failure, or the decode aborted before sending one."""
    num_pages: int | None = None
    aux_index: int = -1
    cursor: int = 0
    last_queued: bool = False
    """The chunk that reaches ``num_pages`` was given."""
    chunks: int = 0
    queued: int = 0
    """Writes waiting for the in-flight byte budget."""
    posts: set[int] = dataclasses.field(default_factory=set)
    """Writes handed to the data plane and not settled yet."""
    cleared: bool = False
    started: float | None = None
    finished: float | None = None

    def poll(self) -> KVPoll:
        return SENDER_POLL[self.state]

    @property
    def active(self) -> bool:
        """Neither succeeded nor failed: it may still post."""
        return self.state in (SenderState.BOOTSTRAPPING, SenderState.READY, SenderState.TRANSFERRING)

    @property
    def decode_prefix_len(self) -> int:
        return max((d.info.decode_prefix_len for d in self.destinations.values()), default=0)

    def move(self, event: Event) -> None:
        self.state = transition(SENDER_TRANSITIONS, self.state, event)

    def __repr__(self) -> str:
        total = "?" if self.num_pages is None else self.num_pages
        return f"<SenderRoom {self.room} {self.state.name} {self.cursor}/{total} pages, {len(self.posts)} posts>"
