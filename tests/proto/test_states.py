from __future__ import annotations

from typing import Any

import pytest

from asynckv.errors import LocalProtocolError
from asynckv.proto.states import (
    RECEIVER_POLL,
    RECEIVER_TRANSITIONS,
    SENDER_POLL,
    SENDER_TRANSITIONS,
    Event,
    KVPoll,
    ReceiverState,
    SenderState,
    mermaid_diagram,
    transition,
)

Table = dict[Any, dict[Event, Any]]
"""A side's transitions: state -> event -> new state (``SenderState`` or ``ReceiverState``)."""
Poll = dict[Any, KVPoll]

TABLES: list[tuple[str, Table, Poll]] = [("sender", SENDER_TRANSITIONS, SENDER_POLL),
                                         ("receiver", RECEIVER_TRANSITIONS, RECEIVER_POLL)]


def test_kvpoll_keeps_the_reference_values_for_min_reduction() -> None:
    assert [int(p) for p in (KVPoll.Failed, KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Transferring,
                             KVPoll.Success)] == [0, 1, 2, 3, 4]


def test_sender_happy_path() -> None:
    state = SenderState.BOOTSTRAPPING
    for event, want in ((Event.DESTINATIONS_KNOWN, SenderState.READY), (Event.CHUNK_QUEUED, SenderState.TRANSFERRING),
                        (Event.CHUNK_QUEUED, SenderState.TRANSFERRING), (Event.WRITES_LANDED, SenderState.SUCCEEDED)):
        state = transition(SENDER_TRANSITIONS, state, event)
        assert state is want
    assert SENDER_POLL[state] is KVPoll.Success


def test_a_sender_failing_with_writes_in_flight_drains_and_already_polls_failed() -> None:
    state = transition(SENDER_TRANSITIONS, SenderState.TRANSFERRING, Event.FAILED_WRITES_IN_FLIGHT)
    assert state is SenderState.DRAINING and SENDER_POLL[state] is KVPoll.Failed
    assert transition(SENDER_TRANSITIONS, state, Event.WRITES_SETTLED) is SenderState.FAILED
    with pytest.raises(LocalProtocolError):  # a draining room posts nothing new
        transition(SENDER_TRANSITIONS, state, Event.CHUNK_QUEUED)


def test_a_fencing_receiver_never_polls_failed_before_it_is_fenced() -> None:
    state = transition(RECEIVER_TRANSITIONS, ReceiverState.WAITING, Event.FAILED_MAY_BE_WRITTEN)
    assert state is ReceiverState.FENCING and RECEIVER_POLL[state] is KVPoll.Transferring
    assert transition(RECEIVER_TRANSITIONS, state, Event.FENCED) is ReceiverState.FAILED
    with pytest.raises(LocalProtocolError):  # a late success cannot un-fail it
        transition(RECEIVER_TRANSITIONS, state, Event.SENDERS_SUCCEEDED)


@pytest.mark.parametrize("name, table, poll", TABLES)
def test_terminal_states_are_sticky_and_every_live_state_can_fail(name: str, table: Table, poll: Poll) -> None:
    for state, moves in table.items():
        if poll[state] in (KVPoll.Success, KVPoll.Failed) and state not in (SenderState.DRAINING,):
            assert not moves or state is ReceiverState.FENCING, f"{name} {state} is terminal but has moves"
        elif state not in (SenderState.DRAINING, ReceiverState.FENCING):
            assert Event.FAILED in moves, f"{name} {state} cannot fail"


@pytest.mark.parametrize("name, table, poll", TABLES)
def test_every_state_has_a_poll_value_and_is_reachable(name: str, table: Table, poll: Poll) -> None:
    assert set(poll) == set(table)
    reached, frontier = set(), [next(iter(table))]
    while frontier:
        state = frontier.pop()
        reached.add(state)
        frontier += [s for s in table[state].values() if s not in reached]
    assert reached == set(table), f"{name}: unreachable {set(table) - reached}"


def test_the_diagram_shows_every_move() -> None:
    text = mermaid_diagram()
    for side, table, _ in TABLES:
        for state, moves in table.items():
            for event, new in moves.items():
                if new != state:
                    assert f"{side}_{state.name} --> {side}_{new.name}: {event.value}" in text
