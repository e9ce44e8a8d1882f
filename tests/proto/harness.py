"""Scripted runs of the real cores over the simulator: fixed delays, exact simulated times.

Messages take 1 ms, writes 1 ms, a topology look-up 1 ms, a first contact 5 ms. A decode
room owns its pages from ``init`` until it reports Success or Failed, and the simulator
flags any byte landing in a page its room no longer owns (invariant I1).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, overload

import numpy as np

from asynckv.config import Config
from asynckv.proto import actions as act
from asynckv.proto.messages import Message
from asynckv.proto.receiver import ReceiverRoom
from asynckv.proto.sender import SenderRoom
from asynckv.proto.states import ReceiverState, SenderState
from asynckv.testing.simulator import FaultMix, SimNode, World

MIX = FaultMix(delay_ms=(1.0, 1.0), post_ms=(1.0, 1.0), connect_ms=(5.0, 5.0), route_ms=(1.0, 1.0))
DEFAULTS = Config(bootstrap_timeout_s=300, waiting_timeout_s=300, heartbeat_interval_s=0.5, heartbeat_max_failures=7,
                  fence_timeout_s=5.0)
"""The shipped defaults that matter here (heartbeat 0.5 s x 7, fence 5 s)."""


@overload
def state_of(room: ReceiverRoom) -> ReceiverState: ...
@overload
def state_of(room: SenderRoom) -> SenderState: ...
def state_of(room: ReceiverRoom | SenderRoom) -> ReceiverState | SenderState:
    """``room.state``, read afresh for the type checker: after ``assert room.state is WAITING`` it
    takes ``room.state`` for ``WAITING`` through the calls that move the room, so a later
    ``room.state is SUCCEEDED`` would look impossible to it."""
    return room.state


class Cluster:
    def __init__(self, config: Config = DEFAULTS, prefill_tp: int = 1, decode_tp: int = 1,
                 mix: FaultMix = MIX) -> None:
        self.w = World(0, mix, config)
        self.w.record = []
        self.w.on_action = self._on_action
        self.p = [self.w.add_prefill(0, r, prefill_tp) for r in range(prefill_tp)]
        self.d = [self.w.add_decode(0, r, decode_tp) for r in range(decode_tp)]
        self._pages: dict[int, tuple[SimNode, list[int], int]] = {}

    @property
    def now_ms(self) -> float:
        return round(self.w.now * 1000, 6)

    def run_ms(self, until_ms: float) -> None:
        self.w.run_until(until_ms / 1000)

    def receiver(self, node: SimNode, room: int, pages: list[int], aux: int = -1) -> ReceiverRoom:
        r: ReceiverRoom = self.w.drive(node, "open_receiver", self.w.addr(0), room)
        for page in pages:
            node.owner[page] = (room, r.epoch)
        if aux >= 0:
            node.aux_owner[aux] = (room, r.epoch)
        self._pages[id(r)] = (node, pages, aux)
        self.w.drive(node, "receiver_init", r, pages, aux, None, 0)
        return r

    def sender(self, node: SimNode, room: int, src: list[int] | None = None) -> SenderRoom:
        for position, page in enumerate(src or []):
            node.src_owner[page] = (room, position)
        s: SenderRoom = self.w.drive(node, "open_sender", room)
        return s

    def send(self, node: SimNode, s: SenderRoom, pages: list[int], num_pages: int | None = None,
             aux: int = -1) -> Any:
        if s.num_pages is None:
            self.w.drive(node, "sender_init", s, len(pages) if num_pages is None else num_pages, aux)
        for position, page in enumerate(pages, start=s.cursor):
            node.src_owner[page] = (s.room, position)
        return self.w.drive(node, "send_chunk", s, np.asarray(pages, dtype=np.int64), None)

    def hold(self, rule: Callable[[SimNode, str, Message], float | None]) -> None:
        self.w.hold = rule

    def _on_action(self, node: SimNode, a: act.Action) -> None:
        if isinstance(a, act.Finished) and isinstance(a.room, ReceiverRoom):
            if a.room.state is ReceiverState.SUCCEEDED:
                self.w.check_success(node, a.room)  # I3: every byte is there
            found = self._pages.pop(id(a.room), None)
            if found is not None:  # decode hands the pages back at once
                owner, pages, aux = found
                for page in pages:
                    owner.owner.pop(page, None)
                owner.aux_owner.pop(aux, None)

    # -- reading the record ------------------------------------------------------------

    def actions(self, kind: type[act.Action], node: SimNode | None = None,
                where: Callable[[Any], bool] = lambda a: True) -> list[tuple[float, Any]]:
        """(ms, action) of every recorded action of a kind, optionally of one node, filtered."""
        record = self.w.record or []
        return [(round(t * 1000, 6), a) for t, name, a in record
                if isinstance(a, kind) and (node is None or name == node.name) and where(a)]

    def sent(self, node: SimNode, msg_type: type[Message], where: Callable[[Any], bool] = lambda m: True
             ) -> list[tuple[float, Any]]:
        return [(t, a.msg) for t, a in self.actions(act.Send, node) if isinstance(a.msg, msg_type) and where(a.msg)]

    def finished_ms(self, room: SenderRoom | ReceiverRoom) -> float | None:
        found = self.actions(act.Finished, where=lambda a: a.room is room)
        return found[0][0] if found else None

    def check(self) -> None:
        assert self.w.violations == [], self.w.violations


def fenced(room: ReceiverRoom) -> bool:
    return room.state is ReceiverState.FAILED


def slow_posts(cluster: Cluster, ms: float) -> None:
    cluster.w.mix = dataclasses.replace(cluster.w.mix, post_ms=(ms, ms))


def register_pair(c: Cluster, room: int = 100) -> None:
    """Run one room end to end so the pair is registered (first contact is not what a test measures)."""
    start = c.now_ms
    rs = [c.receiver(d, room, [40 + i]) for i, d in enumerate(c.d)]
    ss = [c.sender(p, room) for p in c.p]
    c.run_ms(start + 20)
    for p, s in zip(c.p, ss, strict=True):
        c.send(p, s, [40])
    c.run_ms(start + 40)
    for d, r in zip(c.d, rs, strict=True):
        assert r.state is ReceiverState.SUCCEEDED, r
        c.w.drive(d, "clear_receiver", r)
    for p, s in zip(c.p, ss, strict=True):
        c.w.drive(p, "clear_sender", s)



def ready_room(pages: list[int], aux: int = -1, room: int = 1, config: Config = DEFAULTS
               ) -> tuple[Cluster, SimNode, SimNode, ReceiverRoom, SenderRoom]:
    """A registered pair with one room whose destination reached its sender (at 100 ms)."""
    c = Cluster(config)
    register_pair(c)
    p, d = c.p[0], c.d[0]
    r = c.receiver(d, room, pages, aux=aux)
    s = c.sender(p, room)
    c.run_ms(100)
    return c, p, d, r, s
