"""Room states, the transition tables that decide every state change, and their KVPoll view.

Each side of a room has its own state machine with every real state explicit:

- a **sender** (prefill) that failed while writes were in flight is ``DRAINING``: it writes
  nothing new, but decode is told only once every write has settled;
- a **receiver** (decode) that failed is ``FENCING`` until every prefill rank that got its
  destination has confirmed it writes no more (or died and its write lease ran out); only
  then is it ``FAILED``, and only then may decode hand the pages back.

``KVPoll`` keeps the reference connector's integer values so a scheduler can keep
MIN-reducing poll results across ranks: any failed rank fails the room everywhere. The
README's diagram is generated from ``SENDER_TRANSITIONS`` and ``RECEIVER_TRANSITIONS``.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import TypeVar

from ..errors import LocalProtocolError

__all__ = [
    "Outcome",
    "RECEIVER_POLL",
    "RECEIVER_TRANSITIONS",
    "SENDER_POLL",
    "SENDER_TRANSITIONS",
    "Event",
    "KVPoll",
    "ReceiverState",
    "SenderState",
    "mermaid_diagram",
    "transition",
]


class KVPoll(enum.IntEnum):
    """State of one room on one rank as schedulers see it; terminal states are Failed and Success."""

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


class Outcome:
    """What both room records share: the exception that failed the room, and its text."""

    __slots__ = ()
    exception: BaseException | None

    @property
    def reason(self) -> str | None:
        exc = self.exception
        return None if exc is None else (str(exc) or type(exc).__name__)


class SenderState(enum.Enum):
    """Prefill side of one room."""

    BOOTSTRAPPING = "bootstrapping"
    """Waiting for decode's destination(s)."""
    READY = "ready"
    """Every destination is known; nothing queued yet."""
    TRANSFERRING = "transferring"
    """Chunks are queued for the in-flight budget or their writes are in flight."""
    SUCCEEDED = "succeeded"
    """Every write landed; decode was told."""
    DRAINING = "draining"
    """Failed while writes were in flight: nothing new is posted, decode is told once they settle."""
    FAILED = "failed"
    """Failed and nothing of it is in flight; decode was told."""


class ReceiverState(enum.Enum):
    """Decode side of one room."""

    CREATED = "created"
    """``init()`` not called yet."""
    RESOLVING = "resolving"
    """Looking up the prefill's topology and registering with its ranks."""
    WAITING = "waiting"
    """The destination went to every prefill rank; waiting for their statuses."""
    SCATTERING = "scattering"
    """Every real prefill sender's writes landed in decode's staging slots; decode is copying
    their head slices into the pages (``Config.decode_staging_bytes``)."""
    SUCCEEDED = "succeeded"
    """Every real prefill sender reported that all its writes landed (and any staged slices are in place)."""
    FENCING = "fencing"
    """Failed; waiting until no prefill rank can still write into the pages."""
    FAILED = "failed"
    """Failed and fenced: the pages may be reused."""


class Event(enum.Enum):
    """What happened to a room (past tense)."""

    DESTINATIONS_KNOWN = "destinations known"
    CHUNK_QUEUED = "chunk queued"
    WRITES_LANDED = "writes landed"
    FAILED_WRITES_IN_FLIGHT = "failed, writes in flight"
    WRITES_SETTLED = "writes settled"
    INIT_CALLED = "init called"
    DESTINATION_SENT = "destination sent"
    SENDERS_SUCCEEDED = "senders succeeded"
    SENDERS_STAGED = "senders succeeded into staging"
    SCATTERED = "scattered"
    FAILED_MAY_BE_WRITTEN = "failed, may still be written"
    FENCED = "fenced"
    FAILED = "failed"


_S = SenderState
_R = ReceiverState
_E = Event

