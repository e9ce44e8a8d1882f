"""A deterministic simulator of many prefill and decode ranks, in the FoundationDB tradition.

The real sans-IO cores (``PrefillCore``, ``DecodeCore``) run over a simulated network and
data plane driven by one seeded random generator and one simulated clock: the same seed
gives the same run, event for event. ``asynckv.testing.schedule`` draws the workload and
the faults; this module runs them and checks, after every step:

- **I1** no byte lands in a decode page unless the room it is written for owns that page
  (decode hands a page back the moment it reports the room Success or Failed, so a write
  after Failed or into a reused page is caught);
- **I2** every room reaches Success or Failed within its bound of simulated time;
- **I3** Success only when every byte of the room was written (a byte model of each page);
- **I4** every table is empty once managers closed, and already once every room was cleared (the
  early table included) in schedules without process faults, message loss, room ids reused across
  pairs of groups, or a prefill sender unopened at the end (its decode's messages wait for it);
- **I5** a pair that is alive again after faults stop completes new rooms.

The network keeps messages between two endpoints in order (as one ZMQ PUSH socket does);
it delays, loses and duplicates them. The data plane lands writes after a delay, fails
them, stalls them until their deadline, and honours cancellation and write leases the way
the NIXL data plane does. Nodes can be stopped (SIGSTOP: nothing of theirs runs), killed
and restarted with a new incarnation.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import random
from collections.abc import Callable
from typing import Any

import numpy as np

from ..config import Config
from ..errors import PeerUnreachable
from ..layout import KVArgs
from ..proto import actions as act
from ..proto.bootstrap import PrefillRank
from ..proto.decode import DecodeCore
from ..proto.messages import PROTOCOL_VERSION, Message, Register
from ..proto.prefill import PrefillCore
from ..proto.receiver import ReceiverRoom
from ..proto.sender import SenderRoom
from ..proto.states import ReceiverState
from ..proto.topology import PrefillInstance, stub_agent_metadata
from .sim_dataplane import SimDataPlane, SimPost

__all__ = ["SIM_CONFIG", "FaultMix", "SimNode", "World"]

SIM_CONFIG = Config(bootstrap_timeout_s=8.0, waiting_timeout_s=8.0, handshake_timeout_s=2.0, heartbeat_interval_s=0.5,
                    heartbeat_max_failures=4, fence_timeout_s=2.0, xfer_deadline_base_s=2.0, early_info_ttl_s=30.0,
                    max_inflight_bytes=1 << 30)
"""Core configuration of simulated ranks: the real rules with shorter bounds."""

PAGES, AUX_ROWS, HEAD_BYTES, HEADS = 48, 8, 8, 2


@dataclasses.dataclass(frozen=True)
class FaultMix:
    """Probabilities and sizes of the faults a schedule draws."""

    loss: float = 0.0
    dup: float = 0.0
    delay_ms: tuple[float, float] = (0.05, 3.0)
    spike: float = 0.0
    """Probability that a message waits 100-800 ms."""
    post_fail: float = 0.0
    post_stall: float = 0.0
    """Probability that a write never completes (only cancellation, its lease or deadline end it)."""
    post_slow: float = 0.0
    connect_fail: float = 0.0
    post_ms: tuple[float, float] = (0.2, 4.0)
    """How long a write takes (plus its bytes at 5 GB/s)."""
    connect_ms: tuple[float, float] = (5.0, 30.0)
    """How long importing a peer and the warm-up write take."""
    route_ms: tuple[float, float] = (0.5, 5.0)
    """How long a topology look-up (``GET /route``) takes."""
    async_posts: bool = False
    """The transport completes handles on its own (RDMA, TCP): writes run side by side, not one
    engine copy at a time (CMA)."""

    def describe(self) -> str:
        return ", ".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
                         if getattr(self, f.name))


class SimNode:
    """One rank: a core plus what its process would hold (data plane, memory)."""

    def __init__(self, kind: str, group: int, rank: int, incarnation: int, core: Any, endpoint: str) -> None:
        self.kind, self.group, self.rank, self.incarnation = kind, group, rank, incarnation
        self.core = core
        self.name: str = core.name
        self.endpoint = endpoint
        self.alive = True
        self.closed = False
        self.stopped_until: float | None = None
        self.deferred: list[tuple[Callable[..., None], tuple[Any, ...]]] = []
        self.timer_seq = 0
        self.timer_at: float | None = None
        self.leases: dict[str, float] = {}
        self.connected: set[str] = set()
        self.posts: dict[int, SimPost] = {}
        self.owner: dict[int, tuple[int, int]] = {}
        """Decode: page -> (room, epoch) that may be written there now."""
        self.content: dict[tuple[int, int], tuple[int, int, int]] = {}
        """Decode: (page, writer slice) -> (room, epoch, position) that landed there."""
        self.aux_owner: dict[int, tuple[int, int]] = {}
        self.aux_content: dict[int, tuple[int, int]] = {}
        self.src_owner: dict[int, tuple[int, int]] = {}
        """Prefill: page -> (room, position) whose KV it holds."""
        self.engine_at = 0.0
        """Prefill: when its engine thread is done with the copies queued so far."""

    def __repr__(self) -> str:
        return f"{self.name}"


def kv_args(tp_size: int, rank: int) -> KVArgs:
    """A small MHA geometry (one layer, K and V) with fake addresses: nothing is dereferenced."""
    heads = max(1, HEADS // tp_size)
    item = heads * HEAD_BYTES
    base = 0x10000000 * (rank + 1)
    return KVArgs(kv_data_ptrs=[base, base + 0x1000000], kv_data_lens=[PAGES * item] * 2, kv_item_lens=[item] * 2,
                  aux_data_ptrs=[base + 0x2000000], aux_data_lens=[AUX_ROWS * 16], aux_item_lens=[16], page_size=1,
                  tp_size=tp_size, engine_rank=rank, kv_head_num=heads, total_kv_head_num=HEADS)


class World(SimDataPlane):
    """The simulated cluster: nodes, network, data plane, clock, invariants."""

    def __init__(self, seed: int, mix: FaultMix, config: Config = SIM_CONFIG, *, trace: bool = False) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.mix = mix
        self.config = config
        self.now = 0.0
        self._queue: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = itertools.count()
        self._fifo: dict[tuple[str, str], float] = {}
        self.faults_on = True
        self.endpoints: dict[str, SimNode] = {}
        self.names: dict[str, SimNode] = {}
        self.prefill: list[list[SimNode]] = []
        self.decode: list[list[SimNode]] = []
        self.registry: dict[str, dict[int, PrefillRank]] = {}
        self.tracing = trace
        self.trace: list[str] = []
        self.violations: list[str] = []
        self.on_action: Callable[[SimNode, act.Action], None] = lambda node, action: None
        self.hold: Callable[[SimNode, str, Message], float | None] | None = None
        """Scripted interleavings: return None to drop a message, or extra seconds to hold it."""
        self.record: list[tuple[float, str, act.Action]] | None = None
        """When a list, every action is appended as (time, node name, action)."""
        self.steps = 0

    # -- building ----------------------------------------------------------------------

    def addr(self, group: int) -> str:
        return f"p{group}:8998"

    def add_prefill(self, group: int, rank: int, tp_size: int, incarnation: int = 0) -> SimNode:
        endpoint = f"tcp://p{group}r{rank}:{5000 + incarnation}"
        core = PrefillCore(f"P{group}.{rank}.{incarnation}", endpoint, kv_args(tp_size, rank), self.config)
        node = SimNode("prefill", group, rank, incarnation, core, endpoint)
        self._place(node, self.prefill)
        info = PrefillRank(tp_size=tp_size, tp_rank=rank, pp_size=1, pp_rank=0, dp_size=1, dp_rank=0,
                           endpoint=endpoint, agent_id=node.name, page_size=1, kv_dtype="bfloat16", is_mla=False,
                           protocol_version=PROTOCOL_VERSION)
        self.registry.setdefault(self.addr(group), {})[rank] = info
        return node

    def add_decode(self, group: int, rank: int, tp_size: int, incarnation: int = 0) -> SimNode:
        endpoint = f"tcp://d{group}r{rank}:{6000 + incarnation}"
        name = f"D{group}.{rank}.{incarnation}"
        args = kv_args(tp_size, rank)
        register = Register(
            decode_id=name, prefill_id="", session=0, lease_ms=0, endpoint=endpoint, engine_rank=rank,
            tp_size=tp_size, page_size=1, kv_dtype="bfloat16", mem_kind="DRAM", is_mla=False, gpu_id=0,
            kv_ptrs=tuple(args.kv_data_ptrs), kv_lens=tuple(args.kv_data_lens), kv_item_lens=tuple(args.kv_item_lens),
            kv_layer_ids=args.layer_ids, aux_ptrs=tuple(args.aux_data_ptrs), aux_lens=tuple(args.aux_data_lens),
            aux_item_lens=tuple(args.aux_item_lens), scratch_ptr=0x100, scratch_len=64,
            kv_head_num=args.kv_head_num, total_kv_head_num=HEADS, state_type="none", state_ptrs=(), state_lens=(),
            state_item_lens=(), state_layer_ids=(), state_dims=(), state_outer=(),
            agent_metadata=stub_agent_metadata(name))
        core = DecodeCore(name, endpoint, args, self.config, register)
        node = SimNode("decode", group, rank, incarnation, core, endpoint)
        self._place(node, self.decode)
        return node

    def unregister(self, node: SimNode) -> None:
        """A prefill rank leaves its bootstrap server (``DELETE /route`` on close)."""
        ranks = self.registry.get(self.addr(node.group), {})
        if node.kind == "prefill" and node.rank in ranks and ranks[node.rank].agent_id == node.name:
            del ranks[node.rank]

    def _place(self, node: SimNode, groups: list[list[SimNode]]) -> None:
        while len(groups) <= node.group:
            groups.append([])
        ranks = groups[node.group]
        while len(ranks) <= node.rank:
            ranks.append(node)
        ranks[node.rank] = node
        self.endpoints[node.endpoint] = node
        self.names[node.name] = node

    # -- running -----------------------------------------------------------------------

    def at(self, when: float, fn: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self._queue, (when, next(self._seq), fn, args))

    def on(self, node: SimNode, when: float, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` at ``when`` in ``node``'s process (deferred while stopped, dropped once dead)."""
        self.at(when, self._in_node, node, fn, args)

    def _in_node(self, node: SimNode, fn: Callable[..., None], args: tuple[Any, ...]) -> None:
        if not node.alive:
            return
        if node.stopped_until is not None:
            node.deferred.append((fn, args))
            return
        fn(*args)

    def run_until(self, until: float) -> None:
        queue = self._queue
        while queue and queue[0][0] <= until:
            when, _, fn, args = heapq.heappop(queue)
            self.now = max(self.now, when)
            self.steps += 1
            fn(*args)
        self.now = max(self.now, until)

    def drive(self, node: SimNode, method: str, *args: Any) -> Any:
        """Call a core method now (with ``now`` last) and run the actions it produced."""
        if not node.alive:
            return None
        result = getattr(node.core, method)(*args, self.now)
        self._run_actions(node)
        return result

    def log(self, text: str) -> None:
        if self.tracing:
            self.trace.append(f"{self.now * 1000:10.3f} ms  {text}")

    def violation(self, text: str) -> None:
        self.violations.append(f"t={self.now * 1000:.3f} ms: {text}")
        self.log(f"VIOLATION {text}")

    # -- process faults ------------------------------------------------------------------

    def stop(self, node: SimNode, seconds: float) -> None:
        if not node.alive or node.stopped_until is not None:
            return
        node.stopped_until = self.now + seconds
        self.log(f"{node} stopped for {seconds * 1000:.0f} ms")
        self.at(node.stopped_until, self._resume, node)

    def _resume(self, node: SimNode) -> None:
        if not node.alive:
            return
        node.stopped_until = None
        self.log(f"{node} resumed")
        deferred, node.deferred = node.deferred, []
        for fn, args in deferred:  # what queued up while stopped (its own writes re-check their leases first)
            if node.alive and node.stopped_until is None:
                fn(*args)
            else:
                node.deferred.append((fn, args))
        self._arm_timer(node)

    def kill(self, node: SimNode) -> None:
        if not node.alive:
            return
        node.alive = False
        self.log(f"{node} killed")
        self.endpoints.pop(node.endpoint, None)
        for post in node.posts.values():  # a dead process's writes stop with it (a running copy lands)
            post.settled = True

    # -- actions -------------------------------------------------------------------------

    def _run_actions(self, node: SimNode) -> None:
        for action in node.core.actions():
            self._act(node, action)
        self._arm_timer(node)

    def _act(self, node: SimNode, a: act.Action) -> None:
        if isinstance(a, act.Send):
            if not isinstance(a.msg, Message):
                raise TypeError(f"the simulator runs asynckv's own wire, not {type(a.msg).__name__}")
            self._send(node, a.endpoint, a.msg)
        elif isinstance(a, act.Post):
            self._post(node, a)
        elif isinstance(a, act.CancelPosts):
            for post_id in a.post_ids:
                post = node.posts.get(post_id)
                if post is not None:
                    self._cancel(post, a.reason)
        elif isinstance(a, act.SetLease):
            node.leases[a.peer] = a.until
        elif isinstance(a, act.ConnectPeer):
            ok = not (self.faults_on and self.rng.random() < self.mix.connect_fail)
            self.on(node, self.now + self.rng.uniform(*self.mix.connect_ms) / 1000, self._connected, node, a.peer, ok)
        elif isinstance(a, act.DisconnectPeer):
            node.connected.discard(a.peer)
            node.leases.pop(a.peer, None)
            for post in list(node.posts.values()):
                if post.action.peer == a.peer:
                    self._cancel(post, PeerUnreachable("peer forgotten"))
        elif isinstance(a, act.FetchTopology):
            self.on(node, self.now + self.rng.uniform(*self.mix.route_ms) / 1000, self._topology, node, a.addr)
        elif isinstance(a, act.Closed):
            node.closed = True
        self.log(f"{node} {type(a).__name__} {_short(a)}")
        if self.record is not None:
            self.record.append((self.now, node.name, a))
        self.on_action(node, a)

    def _arm_timer(self, node: SimNode) -> None:
        when = node.core.get_timer()
        if when is None or (node.timer_at is not None and node.timer_at <= when):
            if when is None:
                node.timer_at = None
            return
        node.timer_seq += 1
        node.timer_at = when
        self.on(node, max(when, self.now), self._timer, node, node.timer_seq)

    def _timer(self, node: SimNode, seq: int) -> None:
        if seq != node.timer_seq:
            return
        node.timer_at = None
        self.drive(node, "handle_timer")

    # -- network -------------------------------------------------------------------------

    def _send(self, node: SimNode, endpoint: str, msg: Message) -> None:
        mix = self.mix
        rng = self.rng
        if self.faults_on and rng.random() < mix.loss:
            self.log(f"lost {type(msg).__name__} {node} -> {endpoint}")
            return
        delay = rng.uniform(*mix.delay_ms) / 1000
        if self.faults_on and rng.random() < mix.spike:
            delay += rng.uniform(0.1, 0.8)
        if self.hold is not None:
            extra = self.hold(node, endpoint, msg)
            if extra is None:
                self.log(f"dropped {type(msg).__name__} {node} -> {endpoint}")
                return
            delay += extra
        key = (node.endpoint, endpoint)
        when = max(self._fifo.get(key, 0.0), self.now + delay)  # one socket: in order
        self._fifo[key] = when
        copies = 2 if self.faults_on and rng.random() < mix.dup else 1
        for _ in range(copies):
            self.at(when, self._deliver, endpoint, msg)

    def _deliver(self, endpoint: str, msg: Message) -> None:
        node = self.endpoints.get(endpoint)
        if node is None or node.closed:
            return
        self._in_node(node, self.drive, (node, "receive", msg))

    # -- data plane ----------------------------------------------------------------------

    def _instance(self, addr: str) -> PrefillInstance | None:
        """The topology the bootstrap server at ``addr`` answers now (None: not every rank is up)."""
        ranks = self.registry.get(addr, {})
        group = int(addr[1:].split(":")[0])
        tp = len(self.prefill[group]) if group < len(self.prefill) else 0
        if len(ranks) < tp or tp == 0:
            return None
        return PrefillInstance(tp_size=tp, pp_size=1, dp_size=1, page_size=1, kv_dtype="bfloat16", is_mla=False,
                               protocol_version=PROTOCOL_VERSION,
                               ranks={(0, r, 0): info for r, info in sorted(ranks.items())})

    def _topology(self, node: SimNode, addr: str) -> None:
        instance = self._instance(addr)
        self.drive(node, "topology_fetched", addr, instance or PeerUnreachable(f"bootstrap server {addr}: not ready"))

    def look_up(self, node: SimNode, addr: str, connect: bool = False) -> None:
        """``prefill_instance(addr, connect=...)`` answered at once: the topology (unless known; one not
        ready is the caller's error there, the core hears nothing), then with ``connect`` preconnect."""
        if not node.alive:
            return
        instance = None if addr in node.core.instances else self._instance(addr)
        if instance is not None:
            self.drive(node, "topology_fetched", addr, instance)
        if connect:
            self.drive(node, "preconnect", addr)  # (no registration while the topology is unknown)

    # -- invariants ----------------------------------------------------------------------

    def check_empty(self, node: SimNode) -> None:
        """I4: nothing left in a closed core's tables."""
        counts = node.core.room_counts()
        leftovers = {k: v for k, v in counts.items() if v}
        if leftovers or len(node.core.liveness) or node.posts or not node.closed:
            self.violation(f"I4: {node} after close: tables {leftovers}, peers {len(node.core.liveness)}, "
                           f"posts {len(node.posts)}, closed {node.closed}")


def _short(a: act.Action) -> str:
    if isinstance(a, act.Send):
        m = a.msg
        fields = {k: getattr(m, k) for k in ("room", "epoch", "session", "ok", "seq") if hasattr(m, k)}
        reason = getattr(m, "reason", "")
        return f"{type(m).__name__} -> {a.endpoint} {fields}{' ' + repr(reason[:60]) if reason else ''}"
    if isinstance(a, act.Post):
        return f"#{a.post_id} {a.kind} room {a.room}#{a.epoch} -> {a.peer} dst {np.asarray(a.dst).tolist()}"
    if isinstance(a, (act.Finished, act.RoomReady, act.InitDone, act.ChunkPosted)):
        room = a.room
        extra = f" {room.reason!r}" if room.exception is not None else ""
        return f"room {room.room} {room.state.name}{extra}"
    if isinstance(a, act.PeerDown):
        return f"{a.peer} {a.error}"
    if isinstance(a, act.CancelPosts):
        return f"{list(a.post_ids)}"
    return ""


def is_receiver(room: SenderRoom | ReceiverRoom) -> bool:
    return isinstance(room, ReceiverRoom)


def fenced(room: ReceiverRoom) -> bool:
    return room.state is ReceiverState.FAILED
