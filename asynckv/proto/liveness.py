"""Heartbeats and write leases, sans-IO (every method takes ``now``, a monotonic time).

Each manager pings the peers it works with every ``interval_s``; any message from a peer
proves it alive. A peer not heard from for ``interval_s * max_failures`` is dead.

The write lease fences a prefill that is stopped, partitioned or merely slow. Prefill may
post a WRITE into a decode only before ``lease_until``. Decode *grants* the lease, for
``lease_s`` (its own, sent in ``Register``), at two moments it knows:

- when it receives ``RegisterResult(ok)``: prefill started the lease when it *sent* that
  answer, which was earlier;
- when it sends a ``Pong``: prefill extends the lease to the time it *sent* the ping, which
  was earlier still.

So prefill starts no write later than ``last_grant + lease_s`` on decode's clock (clocks
need only run at the same rate, never agree); a write that started just inside the lease
may still be copying, for at most one short handle, so decode adds ``interval_s / 2``.
Decode declares a silent prefill dead after ``dead_after_s = lease_s + interval_s / 2``
without hearing it, and it grants nothing without hearing it, so by then the lease has run
out and the last write landed. When decode gives up on a prefill that is still talking
(fence timeout, restart seen in the topology), it stops granting and waits until
``fence_time`` before it hands that prefill's pages back.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterator

__all__ = ["Liveness", "PeerState"]


@dataclasses.dataclass(slots=True)
class PeerState:
    peer_id: str
    endpoint: str
    session: int
    """The registration session this state belongs to (pings and pongs name it)."""
    last_seen: float
    lease_s: float
    """Length of each lease grant (decode's figure)."""
    lease_until: float
    """Prefill: until when it may write into this decode."""
    last_grant: float
    """Decode: the latest moment it granted this prefill a lease."""
    sent: collections.OrderedDict[int, float] = dataclasses.field(default_factory=collections.OrderedDict)

    fence_margin_s: float = 0.0
    """Decode: how long a write that started just inside a lease may still take to land."""

    @property
    def fence_time(self) -> float:
        """Decode: when every lease granted to this prefill has run out, and a write started just
        inside the last one has landed."""
        return self.last_grant + self.lease_s + self.fence_margin_s


class Liveness:
    """Who is alive, and until when the lease of each lasts."""

    def __init__(self, interval_s: float = 1.0, max_failures: int = 3) -> None:
        if interval_s <= 0 or max_failures < 1:
            raise ValueError("heartbeat interval must be > 0 and max failures >= 1")
        self.interval_s = interval_s
        self.dead_after_s = interval_s * max_failures
        self.lease_s = self.dead_after_s - interval_s / 2
        """The lease this side grants (as a decode): ends before this side could call the peer dead."""
        self._peers: dict[str, PeerState] = {}
        self._seq = 0

    def __len__(self) -> int:
        return len(self._peers)

    def __contains__(self, peer_id: object) -> bool:
        return peer_id in self._peers

    def __iter__(self) -> Iterator[PeerState]:
        return iter(list(self._peers.values()))

    def get(self, peer_id: str) -> PeerState | None:
        return self._peers.get(peer_id)

    def add(self, peer_id: str, endpoint: str, session: int, now: float, lease_s: float | None = None) -> PeerState:
        """Start tracking a peer we just heard from (registration); a lease starts ``now``."""
        lease = self.lease_s if lease_s is None else lease_s
        state = PeerState(peer_id, endpoint, session, last_seen=now, lease_s=lease, lease_until=now + lease,
                          last_grant=now, fence_margin_s=self.interval_s / 2)
        self._peers[peer_id] = state
        return state

    def remove(self, peer_id: str) -> PeerState | None:
        return self._peers.pop(peer_id, None)

    def pings_due(self, now: float) -> list[tuple[PeerState, int]]:
        """(peer, seq) of the pings to send now (call once per interval)."""
        out = []
        for state in self._peers.values():
            self._seq += 1
            state.sent[self._seq] = now
            while len(state.sent) > 16:
                state.sent.popitem(last=False)
            out.append((state, self._seq))
        return out

    def heard(self, peer_id: str, now: float) -> None:
        """Any message from the peer proves it alive."""
        state = self._peers.get(peer_id)
        if state is not None:
            state.last_seen = max(state.last_seen, now)

    def granted(self, peer_id: str, now: float) -> None:
        """Decode answered this prefill's ping: prefill may write until its ping time + lease."""
        state = self._peers.get(peer_id)
        if state is not None:
            state.last_grant = max(state.last_grant, now)

    def on_pong(self, peer_id: str, session: int, seq: int, now: float) -> float | None:
        """A pong: the peer is alive; returns the new lease end when this pong extended it."""
        state = self._peers.get(peer_id)
        if state is None or state.session != session:
            return None
        state.last_seen = max(state.last_seen, now)
        sent = state.sent.pop(seq, None)
        if sent is None or sent + state.lease_s <= state.lease_until:
            return None
        state.lease_until = sent + state.lease_s
        return state.lease_until

    def expired(self, now: float) -> list[PeerState]:
        """Peers not heard from for ``dead_after_s``; they are removed."""
        dead = [s for s in self._peers.values() if now - s.last_seen > self.dead_after_s]
        for state in dead:
            del self._peers[state.peer_id]
        return dead
