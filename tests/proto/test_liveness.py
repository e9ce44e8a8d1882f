from __future__ import annotations

from asynckv.proto.liveness import Liveness


def test_a_silent_peer_dies_after_interval_times_failures() -> None:
    live = Liveness(1.0, 3)
    live.add("p", "tcp://x:1", 1, now=0.0)
    assert live.expired(3.0) == []
    assert [s.peer_id for s in live.expired(3.01)] == ["p"]
    assert "p" not in live


def test_pongs_extend_the_lease_to_the_ping_time_plus_the_granted_length() -> None:
    live = Liveness(1.0, 3)
    state = live.add("p", "tcp://x:1", 1, now=0.0, lease_s=2.0)
    assert state.lease_until == 2.0
    now = 0.0
    for _ in range(10):
        now += 1.0
        [(_, seq)] = live.pings_due(now)
        assert live.on_pong("p", 1, seq, now + 0.01) == now + 2.0
    assert state.lease_until == now + 2.0


def test_a_pong_of_another_session_or_a_stale_one_extends_nothing() -> None:
    live = Liveness(1.0, 3)
    state = live.add("p", "tcp://x:1", 1, now=0.0)
    [(_, seq)] = live.pings_due(1.0)
    assert live.on_pong("p", 2, seq, 1.1) is None  # another session
    # The process was stopped for 60 s; the pong that waited in its socket arrives now.
    assert live.on_pong("p", 1, seq, now=61.0) == 1.0 + state.lease_s < 61.0


def test_the_fence_time_of_a_prefill_is_its_last_grant_plus_lease_and_one_handle() -> None:
    live = Liveness(0.5, 7)
    state = live.add("p", "tcp://x:1", 1, now=10.0)
    live.granted("p", 12.0)
    assert state.fence_time == 12.0 + 3.25 + 0.25 == 12.0 + live.dead_after_s


def test_the_lease_always_ends_before_the_peer_can_be_declared_dead() -> None:
    for interval, failures in ((1.0, 1), (0.5, 3), (2.0, 2)):
        live = Liveness(interval, failures)
        assert 0 < live.lease_s < live.dead_after_s
