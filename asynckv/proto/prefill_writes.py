"""Prefill rules about writes: chunks into writes, the in-flight byte budget, settled posts.

A mixin of ``PrefillCore``. A write waits in one FIFO until the budget allows it (a write
larger than the whole budget goes alone); a write of a room that failed meanwhile is
dropped, never posted. The aux row rides on the last chunk's KV write to the same decode
rank (one post instead of two: for small rooms a post costs the loop more than its bytes),
unless that chunk has no pages or each kind needs its own notification (SGLang's wire). A
room succeeds only when its last chunk was given, nothing of it waits and every post
settled without error; a draining room reports its failure once its last post settled.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from ..errors import InvalidArgument, PeerUnreachable
from .actions import ChunkPosted, Post
from .core import Core
from .sender import DecodePeer, Destination, PeerPhase, SenderRoom
from .states import Event, SenderState

__all__ = ["WriteRules"]

I64 = npt.NDArray[np.int64]
Aux = tuple[int, int] | None
WriteSpec = tuple[Destination, str, I64, I64, int, Aux]
"""(destination, kind, src, dst, bytes, aux rows riding on a kv write)."""


@dataclasses.dataclass(eq=False, slots=True)
class Queued:
    """A write waiting for the in-flight byte budget."""

    room: SenderRoom
    dest: Destination
    kind: str
    src: I64
    dst: I64
    nbytes: int
    chunk: int
    last_of_chunk: bool
    aux: Aux = None


class WriteRules(Core):
    """Writes of a prefill rank (see the module docstring)."""

    MERGE_AUX = True
    """The aux row goes in the last chunk's KV post (off where each kind needs its own notification)."""

    def _init_writes(self) -> None:
        a = self.kv_args
        self.page_bytes = int(sum(a.kv_item_lens))
        self.aux_bytes = int(sum(a.aux_item_lens))
        self.posts: dict[int, tuple[SenderRoom, Destination, int]] = {}
        self.inflight_bytes = 0
        self._queue: collections.deque[Queued] = collections.deque()
        self._post_ids = itertools.count(1)

    if TYPE_CHECKING:
        def fail(self, room: SenderRoom, error: BaseException, now: float) -> None: ...

        def drop_peer(self, peer: DecodePeer, error: BaseException, now: float, *, say_bye: bool,
                      farewell: bool = False) -> None: ...

        def _maybe_succeed(self, room: SenderRoom, now: float) -> None: ...

        def _report_failure(self, room: SenderRoom, now: float) -> None: ...

        def _peer_progress(self, peer: DecodePeer) -> None: ...

        def _maybe_closed(self) -> None: ...

    def post_settled(self, post_id: int, error: BaseException | None, now: float) -> None:
        """The data plane settled a post: every byte landed (``error`` None), or none will land any more."""
        record = self.posts.pop(post_id, None)
        if record is None:
            self.stats["unknown_post"] += 1
            return
        room, dest, nbytes = record
        peer = dest.peer
        self.inflight_bytes -= nbytes
        room.posts.discard(post_id)
        peer.posts.discard(post_id)
        if error is not None:
            if isinstance(error, PeerUnreachable) and peer.phase is PeerPhase.CONNECTED:
                self.drop_peer(peer, error, now, say_bye=True)  # NIXL saw the disconnect: no need to wait
            self.fail(room, error, now)
        if room.state is SenderState.DRAINING and not room.posts:
            room.move(Event.WRITES_SETTLED)
            self._report_failure(room, now)
        else:
            self._maybe_succeed(room, now)
        self._peer_progress(peer)
        self._pump_queue()
        self._maybe_closed()

    def _notification(self, q: Queued) -> bytes:
        """The NIXL notification a write carries (none on asynckv's wire: decode hears a Status)."""
        return b""

    def _queue_writes(self, room: SenderRoom, chunk: int, writes: list[WriteSpec]) -> None:
        for i, (dest, kind, src, dst, nbytes, aux) in enumerate(writes):
            self._queue.append(Queued(room, dest, kind, src, dst, nbytes, chunk, i == len(writes) - 1, aux))
        room.queued += len(writes)
        if not writes:
            self._emit(ChunkPosted(room, chunk))
        self._pump_queue()

    def _chunk_writes(self, room: SenderRoom, pages: I64, start: int, state: I64 | None,
                      is_last: bool) -> list[WriteSpec]:
        """The writes of one chunk, per destination: KV pages, and with the last chunk aux and state."""
        writes: list[WriteSpec] = []
        n = len(pages)
        for dest in room.destinations.values():
            info = dest.info
            if info.is_dummy:  # no KV; one with state indices holds a slice of split state of its own: that alone
                if is_last:
                    writes += self._state_write(room, dest, state)
                continue
            if n:
                writes.append((dest, "kv", pages, info.dst_pages[start:start + n].astype(np.int64),
                               n * self.page_bytes, None))
            if not is_last:
                continue
            if info.write_aux and room.aux_index >= 0 and info.aux_index >= 0:
                if n and self.MERGE_AUX:  # (the KV write just appended)
                    kv = writes[-1]
                    writes[-1] = (*kv[:4], kv[4] + self.aux_bytes, (room.aux_index, info.aux_index))
                else:
                    writes.append((dest, "aux", np.array([room.aux_index], dtype=np.int64),
                                   np.array([info.aux_index], dtype=np.int64), self.aux_bytes, None))
            writes += self._state_write(room, dest, state)
        return writes

    def _state_write(self, room: SenderRoom, dest: Destination, state: I64 | None) -> list[WriteSpec]:
        """The state write of the last chunk into one destination, if it takes one from this rank."""
        info, plan = dest.info, dest.peer.plan.state
        # State every TP rank of a stage holds goes from one rank per stage: the aux writer is one on
        # the last stage only (and every real rank on SGLang's wire), so each stage's first rank too. (A
        # dummy is never the aux writer: a decode saying so is not believed.)
        if plan is None or len(info.dst_state_indices) == 0 or \
                (plan.replicated and not (plan.first or (info.write_aux and not info.is_dummy))):
            return []
        if state is None or len(state) != len(info.dst_state_indices):
            got = "none" if state is None else len(state)
            raise InvalidArgument(f"room {room.room}: decode expects {len(info.dst_state_indices)} state "
                                  f"indices, the last chunk carried {got}")
        return [(dest, "state", state, info.dst_state_indices.astype(np.int64), len(state) * plan.nbytes, None)]

    def _pump_queue(self) -> None:
        """Post queued writes, oldest first, while the in-flight byte budget allows (a write larger
        than the whole budget goes alone)."""
        limit = self.config.max_inflight_bytes
        while self._queue:
            q = self._queue[0]
            room, dest = q.room, q.dest
            if not room.active or dest.peer.phase is not PeerPhase.CONNECTED:
                self._queue.popleft()
                room.queued -= 1
                continue
            if self.inflight_bytes and self.inflight_bytes + q.nbytes > limit:
                return
            self._queue.popleft()
            room.queued -= 1
            post_id = next(self._post_ids)
            self.posts[post_id] = (room, dest, q.nbytes)
            room.posts.add(post_id)
            dest.peer.posts.add(post_id)
            self.inflight_bytes += q.nbytes
            self.stats[f"{q.kind}_posts"] += 1
            self.stats[f"{q.kind}_bytes"] += q.nbytes - (0 if q.aux is None else self.aux_bytes)
            if q.aux is not None:  # (bytes by kind stay by kind; the rows that rode are counted apart)
                self.stats["aux_riding"] += 1
                self.stats["aux_bytes"] += self.aux_bytes
            timeout = self.config.xfer_deadline_base_s + q.nbytes / self.config.xfer_deadline_min_bytes_per_s
            self._emit(Post(post_id, dest.peer.name, room.room, dest.epoch, q.kind, q.src, q.dst, q.nbytes, timeout,
                            self._notification(q), q.aux))
            if q.last_of_chunk:
                self._emit(ChunkPosted(room, q.chunk))
