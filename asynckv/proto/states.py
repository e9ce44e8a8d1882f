"""Room states and the one transition table that decides every state change.

``KVPoll`` keeps the reference connector's integer values so a scheduler can keep
MIN-reducing poll results across ranks: any failed rank fails the room everywhere.
"""

from __future__ import annotations

import enum

from ..errors import LocalProtocolError

__all__ = ["TRANSITIONS", "Event", "KVPoll", "RoomState", "Side", "mermaid_diagram"]


class KVPoll(enum.IntEnum):
    """State of one room on one rank; terminal states are Failed and Success."""

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


class Side(enum.Enum):
    SENDER = "sender"
    RECEIVER = "receiver"


class Event(enum.Enum):
    """What happened to a room (past tense)."""

    DESTINATION_RECEIVED = "destination received"
    """Sender: every decode destination of the room is known."""
    DESTINATION_SENT = "destination sent"
    """Receiver: the destination pages were handed to every prefill rank."""
    CHUNK_POSTED = "chunk posted"
    """Sender: a chunk's writes were handed to the data plane."""
    TRANSFER_COMPLETED = "transfer completed"
    """Sender: every write landed. Receiver: every prefill sender reported success."""
    FAILED = "failed"
    """Anything went wrong, or the room was aborted or timed out."""


_B, _W, _T, _S, _F = (KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Transferring,
                      KVPoll.Success, KVPoll.Failed)

TRANSITIONS: dict[Side, dict[KVPoll, dict[Event, KVPoll]]] = {
    Side.SENDER: {
        _B: {Event.DESTINATION_RECEIVED: _W, Event.FAILED: _F},
        _W: {Event.CHUNK_POSTED: _T, Event.FAILED: _F},
        _T: {Event.CHUNK_POSTED: _T, Event.TRANSFER_COMPLETED: _S, Event.FAILED: _F},
        _S: {},
        _F: {},
    },
    Side.RECEIVER: {
        _B: {Event.DESTINATION_SENT: _W, Event.FAILED: _F},
        _W: {Event.TRANSFER_COMPLETED: _S, Event.FAILED: _F},
        _S: {},
        _F: {},
    },
}
"""``{side: {state: {event: new_state}}}``; the README's state diagram is generated from it."""


class RoomState:
    """The state of one room. Terminal states are sticky; Failed keeps its first reason."""

    __slots__ = ("exception", "reason", "side", "state")

    def __init__(self, side: Side) -> None:
        self.side = side
        self.state = KVPoll.Bootstrapping
        self.reason: str | None = None
        self.exception: BaseException | None = None

    @property
    def done(self) -> bool:
        return self.state in (KVPoll.Success, KVPoll.Failed)

    def apply(self, event: Event) -> bool:
        """Apply ``event``; returns whether the state changed.

        Events after a terminal state are ignored (a late message cannot resurrect or
        un-fail a room). Any other transition missing from the table is a local bug.
        """
        if self.done:
            return False
        new = TRANSITIONS[self.side][self.state].get(event)
        if new is None:
            raise LocalProtocolError(f"{self.side.value}: {event.value!r} is not allowed in {self.state.name}")
        changed = new != self.state
        self.state = new
        return changed

    def fail(self, exc: BaseException) -> bool:
        """Move to Failed with ``exc`` as the reason; a no-op once terminal."""
        if self.done:
            return False
        self.apply(Event.FAILED)
        self.exception = exc
        self.reason = str(exc) or type(exc).__name__
        return True


def mermaid_diagram() -> str:
    """The room state diagram, generated from TRANSITIONS (embedded in the README)."""
    lines = ["stateDiagram-v2"]
    for side, table in TRANSITIONS.items():
        lines.append(f"    state {side.value} {{")
        lines.append(f"        [*] --> {side.value}_{KVPoll.Bootstrapping.name}")
        for state, moves in table.items():
            for event, new in moves.items():
                if new != state:
                    lines.append(f"        {side.value}_{state.name} --> {side.value}_{new.name}: {event.value}")
        lines.append("    }")
    return "\n".join(lines)
