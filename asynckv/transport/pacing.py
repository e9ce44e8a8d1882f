"""How much a loop callback that works through a queue takes in one loop round.

The readers of control messages and the drain of settled posts each take a few items per round
and come back next round for the rest: every item can wake a task, which the loop runs in its next
round, so what one round takes bounds how long the round runs, and so how late every other
callback and timer runs (the loop's lag). Few items a round keep rounds short but pay a round's
fixed cost (a poll, a call back, a pause and resume of the reader) for few items; many items a
round save that cost and lengthen rounds. A fixed number is right for one host and load only:
with 1,000 rooms in flight on a 2-vCPU VM, 2 messages read and 4 settles drained a round held the
prefill's loop lag p99 near 4 ms, while 4 and 16 cut the prefill's CPU per room to 0.77x and
raised rooms/s 1.22x but put that lag over 5 ms in 9 runs of 15 (docs/design-decisions.md, 24).

A ``Pacer`` lets the round's own length decide. When a callback leaves items for its next turn it
notes the time; when that turn comes it sees how long the loop took to get back to it (the rest of
the round, the poll, and what ran before it in the next one). Back within ``SHORT_S``: the loop
has time to spare, and the callback takes twice as many (up to ``most``). Later than ``LONG_S``:
it takes half as many (down to ``least``, the old fixed number). In between it keeps its number.
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["LONG_S", "SHORT_S", "Pacer"]

SHORT_S = 0.001
"""A callback's next turn that came back within this grows its take (the loop's rounds are short)."""
LONG_S = 0.002
"""A callback's next turn that came back later than this shrinks its take (rounds run long)."""


class Pacer:
    """The number of items a queue's callback takes this round, between ``least`` and ``most``.

    ``scheduled()`` when the callback schedules its next turn with items left; ``take()`` at the
    start of each turn. A turn not scheduled that way (the first after the queue was empty) keeps
    the current number: its wait measures how long the queue sat idle, not the loop's rounds.
    """

    __slots__ = ("_clock", "_since", "least", "most", "size")

    def __init__(self, least: int, most: int, clock: Callable[[], float] = time.monotonic) -> None:
        if not 1 <= least <= most:
            raise ValueError(f"a pacer needs 1 <= least <= most, got {least} and {most}")
        self.least, self.most, self.size = least, most, least
        self._clock = clock
        self._since: float | None = None

    def scheduled(self) -> None:
        """The callback left items and scheduled its next turn now."""
        self._since = self._clock()

    def take(self) -> int:
        """How many items to take in this turn (after adjusting to how long the loop took to return)."""
        since, self._since = self._since, None
        if since is not None:
            waited = self._clock() - since
            if waited < SHORT_S:
                self.size = min(self.most, self.size * 2)
            elif waited > LONG_S:
                self.size = max(self.least, self.size // 2)
        return self.size
