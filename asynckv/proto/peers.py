"""Heartbeats and write leases, sans-IO (every method takes ``now``, a monotonic time).

Each manager pings the peers it works with every ``interval_s``; any message from a peer
(a ping or a pong) proves it alive. A peer not heard from for
``interval_s * max_failures`` is dead.

The lease fences a prefill that was stopped and resumed: prefill may post a WRITE to a
decode peer only before ``lease_until``, which only a pong extends, to the time the
*ping* was sent plus ``lease_s < dead_after_s``. Decode declares prefill dead no earlier
than ``dead_after_s`` after it last heard from it, which is after that ping was sent, so a
prefill whose lease is still valid has not been declared dead (and its pages handed back).
A prefill resumed after a SIGSTOP finds its leases expired and writes nothing.
"""

from __future__ import annotations

import collections
import dataclasses

__all__ = ["Liveness", "PeerState"]


@dataclasses.dataclass(slots=True)
class PeerState:
    peer_id: str
    endpoint: str
    last_seen: float
    lease_until: float
    sent: collections.OrderedDict[int, float] = dataclasses.field(default_factory=collections.OrderedDict)


class Liveness:
    """Who is alive, and until when this side may write to them."""

    def __init__(self, interval_s: float = 1.0, max_failures: int = 3) -> None:
        if interval_s <= 0 or max_failures < 1:
            raise ValueError("heartbeat interval must be > 0 and max failures >= 1")
        self.interval_s = interval_s
        self.dead_after_s = interval_s * max_failures
        self.lease_s = self.dead_after_s - interval_s / 2
        self._peers: dict[str, PeerState] = {}
        self._seq = 0

    def __len__(self) -> int:
        return len(self._peers)

    def __contains__(self, peer_id: object) -> bool:
        return peer_id in self._peers

    def get(self, peer_id: str) -> PeerState | None:
        return self._peers.get(peer_id)

    def add(self, peer_id: str, endpoint: str, now: float) -> PeerState:
        """Start tracking a peer we just heard from (registration)."""
        state = self._peers.get(peer_id)
        if state is None:
            state = PeerState(peer_id, endpoint, last_seen=now, lease_until=now + self.lease_s)
            self._peers[peer_id] = state
        return state

    def remove(self, peer_id: str) -> PeerState | None:
        return self._peers.pop(peer_id, None)

    def pings_due(self, now: float) -> list[tuple[str, str, int]]:
        """(peer_id, endpoint, seq) of the pings to send now (call once per interval)."""
        out = []
        for state in self._peers.values():
            self._seq += 1
            state.sent[self._seq] = now
            while len(state.sent) > 16:
                state.sent.popitem(last=False)
            out.append((state.peer_id, state.endpoint, self._seq))
        return out

    def heard(self, peer_id: str, now: float) -> None:
        """Any message from the peer (a ping) proves it alive."""
        state = self._peers.get(peer_id)
        if state is not None:
            state.last_seen = max(state.last_seen, now)

    def on_pong(self, peer_id: str, seq: int, now: float) -> None:
        state = self._peers.get(peer_id)
        if state is None:
            return
        state.last_seen = max(state.last_seen, now)
        sent = state.sent.pop(seq, None)
        if sent is not None:
            state.lease_until = max(state.lease_until, sent + self.lease_s)

    def expired(self, now: float) -> list[PeerState]:
        """Peers not heard from for ``dead_after_s``; they are removed."""
        dead = [s for s in self._peers.values() if now - s.last_seen > self.dead_after_s]
        for state in dead:
            del self._peers[state.peer_id]
        return dead
