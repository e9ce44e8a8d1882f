"""Attacks on state-only ranks: prefill ranks that replicate another's KV heads (prefill TP above the KV head
count) are dummies for the KV, but each holds a slice of split mamba state of its own; the decode marks them
``state_only``, sends them the room's state indices when the room has any, waits for their success and fences on
them like any sender.

``Net`` is one decode core (TP1, 2 KV heads, mamba state split by TP, one aux row buffer) and one real prefill
core per rank of a TP4 prefill: ranks 0 and 2 hold the two head groups (KV senders), ranks 1 and 3 replicate
them (state-only in a room with state, plain dummies in a room without). Messages go through the codec; posts
stay in flight until a test settles them; time moves only when a test ticks both sides' timers. Every
interleaving is scripted.

The promises attacked:

1. a state-only rank's failure (failed Status, declared dead, Bye, restart, registration timeout, restart seen at
   registration) fails the room, and the room fences on it exactly as on a KV sender (the same trace);
2. abort / clear / close / waiting timeout while its write is in flight: the prefill cancels and reports once its
   post settled, the decode waits for that; both cores' tables are empty afterwards;
3. a plain dummy's success is dropped; a state-only rank's is counted once, in every order;
4. prefill: a dummy with state indices posts its state only (no KV, no aux) and reports success once it settled;
   without, it posts nothing and reports failures only; a lying decode gets no replicated state from a non-first
   rank;
5. staging: state-only ranks take no slots.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import numpy as np
import pytest

from asynckv.config import Config
from asynckv.errors import Aborted, TransferFailed
from asynckv.proto import actions as act
from asynckv.proto.decode import DecodeCore
from asynckv.proto.destinations import CheckDestination
from asynckv.proto.messages import PROTOCOL_VERSION, Abort, Bye, Pong, RegisterResult, Status, TransferInfo
from asynckv.proto.prefill import PrefillCore
from asynckv.proto.receiver import ReceiverRoom
from asynckv.proto.states import ReceiverState, SenderState
from asynckv.proto.topology import PrefillInstance, plan_targets, stub_agent_metadata
from asynckv.service.decode_staging import DecodeStaging
from asynckv.service.manager import _register_template

from .harness import state_of
from .test_state_rank_attacks import (
    ADDR,
    DEC_EP,
    DST,
    MAMBA,
    ME,
    SRC,
    STATE_DST,
    STATE_SRC,
    Buffers,
    Geo,
    build,
    prank,
    state_coverage,
    transfer,
    wire,
)

GEO = Geo(4, 1, 2, state="mamba")
KV0, SO1, KV2, SO3 = (f"prefill-0-{t}" for t in range(4))
"""Prefill rank agents: 0 and 2 send the KV (0 also the aux row), 1 and 3 replicate their heads."""
ALL = (KV0, SO1, KV2, SO3)
AUX_ROWS, AUX_ITEM = 8, 16
D_AUX, P_AUX = 3, 5
CFG = Config(heartbeat_interval_s=0.5, heartbeat_max_failures=7, fence_timeout_s=5.0, waiting_timeout_s=300.0,
             handshake_timeout_s=30.0, bootstrap_timeout_s=300.0)


def with_aux(b: Buffers) -> Buffers:
    aux = np.zeros((AUX_ROWS, AUX_ITEM), dtype=np.uint8)
    b.args = dataclasses.replace(b.args, aux_data_ptrs=[int(aux.ctypes.data)], aux_data_lens=[aux.nbytes],
                                 aux_item_lens=[AUX_ITEM], owners=(*b.args.owners, aux))
    return b


class Net:
    """The decode core and the prefill cores of ``geo`` (decode rank 0 of stage 0), wired sans IO."""

    def __init__(self, geo: Geo = GEO, config: Config = CFG, slots: int | None = None,
                 renamed: dict[str, str] | None = None) -> None:
        self.now = 0.0
        self.geo = geo
        self.dec = with_aux(build(geo, geo.tp_d, 0, geo.pp_d, 0))
        self.staging = None
        if slots is not None:
            slot = int(sum(self.dec.args.kv_item_lens)) * max(1, geo.heads // geo.tp_p) // self.dec.args.kv_head_num
            self.staging = DecodeStaging(slots * slot, self.dec.args)
        register = _register_template(ME, DEC_EP, self.dec.args, (0, 0), stub_agent_metadata(ME))
        self.d = DecodeCore(ME, DEC_EP, self.dec.args, config, register, itertools.count(1), self.staging)
        ranks = {(0, t, p): prank(geo, t, p) for t in range(geo.tp_p) for p in range(geo.pp_p)}
        self.inst = PrefillInstance(tp_size=geo.tp_p, pp_size=geo.pp_p, dp_size=1, page_size=self.dec.args.page_size,
                                    kv_dtype="bfloat16", is_mla=False, protocol_version=PROTOCOL_VERSION, ranks=ranks)
        self.plan = plan_targets(self.inst, room=0, tp_size=geo.tp_d, engine_rank=0, pp_size=geo.pp_d,
                                 total_kv_heads=geo.heads, split_state=self.dec.args.state_split_by_tp)
        self.p: dict[str, PrefillCore] = {}
        self.ep: dict[str, str] = {}
        for r in (t.rank for t in self.plan.targets):
            b = with_aux(build(geo, geo.tp_p, r.tp_rank, geo.pp_p, r.pp_rank))
            name = (renamed or {}).get(r.agent_id, r.agent_id)  # (another incarnation than the topology says)
            self.p[r.agent_id] = PrefillCore(name, r.endpoint, b.args, config)
            self.ep[r.endpoint] = r.agent_id
        self.inflight: dict[str, dict[int, act.Post]] = {a: {} for a in self.p}
        self.posts: dict[str, list[act.Post]] = {a: [] for a in self.p}
        self.cancels: dict[str, set[int]] = {a: set() for a in self.p}
        self.to_d: list[tuple[float, str, Any]] = []
        """Every message a prefill core sent to the decode: (time, agent, message)."""
        self.to_p: list[tuple[float, str, Any]] = []
        self.silent: set[str] = set()
        """Agents cut off: nothing they send or are sent arrives."""
        self.drop: Any = lambda agent, msg: False
        """Messages to a prefill rank lost on the way (agent, message) -> bool."""
        self.edit: Any = lambda agent, msg: msg
        """What a lying decode sends instead (agent, message) -> message."""
        self.finished: dict[int, float] = {}
        """Decode rooms by id(room) -> when their Finished came."""
        self.scatters: list[act.Scatter] = []
        self.closed_at: float | None = None
        self.senders: dict[tuple[str, int], Any] = {}
        self.d.topology_fetched(ADDR, self.inst, self.now)

    # -- the wire -------------------------------------------------------------------------------

    def pump(self) -> None:
        busy = True
        while busy:
            busy = False
            for a in self.d.actions():
                busy = True
                if isinstance(a, act.Send):
                    agent = self.ep.get(a.endpoint)
                    msg = wire(a.msg)
                    if agent is None or agent in self.silent or self.drop(agent, msg):
                        continue
                    msg = self.edit(agent, msg)
                    self.to_p.append((self.now, agent, msg))
                    self.p[agent].receive(msg, self.now)
                elif isinstance(a, act.Scatter):
                    self.scatters.append(a)
                    self.d.scattered(a.room, None, self.now)
                elif isinstance(a, act.Finished):
                    self.finished.setdefault(id(a.room), self.now)
                elif isinstance(a, act.Closed):
                    self.closed_at = self.now
                elif isinstance(a, act.FetchTopology):
                    self.d.topology_fetched(a.addr, self.inst, self.now)
            for agent, core in self.p.items():
                for a in core.actions():
                    busy = True
                    if isinstance(a, act.Send):
                        assert a.endpoint == DEC_EP, a
                        if agent in self.silent:
                            continue
                        msg = wire(a.msg)
                        self.to_d.append((self.now, agent, msg))
                        self.d.receive(msg, self.now)
                    elif isinstance(a, act.ConnectPeer):
                        core.peer_connected(a.peer, None, self.now)
                    elif isinstance(a, CheckDestination):
                        core.destination_checked(a.token, a.run(), self.now)
                    elif isinstance(a, act.Post):
                        self.inflight[agent][a.post_id] = a
                        self.posts[agent].append(a)
                    elif isinstance(a, act.CancelPosts):
                        self.cancels[agent].update(a.post_ids)

    def settle(self, agent: str, error: BaseException | None = None, kind: str | None = None) -> int:
        """The data plane settles ``agent``'s posts in flight (of ``kind``); returns how many."""
        core, n = self.p[agent], 0
        for post_id, post in list(self.inflight[agent].items()):
            if kind is None or post.kind == kind:
                del self.inflight[agent][post_id]
                core.post_settled(post_id, error, self.now)
                n += 1
        self.pump()
        return n

    def advance(self, to: float, step: float = 0.5) -> None:
        """Tick every timer each ``step`` up to ``to`` (the heartbeats run: only silent ranks die)."""
        while self.now + 1e-9 < to:
            self.now = min(to, round(self.now + step, 6))
            self.d.handle_timer(self.now)
            for core in self.p.values():
                core.handle_timer(self.now)
            self.pump()

    # -- rooms ----------------------------------------------------------------------------------

    def open(self, room: int = 7, state: bool = True, aux: bool = True, pages: list[int] | None = None
             ) -> ReceiverRoom:
        """A decode room (with or without state indices) and every prefill rank's sender, destinations sent."""
        r = self.d.open_receiver(ADDR, room, self.now)
        self.d.receiver_init(r, DST if pages is None else pages, D_AUX if aux else -1,
                             STATE_DST[self.geo.state] if state else None, 0, self.now)
        self.pump()
        for agent, core in self.p.items():
            s = self.senders[(agent, room)] = core.open_sender(room, self.now)
            core.sender_init(s, len(SRC), P_AUX if aux else -1, self.now)
        self.pump()
        return r

    def send(self, room: int = 7, chunks: int = 1) -> None:
        """Every prefill rank sends the room (its state with the last chunk: the prefill does not know whether
        the decode wants it)."""
        cut = [0, *(len(SRC) * (i + 1) // chunks for i in range(chunks))]
        for i in range(chunks):
            for agent, core in self.p.items():
                last = i == chunks - 1
                core.send_chunk(self.senders[(agent, room)], SRC[cut[i]:cut[i + 1]],
                                STATE_SRC[self.geo.state] if last else None, self.now)
            self.pump()

    def session(self, agent: str) -> int:
        return self.d.registrations[agent].session

    def status(self, r: ReceiverRoom, agent: str, ok: bool = True, session: int | None = None) -> None:
        """A Status straight into the decode, as ``agent`` would send it (its session unless named)."""
        rank = self.p[agent].sender_rank
        self.d.receive(Status(r.room, r.epoch, agent, self.session(agent) if session is None else session, rank, ok,
                              "" if ok else "boom"), self.now)
        self.pump()

    def statuses(self, agent: str, room: int | None = None) -> list[Status]:
        return [m for _, a, m in self.to_d if a == agent and isinstance(m, Status) and (room is None or m.room == room)]

    def infos(self, room: int = 7) -> dict[str, TransferInfo]:
        return {a: m for _, a, m in self.to_p if isinstance(m, TransferInfo) and m.room == room}

    def kinds(self, agent: str) -> list[str]:
        return [p.kind for p in self.posts[agent]]


def assert_clean(net: Net) -> None:
    """Nothing of any room left in either core's tables."""
    counts = net.d.room_counts()
    assert (counts["receivers"], counts["fencing_rooms"], counts["waiting_for_staging"],
            counts["topology_lookups"]) == (0, 0, 0, 0), counts
    assert not net.d.fencing and not net.d.rooms
    for agent, core in net.p.items():
        pc = core.room_counts()
        if agent in net.silent:  # (a rank that heard nothing of the room's end keeps a failure notice, for its TTL)
            pc = {k: v for k, v in pc.items() if not k.startswith("early_")}
        assert all(v == 0 for v in pc.values()), (agent, pc)
        assert not net.inflight[agent], agent
    if net.staging is not None:
        assert net.staging.free_slots == net.staging.slots


def lease_end(net: Net, agent: str, before: float = float("inf")) -> float:
    """When the last lease the decode granted ``agent`` (registration, then each Pong) runs out, and a write
    started just inside it has landed."""
    grants = [t for t, a, m in net.to_p if a == agent and isinstance(m, Pong) and t < before]
    grants += [t for t, a, m in net.to_d if a == agent and isinstance(m, RegisterResult) and m.ok and t < before]
    return max(grants) + net.d.liveness.lease_s + net.d.liveness.interval_s / 2


def clear_all(net: Net, r: ReceiverRoom, room: int = 7) -> None:
    net.d.clear_receiver(r, net.now)
    for agent, core in net.p.items():
        core.clear_sender(net.senders[(agent, room)], net.now)
    net.pump()


# -- the plan the tests rely on ------------------------------------------------------------------------------------


def test_the_rig_has_two_kv_senders_and_two_state_only_ranks() -> None:
    net = Net()
    flags = {t.rank.agent_id: (t.is_dummy, t.state_only, t.write_aux) for t in net.plan.targets}
    assert flags == {KV0: (False, False, True), SO1: (True, True, False), KV2: (False, False, False),
                     SO3: (True, True, False)}
    with_state, without = net.open(7), net.open(8, state=False)
    assert {a: p.dummy for a, p in with_state.ranks.items()} == dict.fromkeys(ALL, False)
    assert {a: p.dummy for a, p in without.ranks.items()} == {KV0: False, SO1: True, KV2: False, SO3: True}
    assert (with_state.required_responses, without.required_responses) == (4, 2)


# -- promise 1 and 2: a state-only rank fences the room exactly as a KV sender --------------------------------------


def _normal(trace: list[Any], victim: str) -> list[Any]:
    return [tuple("VICTIM" if x == victim else x for x in step) if isinstance(step, tuple) else step
            for step in trace]


def fence_trace(victim: str, how: str) -> list[Any]:
    """One room with state: every rank but ``victim`` lands its writes and reports; ``victim``'s stay in flight;
    then ``how`` happens. Returns what the decode did when (asserting the fence on the way)."""
    config = dataclasses.replace(CFG, waiting_timeout_s=2.0) if how == "timeout" else CFG
    net = Net(config=config)
    r = net.open()
    net.send()
    for agent in ALL:
        if agent != victim:
            net.settle(agent)
    assert net.inflight[victim], f"{victim} has nothing in flight"
    assert r.state is ReceiverState.WAITING and id(r) not in net.finished, "success while a sender may still write"
    assert r.responses == set(ALL) - {victim}
    trace: list[Any] = [("in flight", r.state.name, len(r.responses))]
    if how == "abort":
        net.d.abort_receiver(r, Aborted("by the application"), net.now)
    elif how == "clear":
        net.d.clear_receiver(r, net.now)
    elif how == "close":
        net.d.close(net.now)
    elif how == "timeout":
        net.advance(2.0)
    elif how == "bye":  # the prefill rank closes: it says goodbye only once its posts settled
        net.p[victim].close(net.now)
    elif how == "restart":  # the topology now names another incarnation of the victim's rank
        old = net.inst.ranks
        key = next(k for k, v in old.items() if v.agent_id == victim)
        new = dict(old)
        new[key] = dataclasses.replace(old[key], agent_id=victim + "-new")
        net.d.topology_fetched(ADDR, dataclasses.replace(net.inst, ranks=new), net.now)
    elif how == "silence":
        net.silent.add(victim)
    elif how == "abort_lost":  # it never hears the Abort: the fence timeout declares it dead
        net.drop = lambda agent, msg: agent == victim and isinstance(msg, Abort)
        net.d.abort_receiver(r, Aborted("by the application"), net.now)
    else:
        raise AssertionError(how)
    net.pump()
    trace.append(("triggered", net.now, r.state.name, r.exception.__class__.__name__))
    if how in ("abort", "clear", "close", "timeout", "abort_lost"):
        got = [m for _, a, m in net.to_p if a == victim and isinstance(m, Abort)]
        assert got or how == "abort_lost", "no Abort to the rank still writing"
        assert state_of(r) is ReceiverState.FENCING, r
    if how in ("abort", "clear", "close", "timeout", "bye"):
        assert set(net.inflight[victim]) <= net.cancels[victim], "its posts were not cancelled"
        assert not net.statuses(victim), "a status before its posts settled"
        net.advance(net.now + 1.0)
        assert id(r) not in net.finished, "pages handed back while the rank may still write"
        assert r.state in (ReceiverState.FENCING, ReceiverState.WAITING), r
        trace.append(("waiting", net.now, r.state.name))
        net.settle(victim, Aborted("cancelled"))
        trace.append(("settled", [(m.ok, m.room) for m in net.statuses(victim)]))
    else:
        net.advance(net.now + 20.0)
    assert state_of(r) is ReceiverState.FAILED and id(r) in net.finished, r
    trace.append(("finished", net.finished[id(r)], r.exception.__class__.__name__))
    if how in ("silence", "restart", "abort_lost"):  # fenced by its leases: none outlives the room's pages
        assert set(net.inflight[victim]) <= net.cancels[victim], "the prefill rank did not cancel its posts"
        end = lease_end(net, victim)
        assert net.finished[id(r)] >= end, (net.finished[id(r)], end)
        trace.append(("leases", end))
    if how == "close":
        assert net.closed_at == net.finished[id(r)] and not net.d.registrations
    if how not in ("clear", "close"):
        net.d.clear_receiver(r, net.now)
    for agent, core in net.p.items():
        core.clear_sender(net.senders[(agent, 7)], net.now)
    net.pump()
    for agent in ALL:
        net.settle(agent, Aborted("cancelled"))
    net.advance(net.now + 1.0)
    assert_clean(net)
    return trace


FENCES = ["abort", "clear", "close", "timeout", "bye", "restart", "silence", "abort_lost"]


@pytest.mark.parametrize("how", FENCES)
def test_a_state_only_rank_still_writing_is_fenced_on_exactly_as_a_kv_sender(how: str) -> None:
    """The room fails and hands nothing back while the rank may still write, and the trace (what, when) is the one a
    KV sender in the same place gives."""
    kv = _normal(fence_trace(KV2, how), KV2)
    so = _normal(fence_trace(SO1, how), SO1)
    assert so == kv


@pytest.mark.parametrize("failing, writing", [(KV2, SO1), (SO1, KV2), (SO3, SO1), (KV0, SO3)])
def test_a_failed_status_fences_on_every_rank_still_writing_state_only_or_not(failing: str, writing: str) -> None:
    """One rank's write fails (its Status says so once its post settled) while another's is in flight: the room
    fails at once and stays fencing until that one answers its Abort, whichever kind each is."""
    net = Net()
    r = net.open()
    net.send()
    for agent in ALL:
        if agent not in (failing, writing):
            net.settle(agent)
    net.settle(failing, TransferFailed("nixl said no"))
    [st] = net.statuses(failing)
    assert not st.ok and r.state is ReceiverState.FENCING and isinstance(r.exception, TransferFailed)
    assert [m for _, a, m in net.to_p if a == writing and isinstance(m, Abort)]
    assert set(net.inflight[writing]) <= net.cancels[writing] and net.inflight[writing]
    net.advance(1.0)
    assert r.state is ReceiverState.FENCING and id(r) not in net.finished
    net.settle(writing, Aborted("cancelled"))
    assert state_of(r) is ReceiverState.FAILED and net.finished[id(r)] == 1.0
    clear_all(net, r)
    assert_clean(net)


@pytest.mark.parametrize("how", ["timeout", "restarted"])
def test_a_state_only_rank_failing_its_registration_fails_the_room_as_a_kv_sender_does(how: str) -> None:
    """Before any destination went out: its registration times out, or it answers that it restarted. The room
    fails (nothing to fence: nobody got the destination) and every rank hears an Abort; the same for a KV rank."""
    def run(victim: str) -> list[Any]:
        net = Net(config=dataclasses.replace(CFG, handshake_timeout_s=2.0),
                  renamed={victim: victim + "-reborn"} if how == "restarted" else None)
        if how == "timeout":
            net.silent.add(victim)
        r = net.open()
        net.advance(3.0)
        assert r.state is ReceiverState.FAILED and not net.infos(), r
        aborts = sorted((a, m.destination_sent) for _, a, m in net.to_p if isinstance(m, Abort))
        assert aborts == sorted((a, False) for a in ALL if a != victim or how == "restarted")
        net.d.clear_receiver(r, net.now)
        for agent, core in net.p.items():
            core.clear_sender(net.senders[(agent, 7)], net.now)
        net.advance(net.now + 1.0)
        assert_clean(net)
        return [net.finished[id(r)], type(r.exception).__name__, len(aborts)]

    assert run(SO1) == run(KV2)


def test_the_death_of_a_state_only_rank_after_its_success_does_not_fail_the_room() -> None:
    net = Net()
    r = net.open()
    net.send()
    net.settle(SO1)
    assert [m.ok for m in net.statuses(SO1)] == [True]
    net.silent.add(SO1)
    net.advance(6.0)
    assert SO1 not in net.d.registrations and r.state is ReceiverState.WAITING
    for agent in (KV0, KV2, SO3):
        net.settle(agent)
    assert state_of(r) is ReceiverState.SUCCEEDED


# -- promise 2 on the prefill side --------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["abort", "clear", "close"])
def test_the_prefill_cancels_a_state_only_write_and_reports_only_once_it_settled(how: str) -> None:
    """The prefill fails its room while the state-only rank's state post is in flight: the post is cancelled, the
    decode hears nothing until it settled (even if it landed after all), then the failure; nothing is left."""
    net = Net()
    r = net.open()
    net.send()
    for agent in (KV0, KV2, SO3):
        net.settle(agent)
    core, s = net.p[SO1], net.senders[(SO1, 7)]
    [post] = net.inflight[SO1].values()
    if how == "abort":
        core.abort_sender(s, Aborted("by the application"), net.now)
    elif how == "clear":
        core.clear_sender(s, net.now)
    else:
        core.close(net.now)
    net.pump()
    assert post.post_id in net.cancels[SO1] and s.state is SenderState.DRAINING
    assert not net.statuses(SO1) and r.state is ReceiverState.WAITING
    net.advance(1.0)
    assert not net.statuses(SO1) and r.state is ReceiverState.WAITING and id(r) not in net.finished
    net.settle(SO1)  # (it landed before the cancel took: the room failed all the same)
    assert state_of(s) is SenderState.FAILED
    if how == "close":  # a closing prefill says goodbye instead: decode fences on it at once
        assert not net.statuses(SO1) and [m for _, a, m in net.to_d if a == SO1 and isinstance(m, Bye)]
        assert net.p[SO1].closed
    else:
        assert [m.ok for m in net.statuses(SO1)] == [False]
    assert state_of(r) is ReceiverState.FAILED
    clear_all(net, r)
    net.advance(net.now + 1.0)
    assert_clean(net)


def test_a_queued_state_write_of_a_failed_room_is_never_posted() -> None:
    """A state-only rank's state write waits for the in-flight byte budget behind another room's; its room is
    aborted meanwhile: it reports the failure at once (nothing of it in flight) and the write is never posted."""
    net = Net(config=dataclasses.replace(CFG, max_inflight_bytes=1))
    a, b = net.open(7), net.open(8)
    net.send(7)
    net.send(8)
    assert [p.room for p in net.posts[SO1]] == [7]
    net.d.abort_receiver(b, Aborted("app"), net.now)
    net.pump()
    assert [m.ok for m in net.statuses(SO1, 8)] == [False]
    net.settle(SO1)
    assert [p.room for p in net.posts[SO1]] == [7] and [m.ok for m in net.statuses(SO1, 7)] == [True]
    for agent in (KV0, KV2, SO3):
        while net.settle(agent):
            pass
    assert a.state is ReceiverState.SUCCEEDED and b.state is ReceiverState.FAILED
    clear_all(net, a)
    clear_all(net, b, 8)
    assert_clean(net)


def test_a_state_only_rank_registered_again_counts_in_its_new_session_only() -> None:
    """SO1 never answers the Abort of room 7 (its state write in flight): the fence timeout declares it dead, and
    room 7 waits for its leases. Room 8 registers a new session with it: its success there counts, one naming
    the old session does not, and room 7 is still fenced by the old session's leases."""
    net = Net()
    r7 = net.open(7)
    net.send(7)
    for agent in (KV0, KV2, SO3):
        net.settle(agent)
    old = net.session(SO1)
    net.drop = lambda agent, msg: agent == SO1 and isinstance(msg, Abort)
    net.d.abort_receiver(r7, Aborted("app"), net.now)
    net.pump()
    net.advance(6.0)
    assert SO1 not in net.d.registrations and r7.state is ReceiverState.FENCING
    end = lease_end(net, SO1)
    assert end > 6.0
    net.drop = lambda agent, msg: False
    r8 = net.open(8)
    assert net.session(SO1) != old and r8.state is ReceiverState.WAITING, r8
    net.send(8)
    net.status(r8, SO1, session=old)
    assert SO1 not in r8.responses
    for agent in (KV0, KV2, SO3):
        net.settle(agent)
    net.settle(SO1, kind="state")  # (both rooms' posts: room 7's cancelled one lands too)
    assert state_of(r8) is ReceiverState.SUCCEEDED and r8.responses == set(ALL)
    assert r7.state is ReceiverState.FENCING
    net.advance(10.0)
    assert state_of(r7) is ReceiverState.FAILED and net.finished[id(r7)] >= end
    clear_all(net, r7)
    clear_all(net, r8, 8)
    assert_clean(net)


# -- promise 3: counting successes ----------------------------------------------------------------------------------


def test_successes_count_once_per_sender_in_every_order_with_and_without_state() -> None:
    """All 24 orders of the four ranks' successes, each repeated and an earlier one replayed after it: a room with
    state succeeds at the fourth distinct rank, never before; a room without succeeds once both KV senders did,
    wherever the dummies' successes (dropped) fall."""
    net = Net()
    bad = []
    for i, order in enumerate(itertools.permutations(ALL)):
        rooms = {True: net.open(100 + 2 * i, aux=False), False: net.open(101 + 2 * i, state=False, aux=False)}
        for state, r in rooms.items():
            dropped = net.d.stats["dropped_unexpected_status"]
            counted: list[str] = []
            for agent in order:
                net.status(r, agent)
                net.status(r, agent)  # a duplicate
                net.status(r, order[0])  # an earlier one again
                if state or agent in (KV0, KV2):
                    counted.append(agent)
                want = len(counted) == (4 if state else 2)
                if r.responses != set(counted) or (r.state is ReceiverState.SUCCEEDED) != want:
                    bad.append(f"{order} state={state} after {agent}: {r.responses} {r.state.name}")
            if net.d.stats["dropped_unexpected_status"] - dropped != 12 - len(counted):  # (all but the first of each
                bad.append(f"{order} state={state}: {net.d.stats['dropped_unexpected_status'] - dropped} dropped")
            # counted rank's are dropped)
            if not state and r.responses & {SO1, SO3}:
                bad.append(f"{order}: a plain dummy counted")
            net.d.clear_receiver(r, net.now)
    assert not bad, bad[:6]


def test_a_plain_dummys_success_is_dropped_and_cannot_complete_a_room() -> None:
    """Room without state: KV0's success plus both dummies' (forged, repeated) leave it waiting for KV2."""
    net = Net()
    r = net.open(state=False)
    before = net.d.stats["dropped_unexpected_status"]
    net.status(r, KV0)
    for _ in range(3):
        net.status(r, SO1)
        net.status(r, SO3)
    assert r.state is ReceiverState.WAITING and r.responses == {KV0}
    assert net.d.stats["dropped_unexpected_status"] - before == 6
    assert not r.ranks[SO1].done and not r.ranks[SO1].may_write
    net.status(r, KV2)
    assert state_of(r) is ReceiverState.SUCCEEDED


def test_a_state_only_success_in_another_session_or_before_its_destination_is_not_counted() -> None:
    net = Net()
    r = net.open()
    net.status(r, SO1, session=net.session(SO1) + 1)
    assert SO1 not in r.responses and not r.ranks[SO1].done
    net.status(r, SO1, ok=True)
    assert r.responses == {SO1}
    # a room still resolving (its destination not sent): a success from a state-only rank is not counted
    net2 = Net()
    net2.silent.add(KV2)  # KV2 never registers: nothing is sent
    r2 = net2.open()
    assert r2.state is ReceiverState.RESOLVING
    net2.d.receive(Status(r2.room, r2.epoch, SO1, net2.session(SO1), 1, True, ""), net2.now)
    assert not r2.responses and not r2.ranks[SO1].done


def test_the_rooms_of_one_core_count_state_only_ranks_each_by_its_own_state() -> None:
    """Two rooms at once, one with state and one without: SO1's success counts in the first only."""
    net = Net()
    a, b = net.open(7), net.open(8, state=False)
    for agent in (KV0, KV2, SO3):
        net.status(a, agent)
    for agent in ALL:
        net.status(b, agent)
    assert b.state is ReceiverState.SUCCEEDED and b.responses == {KV0, KV2}
    assert a.state is ReceiverState.WAITING
    net.status(a, SO1)
    assert state_of(a) is ReceiverState.SUCCEEDED


# -- promise 4: what the prefill posts and reports --------------------------------------------------------------------


@pytest.mark.parametrize("chunks", [1, 3])
def test_a_state_only_rank_posts_its_state_alone_and_reports_once_it_settled(chunks: int) -> None:
    """Its destination has no pages, the room's state indices and no aux; it posts one state write, on the last
    chunk (none before), neither KV nor aux even though its sender has an aux row; success only once settled."""
    net = Net()
    r = net.open()
    info = net.infos()[SO1]
    assert info.is_dummy and not info.write_aux and not len(info.dst_pages)
    assert info.dst_state_indices.tolist() == STATE_DST["mamba"]
    net.send(chunks=chunks)
    assert net.kinds(SO1) == ["state"] and net.kinds(SO3) == ["state"]
    [post] = net.posts[SO1]
    assert post.src.tolist() == STATE_SRC["mamba"] and post.dst.tolist() == STATE_DST["mamba"]
    assert "aux" not in net.kinds(KV2) and net.kinds(KV0).count("state") == 1  # (the aux row rides on KV0's KV)
    assert not net.statuses(SO1)
    net.settle(SO1)
    assert [m.ok for m in net.statuses(SO1)] == [True] and r.responses == {SO1}
    for agent in (KV0, KV2, SO3):
        net.settle(agent)
    assert r.state is ReceiverState.SUCCEEDED and all(len(net.statuses(a)) == 1 for a in ALL)


def test_a_plain_dummy_posts_nothing_and_reports_failures_only() -> None:
    net = Net()
    r = net.open(state=False)
    assert not len(net.infos()[SO1].dst_state_indices) and not len(net.infos()[SO1].dst_pages)
    net.send(chunks=2)
    assert net.kinds(SO1) == [] and net.kinds(SO3) == []
    assert net.senders[(SO1, 7)].state is SenderState.SUCCEEDED and not net.statuses(SO1)
    for agent in (KV0, KV2):
        net.settle(agent)
    assert r.state is ReceiverState.SUCCEEDED and not net.statuses(SO1) and not net.statuses(SO3)
    # a failing one reports its failure
    net.open(8, state=False)
    net.p[SO3].abort_sender(net.senders[(SO3, 8)], Aborted("app"), net.now)
    net.pump()
    assert [m.ok for m in net.statuses(SO3, 8)] == [False] and net.d.rooms[8].state is ReceiverState.FAILED


def test_a_state_only_rank_whose_sender_gives_no_state_fails_the_room_as_a_kv_sender_would() -> None:
    net = Net()
    r = net.open()
    core = net.p[SO1]
    core.send_chunk(net.senders[(SO1, 7)], SRC, None, net.now)
    net.pump()
    assert net.senders[(SO1, 7)].state is SenderState.FAILED and net.kinds(SO1) == []
    assert [m.ok for m in net.statuses(SO1)] == [False] and r.state is ReceiverState.FAILED


@pytest.mark.parametrize("write_aux", [False, True], ids=["plain", "claims-aux"])
def test_a_lying_decode_gets_no_replicated_state_from_a_non_first_dummy(write_aux: bool) -> None:
    """NSA (the same bytes on every prefill rank): the decode's plan sends dummies no state. One that sends rank 1
    (a dummy, not the first of its group) the state indices anyway gets nothing written by it; rank 0 writes
    the state once."""
    geo = Geo(4, 1, 2, state="nsa")
    net = Net(geo)

    def lie(agent: str, msg: Any) -> Any:
        if agent == SO1 and isinstance(msg, TransferInfo):
            return dataclasses.replace(msg, dst_state_indices=np.asarray(STATE_DST["nsa"], dtype=np.int32),
                                       write_aux=write_aux, aux_index=-1)
        return msg

    net.edit = lie
    r = net.open()
    assert not len(net.infos()[SO3].dst_state_indices)
    for agent, core in net.p.items():
        core.send_chunk(net.senders[(agent, 7)], SRC, STATE_SRC["nsa"], net.now)
    net.pump()
    assert net.kinds(KV0).count("state") == 1 and net.kinds(KV2).count("state") == 0
    assert "state" not in net.kinds(SO1), f"rank 1 wrote replicated state: {net.kinds(SO1)}"
    assert net.kinds(SO1) == [] and net.kinds(SO3) == []
    for agent in ALL:
        net.settle(agent)
    assert r.state is ReceiverState.SUCCEEDED


# -- promise 5: staging ---------------------------------------------------------------------------------------------


def test_state_only_ranks_take_no_staging_slots() -> None:
    """An area of exactly the slots of the two KV senders (3 pages each): the room goes at once (state-only ranks
    taking slots would need 12 and fail it), they get no pages, the scatter has the KV senders' slices only, and a
    second room waits for the first one's slots, state-only success included."""
    net = Net(slots=6)
    assert net.staging is not None and net.staging.usable(4) and net.staging.slots == 6
    a = net.open(7)
    assert a.state is ReceiverState.WAITING, a.exception
    assert set(a.staged) == {KV0, KV2} and net.staging.free_slots == 0
    infos = net.infos(7)
    assert not len(infos[SO1].dst_pages) and not len(infos[SO3].dst_pages)
    assert sorted(infos[KV0].dst_pages.tolist() + infos[KV2].dst_pages.tolist()) == list(range(6))
    b = net.open(8)
    assert b.state is ReceiverState.RESOLVING and not net.infos(8)
    net.send(7)
    for agent in (KV0, KV2, SO3):
        net.settle(agent)
    assert a.state is ReceiverState.WAITING and b.state is ReceiverState.RESOLVING
    net.settle(SO1)
    assert state_of(a) is ReceiverState.SUCCEEDED and len(net.scatters) == 1
    assert {s.agent_id for s in net.scatters[0].slices} == {KV0, KV2}
    assert state_of(b) is ReceiverState.WAITING and set(b.staged) == {KV0, KV2}
    net.send(8)
    for agent in ALL:
        net.settle(agent)
    assert state_of(b) is ReceiverState.SUCCEEDED
    clear_all(net, a)
    clear_all(net, b, 8)
    assert_clean(net)


def test_a_staged_room_fencing_on_a_state_only_rank_keeps_its_slots_until_the_fence() -> None:
    net = Net(slots=6)
    r = net.open()
    net.send()
    for agent in (KV0, KV2, SO3):
        net.settle(agent)
    net.d.abort_receiver(r, Aborted("app"), net.now)
    net.pump()
    assert r.state is ReceiverState.FENCING and net.staging is not None and net.staging.free_slots == 0
    net.settle(SO1, Aborted("cancelled"))
    assert state_of(r) is ReceiverState.FAILED and net.staging.free_slots == 6
    clear_all(net, r)
    assert_clean(net)


# -- end to end, bytes: PP and the room without state ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SplitMla(Geo):
    """MLA with mamba state split by TP too (e.g. MLA beside linear-attention layers): every rank but the first of
    each decode rank's group is a dummy for the latent, and each holds a slice of the state."""

    @property
    def mamba(self) -> tuple[tuple[int, int, int], ...]:
        return MAMBA

    def __str__(self) -> str:
        return "split-" + super().__str__()


E2E = [Geo(4, 1, 2, pp_p=2, state="mamba"), Geo(8, 2, 2, pp_p=3, state="mamba"),
       Geo(4, 2, 1, pp_p=2, pp_d=2, state="mamba"), SplitMla(4, 1, 1, state="mamba", mla=True),
       SplitMla(8, 2, 1, pp_p=2, state="mamba", mla=True)]


@pytest.mark.parametrize("geo, staged", [(g, s) for g in E2E for s in (False, True) if not (s and g.mla)],
                         ids=lambda v: str(v) if isinstance(v, Geo) else ("staged" if v else "per-token"))
def test_state_only_ranks_of_every_stage_land_their_slices_once(geo: Geo, staged: bool) -> None:
    """End to end with real bytes: every dummy gets no pages and the state indices, posts its state once, and every
    state byte lands once where it belongs; the same model's room without state succeeds with no state posts."""
    out = transfer(geo, geo.tp_d - 1, staged, d_stage=geo.pp_d - 1)
    assert out.final is ReceiverState.SUCCEEDED
    assert not out.wrong and not out.outside and not state_coverage(out), (out.wrong + state_coverage(out))[:4]
    assert out.dummies and all(out.state_posts[a] == 1 for a in out.dummies)
    for a in out.dummies:
        assert not len(out.infos[a].dst_pages) and out.infos[a].dst_state_indices.tolist() == STATE_DST["mamba"]
    without = transfer(geo, geo.tp_d - 1, staged, d_stage=geo.pp_d - 1, with_state=False)
    assert without.final is ReceiverState.SUCCEEDED and not without.state_posts