SENDER_TRANSITIONS: dict[SenderState, dict[Event, SenderState]] = {
    _S.BOOTSTRAPPING: {_E.DESTINATIONS_KNOWN: _S.READY, _E.FAILED: _S.FAILED},
    _S.READY: {_E.CHUNK_QUEUED: _S.TRANSFERRING, _E.FAILED: _S.FAILED},
    _S.TRANSFERRING: {_E.CHUNK_QUEUED: _S.TRANSFERRING, _E.WRITES_LANDED: _S.SUCCEEDED,
                      _E.FAILED_WRITES_IN_FLIGHT: _S.DRAINING, _E.FAILED: _S.FAILED},
    _S.DRAINING: {_E.WRITES_SETTLED: _S.FAILED},
    _S.SUCCEEDED: {},
    _S.FAILED: {},
}
"""``{state: {event: new_state}}`` of a sender; a move missing here is a local bug."""

RECEIVER_TRANSITIONS: dict[ReceiverState, dict[Event, ReceiverState]] = {
    _R.CREATED: {_E.INIT_CALLED: _R.RESOLVING, _E.FAILED: _R.FAILED},
    _R.RESOLVING: {_E.DESTINATION_SENT: _R.WAITING, _E.FAILED: _R.FAILED},
    _R.WAITING: {_E.SENDERS_SUCCEEDED: _R.SUCCEEDED, _E.SENDERS_STAGED: _R.SCATTERING,
                 _E.FAILED_MAY_BE_WRITTEN: _R.FENCING, _E.FAILED: _R.FAILED},
    _R.SCATTERING: {_E.SCATTERED: _R.SUCCEEDED, _E.FAILED: _R.FAILED},
    _R.FENCING: {_E.FENCED: _R.FAILED},
    _R.SUCCEEDED: {},
    _R.FAILED: {},
}
"""``{state: {event: new_state}}`` of a receiver."""

SENDER_POLL: dict[SenderState, KVPoll] = {
    _S.BOOTSTRAPPING: KVPoll.Bootstrapping, _S.READY: KVPoll.WaitingForInput, _S.TRANSFERRING: KVPoll.Transferring,
    _S.SUCCEEDED: KVPoll.Success, _S.DRAINING: KVPoll.Failed, _S.FAILED: KVPoll.Failed,
}
"""A draining sender already polls Failed: prefill may drop the request (decode waits for the fence)."""

RECEIVER_POLL: dict[ReceiverState, KVPoll] = {
    _R.CREATED: KVPoll.Bootstrapping, _R.RESOLVING: KVPoll.Bootstrapping, _R.WAITING: KVPoll.WaitingForInput,
    _R.SCATTERING: KVPoll.Transferring, _R.SUCCEEDED: KVPoll.Success, _R.FENCING: KVPoll.Transferring,
    _R.FAILED: KVPoll.Failed,
}
"""A fencing receiver polls Transferring, never Failed: its pages may still be written. A scattering one
polls Transferring too: its pages are still being written, by decode itself."""


StateT = TypeVar("StateT", SenderState, ReceiverState)


def transition(table: Mapping[StateT, Mapping[Event, StateT]], state: StateT, event: Event) -> StateT:
    """The state after ``event``; raises ``LocalProtocolError`` for a move the table does not allow."""
    new = table[state].get(event)
    if new is None:
        raise LocalProtocolError(f"{event.value!r} is not allowed in state {state.name}")
    return new


def mermaid_diagram() -> str:
    """The room state diagram, generated from the transition tables (embedded in the README)."""
    lines = ["stateDiagram-v2"]
    lines += _diagram_part("sender", SENDER_TRANSITIONS, SENDER_POLL)
    lines += _diagram_part("receiver", RECEIVER_TRANSITIONS, RECEIVER_POLL)
    return "\n".join(lines)


def _diagram_part(side: str, table: Mapping[StateT, Mapping[Event, StateT]],
                  poll: Mapping[StateT, KVPoll]) -> list[str]:
    lines = [f"    state {side} {{", f"        [*] --> {side}_{next(iter(table)).name}"]
    for state, moves in table.items():
        for event, new in moves.items():
            if new != state:
                lines.append(f"        {side}_{state.name} --> {side}_{new.name}: {event.value}")
    for state in table:
        lines.append(f"        {side}_{state.name}: {state.name} (polls {poll[state].name})")
    lines.append("    }")
    return lines
