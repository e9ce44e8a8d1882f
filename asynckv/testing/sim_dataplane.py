"""The simulator's data plane and byte model: writes done the way the NIXL engine does them.

A mixin of ``World``. A write is a series of short handles (at most ``MAX_UNIT_S`` each):
before a handle starts, the engine checks the cancel set, the write lease and the peer; a
handle that started lands within ``MAX_UNIT_S`` whatever happens to either process, as RDMA
does. (Over CMA and UCX's TCP a process *stopped* mid-handle finishes that handle only when it
resumes: that exposure, one handle, is documented in docs/failures.md and not modelled.) With
CMA (the default) the engine runs copies one after another, so a slow copy delays the writes
and cancels queued behind it. With ``FaultMix.async_posts`` (RDMA, TCP) writes run side by
side, each with one handle in flight at a time. Landing bytes are checked against the
decode's page owners (I1).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import PeerUnreachable, TransferTimeout, TransportError
from ..proto import actions as act
from ..proto.receiver import ReceiverRoom

if TYPE_CHECKING:
    from .simulator import FaultMix, SimNode

__all__ = ["MAX_UNIT_S", "SimDataPlane", "SimPost"]


@dataclasses.dataclass(eq=False)
class SimPost:
    """A write, done the way the NIXL engine does it: a series of short handles, each checked
    against the write lease and the cancel set before it starts; a handle that started cannot be
    stopped (the copy is inside the kernel) and lands even if the process is then stopped."""

    node: SimNode
    action: act.Post
    units: int = 1
    unit_s: float = 0.0
    fail: bool = False
    stall: bool = False
    cancelled: BaseException | None = None
    running: bool = False
    settled: bool = False


MAX_UNIT_S = 0.2
"""Longest a single handle copies: within the fence margin (half a heartbeat interval)."""


class SimDataPlane:
    """Writes of simulated prefill nodes into simulated decode memory."""

    if TYPE_CHECKING:
        now: float
        rng: random.Random
        mix: FaultMix
        faults_on: bool
        names: dict[str, SimNode]
        prefill: list[list[SimNode]]
        decode: list[list[SimNode]]

        def on(self, node: SimNode, when: float, fn: Callable[..., None], *args: Any) -> None: ...

        def at(self, when: float, fn: Callable[..., None], *args: Any) -> None: ...

        def drive(self, node: SimNode, method: str, *args: Any) -> Any: ...

        def _in_node(self, node: SimNode, fn: Callable[..., None], args: tuple[Any, ...]) -> None: ...

        def violation(self, text: str) -> None: ...

    def _connected(self, node: SimNode, peer: Any, ok: bool) -> None:
        target = self.names.get(peer.name)
        if ok and target is not None and target.alive:
            node.connected.add(peer.name)
            self.drive(node, "peer_connected", peer, None)
        else:
            self.drive(node, "peer_connected", peer, PeerUnreachable("warm-up write failed (simulated)"))

    def _post(self, node: SimNode, a: act.Post) -> None:
        post = node.posts[a.post_id] = SimPost(node, a)
        rng, mix, on = self.rng, self.mix, self.faults_on
        self.on(node, self.now + a.timeout_s, self._deadline, post)
        total = rng.uniform(*mix.post_ms) / 1000 + a.nbytes / 5e9
        if on and rng.random() < mix.post_slow:
            total += rng.uniform(0.2, 3.0)
        post.units = max(len(a.dst), int(total / MAX_UNIT_S) + 1)
        post.unit_s = total / post.units
        post.fail = on and rng.random() < mix.post_fail
        post.stall = on and rng.random() < mix.post_stall
        start = (self.now if self.mix.async_posts else max(self.now, node.engine_at)) + 0.00005
        if not self.mix.async_posts:  # with CMA the engine copies synchronously
            node.engine_at = start + (0.0 if post.stall else total)
        self.on(node, start, self._unit, post, 0)

    def _cancel(self, post: SimPost, reason: BaseException) -> None:
        """The engine sees a cancel before the next handle starts; a running handle finishes first."""
        if post.settled or post.cancelled is not None:
            return
        post.cancelled = reason
        if not post.running:
            self.on(post.node, max(self.now, post.node.engine_at) + 0.0001, self._settle, post, reason)

    def _deadline(self, post: SimPost) -> None:
        if not post.running:
            self._settle(post, TransferTimeout(f"post {post.action.post_id}: not done after "
                                               f"{post.action.timeout_s:.1f}s"))

    def _unit(self, post: SimPost, k: int) -> None:
        """The engine is about to post handle ``k``: it checks cancel, lease and peer first."""
        if post.settled:
            return
        node, a = post.node, post.action
        target = self.names.get(a.peer)
        error: BaseException | None = post.cancelled
        if error is None and self.now >= node.leases.get(a.peer, float("-inf")):
            error = TransferTimeout(f"post {a.post_id}: the write lease on the peer expired")
        if error is None and (a.peer not in node.connected or target is None or not target.alive):
            error = PeerUnreachable(f"post {a.post_id}: peer disconnected")
        if error is None and post.fail:
            error = TransportError(f"post {a.post_id}: injected failure")
        if error is not None:
            self._settle(post, error)
            return
        if post.stall:  # in flight forever: only a cancel, the lease or the deadline ends it
            self.on(node, node.leases.get(a.peer, self.now) + 0.001, self._stalled, post)
            return
        post.running = True
        self.at(self.now + post.unit_s, self._unit_done, post, k)  # lands even if the process stops now

    def _stalled(self, post: SimPost) -> None:
        if not post.settled and self.now >= post.node.leases.get(post.action.peer, float("-inf")):
            self._settle(post, TransferTimeout(f"post {post.action.post_id}: the write lease on the peer expired"))
        elif not post.settled:
            self.on(post.node, post.node.leases[post.action.peer] + 0.001, self._stalled, post)

    def _unit_done(self, post: SimPost, k: int) -> None:
        post.running = False
        node, a = post.node, post.action
        target = self.names.get(a.peer)
        if not node.alive:
            return  # the writer died: its core is gone
        if target is None or not target.alive:  # the copy fails: the engine sees the disconnect
            self._in_node(node, self._settle, (post, PeerUnreachable(f"post {a.post_id}: peer disconnected")))
            return
        n = len(a.dst)
        pages = [j for j in range(n) if k == (j + 1) * post.units // n - 1] if n else []
        self._write(node, target, a, pages)
        if a.aux is not None and k + 1 == post.units:  # an aux row riding on the post lands with its last handle
            self._land_aux(target, (a.room, a.epoch), a.aux[1])
        if k + 1 < post.units:
            self.on(node, self.now, self._unit, post, k + 1)
        elif self.mix.async_posts:  # the engine polls the handle: a cancel or lapsed lease seen meanwhile wins
            error = post.cancelled
            if error is None and self.now >= node.leases.get(a.peer, float("-inf")):
                error = TransferTimeout(f"post {a.post_id}: the write lease on the peer expired")
            self._in_node(node, self._settle, (post, error))
        else:
            self._in_node(node, self._settle, (post, None))

    def _settle(self, post: SimPost, error: BaseException | None) -> None:
        if post.settled:
            return
        post.settled = True
        node = post.node
        node.posts.pop(post.action.post_id, None)
        self.drive(node, "post_settled", post.action.post_id, error)

    def _write(self, node: SimNode, target: SimNode, a: act.Post, which: list[int]) -> None:
        """Land the pages ``which`` (positions in the post) in the decode byte model, checking I1."""
        key = (a.room, a.epoch)
        if not which:
            return
        if a.kind == "aux":
            self._land_aux(target, key, int(a.dst[0]))
            return
        tp_p = len(self.prefill[node.group])
        tp_d = len(self.decode[target.group])
        piece = node.rank % (tp_p // tp_d) if tp_p > tp_d else 0
        src_all, dst_all = a.src.tolist(), a.dst.tolist()
        for src, dst in ((src_all[j], dst_all[j]) for j in which):
            if target.owner.get(dst) != key:
                self.violation(f"I1: page {dst} of {target} written for room {key} by {node} "
                               f"but owned by {target.owner.get(dst)}")
            room, position = node.src_owner.get(src, (-1, -1))
            target.content[(dst, piece)] = (room, a.epoch, position)

    def _land_aux(self, target: SimNode, key: tuple[int, int], row: int) -> None:
        if target.aux_owner.get(row) != key:
            self.violation(f"I1: aux row {row} of {target} written for room {key} "
                           f"but owned by {target.aux_owner.get(row)}")
        target.aux_content[row] = key

    def check_success(self, node: SimNode, room: ReceiverRoom) -> None:
        """I3: every page of a room decode reports Success holds that room's bytes from every writer."""
        plan = room.plan
        if plan is None:
            self.violation(f"I3: {node} room {room.room} succeeded without a plan")
            return
        tp_p, tp_d = plan.targets[0].rank.tp_size, len(self.decode[node.group])
        pieces = range(tp_p // tp_d) if tp_p > tp_d else range(1)
        want_room = (room.room, room.epoch)
        for position, page in enumerate(room.pages.tolist()):
            for piece in pieces:
                got = node.content.get((page, piece))
                if got != (room.room, room.epoch, position):
                    self.violation(f"I3: {node} room {want_room} reported Success but page {page} slice {piece} "
                                   f"holds {got}, expected position {position}")
                    return
        if room.aux_index >= 0 and node.aux_content.get(room.aux_index) != want_room:
            self.violation(f"I3: {node} room {want_room} reported Success but aux row {room.aux_index} holds "
                           f"{node.aux_content.get(room.aux_index)}")
