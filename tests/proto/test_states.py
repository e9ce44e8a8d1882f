from __future__ import annotations

import pytest

from asynckv.errors import Aborted, LocalProtocolError
from asynckv.proto.states import TRANSITIONS, Event, KVPoll, RoomState, Side


def test_kvpoll_keeps_the_reference_values_for_min_reduction() -> None:
    assert [int(p) for p in (KVPoll.Failed, KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Transferring,
                             KVPoll.Success)] == [0, 1, 2, 3, 4]


def test_sender_happy_path() -> None:
    room = RoomState(Side.SENDER)
    assert room.apply(Event.DESTINATION_RECEIVED) and room.state == KVPoll.WaitingForInput
    assert room.apply(Event.CHUNK_POSTED) and room.state == KVPoll.Transferring
    assert not room.apply(Event.CHUNK_POSTED)  # more chunks: same state
    assert room.apply(Event.TRANSFER_COMPLETED) and room.state == KVPoll.Success and room.done


def test_receiver_happy_path() -> None:
    room = RoomState(Side.RECEIVER)
    room.apply(Event.DESTINATION_SENT)
    room.apply(Event.TRANSFER_COMPLETED)
    assert room.state == KVPoll.Success


def test_failed_is_sticky_and_keeps_the_first_reason() -> None:
    room = RoomState(Side.SENDER)
    assert room.fail(Aborted("first"))
    assert not room.fail(Aborted("second"))
    assert not room.apply(Event.DESTINATION_RECEIVED)
    assert room.state == KVPoll.Failed and room.reason == "first"
    assert isinstance(room.exception, Aborted)


def test_success_cannot_be_failed_afterwards() -> None:
    room = RoomState(Side.RECEIVER)
    room.apply(Event.DESTINATION_SENT)
    room.apply(Event.TRANSFER_COMPLETED)
    assert not room.fail(Aborted("late"))
    assert room.state == KVPoll.Success and room.reason is None


@pytest.mark.parametrize("side, state, event", [
    (side, state, event)
    for side, table in TRANSITIONS.items()
    for state, moves in table.items() if state not in (KVPoll.Success, KVPoll.Failed)
    for event in Event if event not in moves
])
def test_transitions_missing_from_the_table_are_local_errors(side: Side, state: KVPoll, event: Event) -> None:
    room = RoomState(side)
    room.state = state
    with pytest.raises(LocalProtocolError, match=event.value):
        room.apply(event)


def test_every_nonterminal_state_can_fail() -> None:
    for table in TRANSITIONS.values():
        for state, moves in table.items():
            if state not in (KVPoll.Success, KVPoll.Failed):
                assert moves[Event.FAILED] == KVPoll.Failed
