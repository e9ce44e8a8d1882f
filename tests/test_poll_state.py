"""The poll value a synchronous scheduler reads (``asynckv.integrations.poll_state``): it only moves
forward, whatever order the scheduler thread and the loop move it in."""

from __future__ import annotations

import itertools
import threading

import pytest

from asynckv.errors import Aborted
from asynckv.integrations.poll_state import PollState
from asynckv.proto.states import KVPoll


@pytest.mark.parametrize("events", list(itertools.permutations([
    (KVPoll.WaitingForInput, None), (KVPoll.Transferring, None), (KVPoll.Failed, Aborted("decode aborted"))])))
def test_a_failure_is_never_overwritten_whatever_the_order(
        events: tuple[tuple[int, BaseException | None], ...]) -> None:
    """The race it closes: the loop fails the room while the scheduler's send() marks it Transferring."""
    state = PollState()
    seen = []
    for poll, error in events:
        state.advance(poll, error)
        seen.append(state.state)
    assert state.state == KVPoll.Failed and isinstance(state.error, Aborted)
    failed_at = seen.index(KVPoll.Failed)
    assert all(p == KVPoll.Failed for p in seen[failed_at:])  # final once reached
    assert seen[:failed_at] == sorted(seen[:failed_at])  # and forward only before it
    with pytest.raises(RuntimeError, match="decode aborted") as raised:
        raise state.failure("room 7")
    assert isinstance(raised.value.__cause__, Aborted)


@pytest.mark.parametrize("events", list(itertools.permutations([
    KVPoll.WaitingForInput, KVPoll.Transferring, KVPoll.Success])))
def test_success_is_final_and_nothing_moves_back(events: tuple[int, ...]) -> None:
    state = PollState()
    previous = state.state
    for poll in events:
        state.advance(poll)
        assert state.state >= previous
        previous = state.state
    assert state.state == KVPoll.Success
    state.advance(KVPoll.Failed, Aborted("too late"))
    assert state.state == KVPoll.Success and state.error is None


def test_a_rank_the_tp_group_failed_first_says_so() -> None:
    with pytest.raises(RuntimeError, match="another TP rank"):
        raise PollState().failure("room 9")


def test_moves_from_two_threads_hold_the_lock() -> None:
    """Scripted: while one thread is inside a move (holding the lock), another's move waits for it."""
    state = PollState()
    state._lock.acquire()
    moved = threading.Event()

    def move() -> None:
        state.advance(KVPoll.Failed, Aborted("x"))
        moved.set()
    t = threading.Thread(target=move)
    t.start()
    assert not moved.wait(0.05) and state.state == KVPoll.Bootstrapping  # it waits for the move in progress
    state.state = KVPoll.Transferring  # (the move in progress completes)
    state._lock.release()
    t.join(5)
    assert state.state == KVPoll.Failed  # applied after it, not lost under it
