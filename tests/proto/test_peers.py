from __future__ import annotations

from asynckv.proto.peers import Liveness


def test_a_silent_peer_dies_after_interval_times_failures() -> None:
    live = Liveness(1.0, 3)
    live.add("p", "tcp://x:1", now=0.0)
    assert live.expired(3.0) == []
    assert [s.peer_id for s in live.expired(3.01)] == ["p"]
    assert "p" not in live


def test_pings_and_pongs_keep_a_peer_alive_and_extend_its_lease() -> None:
    live = Liveness(1.0, 3)
    state = live.add("p", "tcp://x:1", now=0.0)
    assert state.lease_until == 2.5
    now = 0.0
    for _ in range(10):
        now += 1.0
        [(_, _, seq)] = live.pings_due(now)
        live.on_pong("p", seq, now + 0.01)
    assert live.expired(now + 2.9) == []
    assert state.lease_until == now + 2.5  # from the time the ping was sent


def test_a_stale_pong_cannot_extend_the_lease_past_what_its_ping_allows() -> None:
    live = Liveness(1.0, 3)
    state = live.add("p", "tcp://x:1", now=0.0)
    [(_, _, seq)] = live.pings_due(1.0)
    # The process was stopped for 60 s; the pong that waited in its socket arrives now.
    live.on_pong("p", seq, now=61.0)
    assert state.lease_until == 3.5 < 61.0


def test_the_lease_always_ends_before_the_peer_can_be_declared_dead() -> None:
    for interval, failures in ((1.0, 1), (0.5, 3), (2.0, 2)):
        live = Liveness(interval, failures)
        assert 0 < live.lease_s < live.dead_after_s


def test_ping_from_the_peer_counts_as_alive() -> None:
    live = Liveness(1.0, 2)
    live.add("p", "tcp://x:1", now=0.0)
    live.heard("p", 1.9)
    assert live.expired(3.0) == []
