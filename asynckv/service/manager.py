"""KVManager: one rank's agent, control socket, rooms and (optionally) bootstrap server.

Everything runs on the event loop that entered the manager, except NIXL calls (on the
engine thread) and large descriptor math (on a worker thread).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import enum
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt
import zmq.asyncio

from ..config import Config
from ..errors import (
    AsyncKVError,
    ClosedError,
    InvalidArgument,
    LayoutMismatch,
    LocalProtocolError,
    PeerRestarted,
    PeerUnreachable,
    RemoteProtocolError,
)
from ..kernels import (
    aux_descriptors,
    block_descriptors,
    head_slice_descriptors,
    kv_page_descriptors,
    prepped_indices,
)
from ..layout import KVArgs
from ..proto.auth import Authenticator
from ..proto.bootstrap import PrefillRank
from ..proto.messages import (
    MAX_ROOM,
    Abort,
    Bye,
    Message,
    Ping,
    Pong,
    Register,
    RegisterResult,
    Status,
    TransferInfo,
    VersionMismatch,
)
from ..proto.peers import Liveness, PeerState
from ..proto.states import KVPoll
from ..proto.topology import PeerPlan, PrefillInstance, TargetPlan, check_compatible, plan_peer, plan_targets
from ..transport.control import ControlChannel
from ..transport.engine import NixlEngine
from . import metrics
from .bootstrap import BootstrapClient, BootstrapServer, OpsServer, split_addr
from .receiver import KVReceiver
from .sender import KVSender

__all__ = ["KVManager", "Mode"]

log = logging.getLogger("asynckv.manager")

SCRATCH_BYTES = 4096


class Mode(enum.Enum):
    """Which side of the transfer a manager serves."""

    PREFILL = "prefill"
    DECODE = "decode"


@dataclasses.dataclass(slots=True)
class DecodePeer:
    """Prefill's view of one registered decode rank."""

    reg: Register
    plan: PeerPlan
    num_pages: int
    num_aux_rows: int
    num_state_slots: int
    kv_ptrs: npt.NDArray[np.uint64]
    kv_item_lens: npt.NDArray[np.uint64]
    aux_ptrs: npt.NDArray[np.uint64]
    state_ptrs: npt.NDArray[np.uint64]
    state_item_lens: npt.NDArray[np.uint64]
    remote_dlist: Any = None

    @property
    def dev(self) -> int:
        return self.reg.gpu_id if self.reg.mem_kind == "VRAM" else 0

    @property
    def name(self) -> str:
        return self.reg.decode_id

    @property
    def endpoint(self) -> str:
        return self.reg.endpoint


@dataclasses.dataclass(slots=True)
class _EarlyRoom:
    """Prefill: control messages for a room whose sender does not exist yet."""

    deadline: float
    infos: dict[str, TransferInfo] = dataclasses.field(default_factory=dict)
    aborted: tuple[str, str] | None = None
    """(decode_id, reason) of an abort that came before the sender."""


class KVManager:
    """One rank of a prefill or decode instance. Use as ``async with KVManager(...) as mgr``."""

    def __init__(self, mode: Mode, kv_args: KVArgs, *, bootstrap_addr: str | None = None,
                 config: Config | None = None) -> None:
        if not isinstance(mode, Mode):
            raise InvalidArgument(f"mode must be a Mode, got {mode!r}")
        if mode is Mode.PREFILL and bootstrap_addr is None:
            raise InvalidArgument("a PREFILL manager needs bootstrap_addr (host:port)")
        if bootstrap_addr is not None:
            split_addr(bootstrap_addr)
        self.mode = mode
        self.kv_args = kv_args
        self.config = config if config is not None else Config.from_env()
        self.bootstrap_addr = bootstrap_addr
        self.name = str(uuid.uuid4())
        self.stats: collections.Counter[str] = collections.Counter()
        self.bootstrap_server: BootstrapServer | None = None
        self.ops_server: OpsServer | None = None

        self._loop: asyncio.AbstractEventLoop | None = None
        # A decode target must keep progressing while prefill may write into it (an unpolled
        # target stalls its initiators); with no room waiting it can sleep longer.
        self._engine = NixlEngine(self.name, backend=self.config.nixl_backend, idle_poll_s=self.config.idle_poll_s,
                                  expecting=(lambda: bool(self._receivers)) if mode is Mode.DECODE else (lambda: False))
        self._ctx: zmq.asyncio.Context | None = None
        self._control: ControlChannel | None = None
        self._http = BootstrapClient(self.config.http_timeout_s, self.config.auth_token)
        self._scratch = np.zeros(SCRATCH_BYTES, dtype=np.uint8)
        self._reg_handles: list[Any] = []
        self._local_dlist: Any = None
        self._agent_metadata = b""
        self._tasks: set[asyncio.Task[Any]] = set()
        self._started = False
        self._closed = False
        self._my_rank: PrefillRank | None = None
        # prefill
        self._senders: dict[int, KVSender] = {}
        self._peers: dict[str, DecodePeer] = {}
        self._peer_setup: dict[str, asyncio.Future[DecodePeer]] = {}
        self._early: collections.OrderedDict[int, _EarlyRoom] = collections.OrderedDict()
        self._inflight_bytes = 0
        self._inflight_waiters: list[asyncio.Future[None]] = []
        # decode
        self._receivers: dict[int, KVReceiver] = {}
        self._instances: dict[str, PrefillInstance] = {}
        self._instance_locks: dict[str, asyncio.Lock] = {}
        self._registrations: dict[str, asyncio.Future[None]] = {}
        self._rank_addr: dict[str, str] = {}
        self._plans: dict[tuple[str, int], tuple[PrefillInstance, TargetPlan]] = {}
        # both: heartbeats to every peer we work with (decode ranks, or prefill ranks)
        self._liveness = Liveness(self.config.heartbeat_interval_s, self.config.heartbeat_max_failures)

        kv_ptrs, _, kv_items = kv_args.kv_arrays()
        self._kv_ptrs = kv_ptrs
        self._kv_items = kv_items
        self._aux_ptrs = np.asarray(kv_args.aux_data_ptrs, dtype=np.uint64)
        self._aux_items = np.asarray(kv_args.aux_item_lens, dtype=np.uint64)
        self.page_bytes = int(kv_items.sum())
        """Bytes one page index moves across all KV entries."""

    # -- lifecycle -----------------------------------------------------------------

    async def __aenter__(self) -> KVManager:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def endpoint(self) -> str:
        """This rank's control endpoint (``tcp://host:port``)."""
        return self._control.endpoint if self._control is not None else ""

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise ClosedError("KVManager is not started")
        return self._loop

    @property
    def healthy(self) -> bool:
        """Reader task, engine thread and (prefill) bootstrap registration are all alive."""
        return (self._started and not self._closed and self._engine.alive
                and self._control is not None and self._control.reader_alive)

    async def start(self) -> None:
        if self._started:
            raise LocalProtocolError("KVManager already started")
        self._started = True
        self._loop = asyncio.get_running_loop()
        try:
            await self._engine.start()
            await self._engine.call(self._register_memory)
            self._agent_metadata = bytes(await self._engine.call(lambda agent: agent.get_agent_metadata()))
            self._ctx = zmq.asyncio.Context()
            auth = Authenticator(self.config.auth_token) if self.config.auth_token else None
            self._control = ControlChannel(self._ctx, self.config.host, self._on_message,
                                           self._on_version_mismatch, self.config.send_timeout_s, auth)
            await self._control.start()
            if self.mode is Mode.PREFILL:
                await self._start_prefill()
            self._spawn(self._heartbeat_loop(), "asynckv-heartbeat")
            metrics.register_manager(self)
            if self.config.ops_port >= 0:
                self.ops_server = await OpsServer(self.config.host, self.config.ops_port, lambda: self.healthy).start()
        except BaseException:
            await self.close()
            raise
        log.info("%s manager %s ready at %s", self.mode.value, self.name[:8], self.endpoint)

    async def close(self) -> None:
        """Fail every unfinished room, stop tasks, release NIXL state, deregister memory."""
        if self._closed:
            return
        self._closed = True
        for room in list(self._senders.values()):
            room._fail(ClosedError("manager closed"))
        for recv in list(self._receivers.values()):
            recv._fail(ClosedError("manager closed"))
        await self._say_goodbye()
        for task in list(self._tasks):
            task.cancel()
        self._wake_inflight_waiters()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._my_rank is not None and self.bootstrap_addr is not None:
            await self._http.unregister(self.bootstrap_addr, self._my_rank)
        await self._http.close()
        if self._control is not None:
            await self._control.close()
        if self._ctx is not None:
            self._ctx.term()
        await self._engine.close(self._cleanup_agent)
        if self.bootstrap_server is not None:
            await self.bootstrap_server.close()
        if self.ops_server is not None:
            await self.ops_server.close()
        metrics.forget_manager(self)
        self._senders.clear()
        self._receivers.clear()
        self._peers.clear()
        self._early.clear()

    async def _say_goodbye(self) -> None:
        if self._control is None or not len(self._liveness):
            return
        peers = [p for p in (self._liveness.get(i) for i in list(self._peers) + list(self._rank_addr)) if p]
        await asyncio.gather(*(self._reply(p.endpoint, Bye(self.name, "manager closed")) for p in peers))

    def _register_memory(self, agent: Any) -> None:
        a = self.kv_args
        kv = [(int(p), int(n), self._dev, "") for p, n in zip(
            [*a.kv_data_ptrs, *a.state_data_ptrs], [*a.kv_data_lens, *a.state_data_lens], strict=True)]
        self._reg_handles.append(agent.register_memory(kv, a.mem_kind))
        dram = [(int(p), int(n), 0, "") for p, n in zip(a.aux_data_ptrs, a.aux_data_lens, strict=True)]
        dram.append((int(self._scratch.ctypes.data), SCRATCH_BYTES, 0, ""))
        self._reg_handles.append(agent.register_memory(dram, "DRAM"))
        if self.mode is Mode.PREFILL and self.config.prepped_dlists:
            self._local_dlist = agent.prep_xfer_dlist("", self._dlist_rows(
                self._kv_ptrs, self._kv_items, self._kv_items, a.num_pages, self._dev), a.mem_kind)

    @property
    def _dev(self) -> int:
        return self.kv_args.gpu_id if self.kv_args.mem_kind == "VRAM" else 0

    @staticmethod
    def _dlist_rows(ptrs: npt.NDArray[np.uint64], strides: npt.NDArray[np.uint64],
                    lengths: npt.NDArray[np.uint64], num_pages: int, dev: int) -> npt.NDArray[np.uint64]:
        """One row per (entry, page), entry-major, as ``prepped_indices`` addresses them."""
        pages = np.arange(num_pages, dtype=np.uint64)
        rows = np.empty((len(ptrs) * num_pages, 3), dtype=np.uint64)
        rows[:, 0] = (ptrs[:, None] + strides[:, None] * pages[None, :]).ravel()
        rows[:, 1] = np.repeat(lengths, num_pages)
        rows[:, 2] = dev
        return rows

    def _cleanup_agent(self, agent: Any) -> None:
        """Engine thread: release dlists, drop peers, deregister memory (in that order)."""
        for peer in self._peers.values():
            if peer.remote_dlist is not None:
                agent.release_dlist_handle(peer.remote_dlist)
            try:
                agent.remove_remote_agent(peer.name)
            except Exception:
                log.debug("remove_remote_agent(%s) failed", peer.name, exc_info=True)
        if self._local_dlist is not None:
            agent.release_dlist_handle(self._local_dlist)
            self._local_dlist = None
        for handle in self._reg_handles:
            agent.deregister_memory(handle)
        self._reg_handles.clear()

    def _spawn(self, coro: Any, name: str) -> asyncio.Task[Any]:
        task = self.loop.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("task %s failed", task.get_name(), exc_info=task.exception())

    # -- liveness --------------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        """Ping every peer each interval; declare dead the ones unheard for too long."""
        while True:
            await asyncio.sleep(self.config.heartbeat_interval_s)
            now = time.monotonic()
            for state in self._liveness.expired(now):
                self._peer_dead(state, PeerUnreachable(
                    f"peer {state.peer_id[:8]} at {state.endpoint} unheard for {now - state.last_seen:.1f}s "
                    f"(heartbeat every {self.config.heartbeat_interval_s:g}s, "
                    f"{self.config.heartbeat_max_failures} misses allowed)"))
            for _peer_id, endpoint, seq in self._liveness.pings_due(now):
                self.send_soon(endpoint, Ping(self.name, self.endpoint, seq))

    def _on_pong(self, msg: Pong) -> None:
        now = time.monotonic()
        if msg.sender_id in self._liveness:
            self._liveness.on_pong(msg.sender_id, msg.seq, now)
            return
        self._drop("stale", f"pong from untracked {msg.sender_id[:8]}")

    def liveness(self, peer_id: str) -> PeerState | None:
        """Heartbeat and lease state of a peer this manager works with."""
        return self._liveness.get(peer_id)

    def declare_dead(self, peer_id: str, exc: BaseException, farewell: bool = False) -> None:
        """Treat a peer as dead now: fail exactly the rooms that involve it, forget it.
        ``farewell``: the peer said goodbye itself (a normal shutdown, not worth a warning)."""
        state = self._liveness.remove(peer_id)
        if state is None:
            state = PeerState(peer_id, "", 0.0, 0.0)
        self._peer_dead(state, exc, farewell)

    def _peer_dead(self, state: PeerState, exc: BaseException, farewell: bool = False) -> None:
        log.log(logging.INFO if farewell else logging.WARNING, "%s: %s", self.mode.value, exc)
        self.stats["peers_dead"] += 1
        metrics.PEERS_DEAD.labels(self.mode.value, self.name[:8], type(exc).__name__).inc()
        metrics.forget_peer(self, state.peer_id)
        if state.endpoint and not self._closed and not farewell:  # if it is alive after all, it must forget us too
            self.send_soon(state.endpoint, Bye(self.name, f"declared dead: {exc}"))
        if self.mode is Mode.PREFILL:
            self._engine.cancel_peer(state.peer_id, exc)
            peer = self._peers.pop(state.peer_id, None)
            for sender in list(self._senders.values()):
                sender._on_peer_dead(state.peer_id, exc)
            if peer is not None:
                self._spawn(self._engine.call(self._drop_peer_agent, peer), "asynckv-remove-peer")
                if self._control is not None:
                    self._control.forget(peer.endpoint)
        else:
            addr = self._rank_addr.pop(state.peer_id, None)
            self._registrations.pop(state.peer_id, None)
            if addr is not None:  # a new incarnation behind that address will be looked up afresh
                self._instances.pop(addr, None)
            for recv in list(self._receivers.values()):
                recv._on_peer_dead(state.peer_id, exc)
            if self._control is not None and state.endpoint:
                self._control.forget(state.endpoint)

    @staticmethod
    def _drop_peer_agent(agent: Any, peer: DecodePeer) -> None:
        if peer.remote_dlist is not None:
            agent.release_dlist_handle(peer.remote_dlist)
            peer.remote_dlist = None
        try:
            agent.remove_remote_agent(peer.name)
        except Exception:
            log.debug("remove_remote_agent(%s) failed", peer.name, exc_info=True)

    # -- prefill ---------------------------------------------------------------------

    async def _start_prefill(self) -> None:
        addr = self.bootstrap_addr
        if addr is None:
            raise InvalidArgument("a PREFILL manager needs bootstrap_addr")
        host, port = split_addr(addr)
        # Port 0 asks for an embedded server on a free port (tests, single-instance demos).
        if port == 0 or (self.config.host_bootstrap and not await self._http.is_up(addr)):
            server = BootstrapServer(host, port, self.config.auth_token)
            try:
                await server.start()
            except OSError as exc:  # another rank of this instance won the race
                log.debug("embedded bootstrap server not started: %s", exc)
            else:
                self.bootstrap_server = server
                self.bootstrap_addr = addr = server.addr
                server.add_health_check(f"manager-{self.name[:8]}", lambda: self.healthy)
        a = self.kv_args
        self._my_rank = PrefillRank(
            tp_size=a.tp_size, tp_rank=a.engine_rank, pp_size=a.pp_size, pp_rank=a.pp_rank,
            dp_size=a.dp_size, dp_rank=a.dp_rank, endpoint=self.endpoint, agent_id=self.name,
            page_size=a.page_size, kv_dtype=a.kv_dtype, is_mla=a.is_mla)
        await self._http.register(addr, self._my_rank, self.config.register_attempts)

    @property
    def sender_rank(self) -> int:
        """Unique rank of this prefill sender within its instance (counted by decode)."""
        a = self.kv_args
        return (a.dp_rank * a.tp_size + a.engine_rank) * a.pp_size + a.pp_rank

    def sender(self, room: int) -> KVSender:
        """Create the sender of ``room`` (prefill only)."""
        self._check_open(Mode.PREFILL)
        self._check_room(room, self._senders)
        sender = KVSender(self, room)
        self._senders[room] = sender
        early = self._early.pop(room, None)
        if early is not None:
            if early.aborted is not None:
                sender._on_abort(*early.aborted)
            for info in early.infos.values():
                sender._on_destination(info)
        return sender

    def _check_open(self, mode: Mode) -> None:
        if self.mode is not mode:
            raise LocalProtocolError(f"this is a {self.mode.value} manager")
        if not self._started or self._closed:
            raise ClosedError("KVManager is not running (use `async with`)")

    def _check_room(self, room: int, table: dict[int, Any]) -> None:
        if type(room) is not int or not 0 <= room <= MAX_ROOM:
            raise InvalidArgument(f"room must be an int in [0, 2**63), got {room!r}")
        if room in table:
            raise LocalProtocolError(f"room {room} already exists on this manager (clear() it first)")
        if len(table) >= self.config.max_rooms:
            raise InvalidArgument(f"too many rooms ({len(table)}); raise Config.max_rooms or clear() rooms")

    def _forget_sender(self, room: int) -> None:
        self._senders.pop(room, None)

    def _on_message(self, msg: Message) -> None:
        self.stats[f"msg_{type(msg).__name__}"] += 1
        if isinstance(msg, Ping):
            self._liveness.heard(msg.sender_id, time.monotonic())
            self.send_soon(msg.endpoint, Pong(self.name, msg.seq))
            return
        if isinstance(msg, Pong):
            self._on_pong(msg)
            return
        if isinstance(msg, Bye):
            if msg.sender_id in self._liveness:
                self.declare_dead(msg.sender_id, PeerUnreachable(f"peer {msg.sender_id[:8]} closed: {msg.reason}"),
                                  farewell=True)
            return
        if self.mode is Mode.PREFILL:
            if isinstance(msg, Register):
                self._on_register(msg)
            elif isinstance(msg, TransferInfo):
                self._on_transfer_info(msg)
            elif isinstance(msg, Abort):
                self._on_abort(msg)
            else:
                self._drop("unexpected", f"prefill got {type(msg).__name__}")
        else:
            if isinstance(msg, RegisterResult):
                self._on_register_result(msg)
            elif isinstance(msg, Status):
                self._on_status(msg)
            else:
                self._drop("unexpected", f"decode got {type(msg).__name__}")

    def _drop(self, reason: str, detail: str) -> None:
        self.stats[f"dropped_{reason}"] += 1
        log.debug("dropped control message (%s): %s", reason, detail)

    def _on_version_mismatch(self, exc: VersionMismatch) -> None:
        body = exc.body or {}
        endpoint, decode_id = body.get("endpoint"), body.get("decode_id")
        if self.mode is Mode.PREFILL and exc.msg_type == Register.TYPE and isinstance(endpoint, str) \
                and isinstance(decode_id, str) and endpoint.startswith("tcp://"):
            self.send_soon(endpoint, RegisterResult(self.name, decode_id, False, str(exc)))

    def send_soon(self, endpoint: str, msg: Message) -> None:
        """Send without waiting: queued at once in the common case, else by a task (bounded)."""
        if self._control is None or self._closed:
            return
        if not self._control.try_send(endpoint, msg):
            self._spawn(self._reply(endpoint, msg), f"asynckv-send-{type(msg).__name__}")

    async def _reply(self, endpoint: str, msg: Message) -> None:
        if self._control is None:
            return
        try:
            await self._control.send(endpoint, msg)
        except AsyncKVError as exc:
            log.warning("could not send %s to %s: %s", type(msg).__name__, endpoint, exc)

    def _on_register(self, reg: Register) -> None:
        if reg.prefill_id != self.name:
            reason = (f"prefill restarted: decode expected incarnation {reg.prefill_id[:8]}, "
                      f"this is {self.name[:8]}")
            self.send_soon(reg.endpoint, RegisterResult(reg.prefill_id, reg.decode_id, False, reason))
            return
        if reg.decode_id not in self._peers and len(self._peers) + len(self._peer_setup) >= self.config.max_peers:
            reason = f"too many decode peers ({self.config.max_peers})"
            self.send_soon(reg.endpoint, RegisterResult(self.name, reg.decode_id, False, reason))
            return
        if reg.decode_id in self._peers:
            self.send_soon(reg.endpoint, RegisterResult(self.name, reg.decode_id, True, ""))
            return
        if reg.decode_id in self._peer_setup:
            return  # the setup in progress will answer
        fut: asyncio.Future[DecodePeer] = self.loop.create_future()
        self._peer_setup[reg.decode_id] = fut
        self._spawn(self._add_peer(reg, fut), f"asynckv-add-peer-{reg.decode_id[:8]}")

    async def _add_peer(self, reg: Register, fut: asyncio.Future[DecodePeer]) -> None:
        started = time.monotonic()
        try:
            plan = plan_peer(self.kv_args, reg)
            peer = DecodePeer(
                reg=reg, plan=plan,
                num_pages=min(n // i for n, i in zip(reg.kv_lens, reg.kv_item_lens, strict=True)),
                num_aux_rows=min((n // i for n, i in zip(reg.aux_lens, reg.aux_item_lens, strict=True)),
                                 default=0),
                num_state_slots=min((n // i for n, i in zip(reg.state_lens, reg.state_item_lens, strict=True)),
                                    default=0),
                kv_ptrs=np.asarray(reg.kv_ptrs, dtype=np.uint64),
                kv_item_lens=np.asarray(reg.kv_item_lens, dtype=np.uint64),
                aux_ptrs=np.asarray(reg.aux_ptrs, dtype=np.uint64),
                state_ptrs=np.asarray(reg.state_ptrs, dtype=np.uint64),
                state_item_lens=np.asarray(reg.state_item_lens, dtype=np.uint64))
            rows = None
            if self._prepped_for(peer):
                dst = plan.dst_entries  # paired with local entries 0..n-1 in order
                # One row per (entry, page): millions for a large pool, so not on the event loop.
                rows = await asyncio.to_thread(self._dlist_rows, peer.kv_ptrs[dst], peer.kv_item_lens[dst],
                                               self._kv_items, peer.num_pages, peer.dev)
            peer.remote_dlist = await self._engine.call(self._connect_peer, reg, rows)
            await self._warm_up(peer)
        except Exception as exc:  # any failure refuses this peer; it never kills the manager
            if not isinstance(exc, AsyncKVError):
                log.exception("setting up decode peer %s failed", reg.decode_id[:8])
            self._peer_setup.pop(reg.decode_id, None)
            fut.set_exception(exc)
            fut.exception()  # retrieved: the refusal is reported to decode below
            self.stats["peers_refused"] += 1
            log.warning("refused decode peer %s at %s: %s", reg.decode_id[:8], reg.endpoint, exc)
            await self._reply(reg.endpoint, RegisterResult(self.name, reg.decode_id, False, str(exc)))
            return
        self._peer_setup.pop(reg.decode_id, None)
        self._peers[reg.decode_id] = peer
        self._liveness.add(reg.decode_id, reg.endpoint, time.monotonic())
        metrics.FIRST_CONTACT_SECONDS.labels(self.mode.value, self.name[:8], reg.decode_id[:8]).observe(
            time.monotonic() - started)
        fut.set_result(peer)
        self.stats["peers_added"] += 1
        await self._reply(reg.endpoint, RegisterResult(self.name, reg.decode_id, True, ""))

    def _connect_peer(self, agent: Any, reg: Register, rows: npt.NDArray[np.uint64] | None) -> Any:
        """Engine thread: import the peer's metadata and prepare its destination dlist."""
        name = agent.add_remote_agent(reg.agent_metadata)
        name = name.decode() if isinstance(name, bytes) else str(name)
        if name != reg.decode_id:
            agent.remove_remote_agent(name)
            raise RemoteProtocolError(f"agent metadata names {name!r}, registration says {reg.decode_id!r}")
        if rows is None:
            return None
        return agent.prep_xfer_dlist(name, rows, reg.mem_kind)

    async def _warm_up(self, peer: DecodePeer) -> None:
        """A tiny WRITE into the peer's scratch area absorbs connection wire-up (15-40 ms)."""
        n = min(64, peer.reg.scratch_len, SCRATCH_BYTES)
        src = np.array([[self._scratch.ctypes.data, n, 0]], dtype=np.uint64)
        dst = np.array([[peer.reg.scratch_ptr, n, 0]], dtype=np.uint64)

        def build(agent: Any) -> list[Any]:
            return [agent.initialize_xfer("WRITE", agent.get_xfer_descs(src, "DRAM"),
                                          agent.get_xfer_descs(dst, "DRAM"), peer.name)]

        await self._engine.post(build, timeout_s=self.config.handshake_timeout_s, what="warm-up")

    def _on_transfer_info(self, info: TransferInfo) -> None:
        if info.prefill_id != self.name:
            self._drop("stale_incarnation", f"room {info.room} meant for {info.prefill_id[:8]}")
            return
        sender = self._senders.get(info.room)
        if sender is not None:
            sender._on_destination(info)
            return
        early = self._early.get(info.room) or self._new_early(info.room)
        if early is not None:
            early.infos[info.decode_id] = info

    def _new_early(self, room: int) -> _EarlyRoom | None:
        """A bounded, expiring record for a room whose sender does not exist yet."""
        self._expire_early()
        if len(self._early) >= self.config.max_early_infos:
            self._drop("early_full", f"room {room}: too many rooms without a sender")
            return None
        early = _EarlyRoom(self.loop.time() + self.config.early_info_ttl_s)
        self._early[room] = early
        return early

    def _on_abort(self, msg: Abort) -> None:
        """Fail the room; decode learns that nothing more will be written from a Status
        (sent by the sender once its in-flight writes settled, or at once if it has none)."""
        sender = self._senders.get(msg.room)
        if sender is not None:
            sender._on_abort(msg.decode_id, msg.reason)
            return
        early = self._early.get(msg.room) or self._new_early(msg.room)
        if early is not None:  # a sender created later fails at once instead of waiting for its timeout
            early.aborted = (msg.decode_id, msg.reason)
        peer = self._peers.get(msg.decode_id)
        if peer is not None:  # nothing of this room is in flight here
            self.send_status(peer.endpoint, msg.room, False, f"aborted by decode: {msg.reason}")

    def _expire_early(self) -> None:
        now = self.loop.time()
        while self._early:
            room, early = next(iter(self._early.items()))
            if early.deadline > now:
                break
            del self._early[room]
            self.stats["early_expired"] += 1

    def peer(self, decode_id: str) -> DecodePeer | None:
        return self._peers.get(decode_id)

    # data plane entry points used by KVSender

    def build_kv(self, peer: DecodePeer, src_pages: npt.NDArray[np.int64],
                 dst_pages: npt.NDArray[np.int64]) -> tuple[Callable[[Any], list[Any]], int]:
        """Descriptor math for one chunk to one peer (pure numpy; safe on a worker thread).

        Returns the function the engine thread runs to create the chunk's handles (at most
        ``max_descs_per_xfer`` rows each, so huge requests have several handles in flight)
        and the number of descriptors (prepared indices) it posts.
        """
        limit = self.config.max_descs_per_xfer
        if self._prepped_for(peer):
            src_idx = prepped_indices(src_pages, self.kv_args.num_pages, self.kv_args.num_entries)
            dst_idx = prepped_indices(dst_pages, peer.num_pages, self.kv_args.num_entries)
            local, remote = self._local_dlist, peer.remote_dlist

            def build_prepped(agent: Any) -> list[Any]:
                return [agent.make_prepped_xfer("WRITE", local, src_idx[i:i + limit], remote, dst_idx[i:i + limit])
                        for i in range(0, len(src_idx), limit)]

            return build_prepped, len(src_idx)
        plan = peer.plan
        args = (self._kv_ptrs[plan.src_entries], peer.kv_ptrs[plan.dst_entries],
                self._kv_items[plan.src_entries], peer.kv_item_lens[plan.dst_entries])
        if plan.head_slice is None:
            src, dst = kv_page_descriptors(*args, src_pages, dst_pages, self._dev, peer.dev)
        else:
            hs = plan.head_slice
            src, dst = head_slice_descriptors(*args, self.kv_args.page_size, src_pages, dst_pages,
                                              hs.src_offs, hs.dst_offs, hs.nbytes, self._dev, peer.dev)
        return self._build_descs(peer, src, dst), len(src)

    def _build_descs(self, peer: DecodePeer, src: npt.NDArray[np.uint64],
                     dst: npt.NDArray[np.uint64]) -> Callable[[Any], list[Any]]:
        """KV and state entries live in each side's KV memory kind (aux has its own path)."""
        limit = self.config.max_descs_per_xfer
        kind, remote_kind = self.kv_args.mem_kind, peer.reg.mem_kind

        def build_descs(agent: Any) -> list[Any]:
            return [agent.initialize_xfer("WRITE", agent.get_xfer_descs(src[i:i + limit], kind),
                                          agent.get_xfer_descs(dst[i:i + limit], remote_kind), peer.name)
                    for i in range(0, len(src), limit)]

        return build_descs

    def _prepped_for(self, peer: DecodePeer) -> bool:
        return self.config.prepped_dlists and peer.plan.whole_pages

    def build_state(self, peer: DecodePeer, src_idx: npt.NDArray[np.int64],
                    dst_idx: npt.NDArray[np.int64]) -> tuple[Callable[[Any], list[Any]], int, int] | None:
        """Descriptors of a room's hybrid state (last chunk); None when nothing to write."""
        plan = peer.plan.state
        if plan is None or len(src_idx) == 0:
            return None
        a = self.kv_args
        sp = np.asarray(a.state_data_ptrs, dtype=np.uint64)[plan.src_entries]
        si = np.asarray(a.state_item_lens, dtype=np.uint64)[plan.src_entries]
        dp, di = peer.state_ptrs[plan.dst_entries], peer.state_item_lens[plan.dst_entries]
        if plan.kind == "blocks" and plan.blocks is not None:
            src, dst = block_descriptors(sp, dp, si, di, int(src_idx[0]), int(dst_idx[0]), *plan.blocks,
                                         self._dev, peer.dev)
        elif plan.kind == "head_slice" and plan.head_slice is not None:
            hs = plan.head_slice
            src, dst = head_slice_descriptors(sp, dp, si, di, a.page_size, src_idx, dst_idx, hs.src_offs,
                                              hs.dst_offs, hs.nbytes, self._dev, peer.dev)
        else:  # whole items: mamba slots or swa/nsa pages
            src, dst = kv_page_descriptors(sp, dp, si, di, src_idx, dst_idx, self._dev, peer.dev)
        if len(src) == 0:
            return None
        return self._build_descs(peer, src, dst), int(src[:, 1].sum()), len(src)

    async def post(self, peer: DecodePeer, build: Callable[[Any], list[Any]], nbytes: int, what: str,
                   kind: str = "kv", ndescs: int = 1) -> asyncio.Future[Any]:
        """Hand handles to the engine once in-flight bytes allow; the returned future resolves
        when all landed. Posts only while the peer's write lease is valid."""
        while not (self._closed or self._inflight_bytes == 0
                   or self._inflight_bytes + nbytes <= self.config.max_inflight_bytes):
            waiter: asyncio.Future[None] = self.loop.create_future()
            self._inflight_waiters.append(waiter)
            await waiter
        if self._closed:
            raise ClosedError("manager closed")
        self._inflight_bytes += nbytes
        self.stats[f"{kind}_bytes"] += nbytes
        self.stats[f"{kind}_posts"] += 1
        lease = self._liveness.get(peer.name)
        fut = self._engine.post(build, timeout_s=self._deadline_for(nbytes), what=what, peer=peer.name,
                                may_write=None if lease is None else (lambda: time.monotonic() < lease.lease_until))
        labels = (self.mode.value, self.name[:8], peer.name[:8])
        metrics.DESCRIPTORS.labels(*labels).observe(ndescs)
        started = time.monotonic()
        fut.add_done_callback(lambda f: self._post_settled(f, peer, nbytes, kind, started))
        return fut

    def _post_settled(self, fut: asyncio.Future[Any], peer: DecodePeer, nbytes: int, kind: str,
                      started: float) -> None:
        self._inflight_bytes -= nbytes
        self._wake_inflight_waiters()
        exc = None if fut.cancelled() else fut.exception()
        labels = (self.mode.value, self.name[:8], peer.name[:8])
        if exc is None:
            metrics.TRANSFER_SECONDS.labels(*labels).observe(time.monotonic() - started)
            metrics.TRANSFER_BYTES.labels(*labels, kind).inc(nbytes)
            metrics.TRANSFERS.labels(*labels, kind).inc()
        else:
            metrics.TRANSFER_FAILURES.labels(*labels, type(exc).__name__).inc()
        if isinstance(exc, PeerUnreachable) and peer.name in self._peers:
            self.declare_dead(peer.name, exc)  # NIXL saw the disconnect: no need to wait for heartbeats

    def _wake_inflight_waiters(self) -> None:
        waiters, self._inflight_waiters = self._inflight_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def post_aux(self, peer: DecodePeer, src_row: int, dst_row: int, what: str) -> asyncio.Future[Any]:
        src, dst = aux_descriptors(self._aux_ptrs, peer.aux_ptrs, self._aux_items, src_row, dst_row)

        def build(agent: Any) -> list[Any]:
            return [agent.initialize_xfer("WRITE", agent.get_xfer_descs(src, "DRAM"),
                                          agent.get_xfer_descs(dst, "DRAM"), peer.name)]

        return await self.post(peer, build, int(self._aux_items.sum()), what, kind="aux", ndescs=len(src))

    def _deadline_for(self, nbytes: int) -> float:
        return self.config.xfer_deadline_base_s + nbytes / self.config.xfer_deadline_min_bytes_per_s

    def send_status(self, endpoint: str, room: int, ok: bool, reason: str) -> None:
        self.send_soon(endpoint, Status(room, self.name, self.sender_rank, ok, reason))

    # -- decode ---------------------------------------------------------------------

    def receiver(self, bootstrap_addr: str, room: int) -> KVReceiver:
        """Create the receiver of ``room``, served by the prefill at ``bootstrap_addr`` (decode only)."""
        self._check_open(Mode.DECODE)
        split_addr(bootstrap_addr)
        self._check_room(room, self._receivers)
        recv = KVReceiver(self, bootstrap_addr, room)
        self._receivers[room] = recv
        return recv

    def _forget_receiver(self, room: int) -> None:
        self._receivers.pop(room, None)

    async def prefill_instance(self, addr: str) -> PrefillInstance:
        """The topology of the prefill at ``addr``, fetched once and cached."""
        inst = self._instances.get(addr)
        if inst is not None and not self._stale(inst):
            return inst
        lock = self._instance_locks.setdefault(addr, asyncio.Lock())
        async with lock:
            inst = self._instances.get(addr)
            if inst is None or self._stale(inst):
                old = inst
                inst = await self._http.fetch_instance(addr, self.config.handshake_timeout_s)
                if old is not None:
                    self._retire_replaced(old, inst)
                a = self.kv_args
                check_compatible(inst, page_size=a.page_size, kv_dtype=a.kv_dtype, is_mla=a.is_mla)
                self._instances[addr] = inst
        return inst

    def target_plan(self, addr: str, instance: PrefillInstance, room: int) -> TargetPlan:
        """The rank mapping of a room: the same for every room of one DP group, so it is cached."""
        key = (addr, room % instance.dp_size)
        cached = self._plans.get(key)
        if cached is not None and cached[0] is instance:
            return cached[1]
        a = self.kv_args
        plan = plan_targets(instance, room=room, tp_size=a.tp_size, engine_rank=a.engine_rank, pp_size=a.pp_size,
                            pp_rank=a.pp_rank, is_mla=a.is_mla, total_kv_heads=a.total_kv_head_num)
        if len(self._plans) > 1024:
            self._plans.clear()
        self._plans[key] = (instance, plan)
        return plan

    def _stale(self, inst: PrefillInstance) -> bool:
        """A registered rank of the cached topology has been quiet for over 1.5 heartbeats: it may
        have restarted, so the next room looks the instance up again (cheap: one GET)."""
        now = time.monotonic()
        for rank in inst.ranks.values():
            state = self._liveness.get(rank.agent_id)
            if state is not None and now - state.last_seen > 1.5 * self.config.heartbeat_interval_s:
                return True
        return False

    def _retire_replaced(self, old: PrefillInstance, new: PrefillInstance) -> None:
        for key, rank in old.ranks.items():
            current = new.ranks.get(key)
            if current is not None and current.agent_id != rank.agent_id and rank.agent_id in self._liveness:
                self.declare_dead(rank.agent_id, PeerRestarted(
                    f"prefill rank dp={key[0]} tp={key[1]} pp={key[2]} restarted: incarnation "
                    f"{rank.agent_id[:8]} replaced by {current.agent_id[:8]}"))

    async def ensure_registered(self, rank: PrefillRank, addr: str) -> None:
        """Register with a prefill rank (once per incarnation); raises if it refuses."""
        fut = self._registrations.get(rank.agent_id)
        started = time.monotonic()
        if fut is None:
            fut = self.loop.create_future()
            fut.add_done_callback(lambda f: None if f.cancelled() or f.exception() else
                                  metrics.FIRST_CONTACT_SECONDS.labels(self.mode.value, self.name[:8],
                                                                       rank.agent_id[:8]).observe(
                                      time.monotonic() - started))
            self._registrations[rank.agent_id] = fut
            try:
                if self._control is None:
                    raise ClosedError("manager closed")
                await self._control.send(rank.endpoint, self._register_message(rank.agent_id))
            except AsyncKVError as exc:
                self._registrations.pop(rank.agent_id, None)
                fut.set_exception(exc)
                fut.exception()
                raise
            self._rank_addr[rank.agent_id] = addr
            self.loop.call_later(self.config.handshake_timeout_s, self._registration_timeout, rank)
        await asyncio.shield(fut)
        self._liveness.add(rank.agent_id, rank.endpoint, time.monotonic())

    def _registration_timeout(self, rank: PrefillRank) -> None:
        fut = self._registrations.get(rank.agent_id)
        if fut is not None and not fut.done():
            del self._registrations[rank.agent_id]
            fut.set_exception(PeerUnreachable(
                f"prefill rank tp={rank.tp_rank} at {rank.endpoint} did not answer registration "
                f"within {self.config.handshake_timeout_s:.1f}s"))
            fut.exception()

    def _register_message(self, prefill_id: str) -> Register:
        a = self.kv_args
        return Register(
            decode_id=self.name, prefill_id=prefill_id, endpoint=self.endpoint, engine_rank=a.engine_rank,
            tp_size=a.tp_size,
            page_size=a.page_size, kv_dtype=a.kv_dtype, mem_kind=a.mem_kind, is_mla=a.is_mla,
            gpu_id=a.gpu_id, kv_ptrs=tuple(int(x) for x in a.kv_data_ptrs),
            kv_lens=tuple(int(x) for x in a.kv_data_lens), kv_item_lens=tuple(int(x) for x in a.kv_item_lens),
            kv_layer_ids=a.layer_ids, aux_ptrs=tuple(int(x) for x in a.aux_data_ptrs),
            aux_lens=tuple(int(x) for x in a.aux_data_lens), aux_item_lens=tuple(int(x) for x in a.aux_item_lens),
            scratch_ptr=int(self._scratch.ctypes.data), scratch_len=SCRATCH_BYTES,
            kv_head_num=a.kv_head_num, total_kv_head_num=a.total_kv_head_num, state_type=a.state_type,
            state_ptrs=tuple(int(x) for x in a.state_data_ptrs), state_lens=tuple(int(x) for x in a.state_data_lens),
            state_item_lens=tuple(int(x) for x in a.state_item_lens),
            state_layer_ids=tuple(int(x) for x in a.state_layer_ids or ()),
            state_dims=tuple(int(x) for x in a.state_dim_per_tensor or ()),
            state_outer=tuple(int(x) for x in a.state_outer or ()),
            agent_metadata=self._agent_metadata)

    def _on_register_result(self, msg: RegisterResult) -> None:
        fut = self._registrations.get(msg.prefill_id)
        if msg.decode_id != self.name or fut is None or fut.done():
            self._drop("stale", f"registration result from {msg.prefill_id[:8]}")
            return
        if msg.ok:
            fut.set_result(None)
            return
        del self._registrations[msg.prefill_id]
        if msg.reason.startswith("prefill restarted"):
            addr = self._rank_addr.pop(msg.prefill_id, None)
            if addr is not None:
                self._instances.pop(addr, None)  # look the new incarnation up on the next room
            fut.set_exception(PeerRestarted(msg.reason))
        else:
            fut.set_exception(LayoutMismatch(f"prefill refused registration: {msg.reason}"))
        fut.exception()

    def _on_status(self, msg: Status) -> None:
        recv = self._receivers.get(msg.room)
        if recv is None:
            self._drop("unknown_room", f"status for room {msg.room}")
            return
        recv._on_status(msg)

    async def send_control(self, endpoint: str, msg: Message) -> None:
        if self._control is None:
            raise ClosedError("manager closed")
        await self._control.send(endpoint, msg)

    # -- introspection ----------------------------------------------------------------

    def room_finished(self, result: KVPoll, exc: BaseException | None, seconds: float | None, peer: str) -> None:
        """Metrics of a room that ended (called once per room by its sender or receiver)."""
        reason = "" if exc is None else type(exc).__name__
        metrics.ROOMS_FINISHED.labels(self.mode.value, self.name[:8], result.name.lower(), reason).inc()
        if seconds is not None:
            metrics.ROOM_SECONDS.labels(self.mode.value, self.name[:8], peer, result.name.lower()).observe(seconds)

    def rooms_by_state(self) -> dict[str, int]:
        counts = {state.name: 0 for state in KVPoll}
        for sender in self._senders.values():
            counts[sender.poll().name] += 1
        for receiver in self._receivers.values():
            counts[receiver.poll().name] += 1
        return counts

    def peers_snapshot(self) -> list[dict[str, Any]]:
        """Known peers: id, endpoint, alive, last heard (monotonic), unfinished rooms with it."""
        out = []
        rooms: collections.Counter[str] = collections.Counter()
        for sender in self._senders.values():
            if sender.poll() not in (KVPoll.Success, KVPoll.Failed):
                rooms.update(sender._infos)
        for recv in self._receivers.values():
            if recv.poll() not in (KVPoll.Success, KVPoll.Failed) and recv._plan is not None:
                rooms.update(r.agent_id for r in recv._plan.ranks)
        now = time.monotonic()
        for peer_id in [*self._peers, *self._rank_addr]:
            state = self._liveness.get(peer_id)
            if state is not None:  # dead peers are already gone; "alive" means heard within 2 beats
                alive = now - state.last_seen <= 2 * self.config.heartbeat_interval_s
                out.append({"peer": peer_id, "endpoint": state.endpoint, "alive": alive,
                            "last_heard": state.last_seen, "rooms": rooms[peer_id]})
        return out

    def dropped_messages(self) -> dict[str, int]:
        dropped: collections.Counter[str] = collections.Counter()
        if self._control is not None:
            dropped.update(self._control.dropped)
        for key, count in self.stats.items():
            if key.startswith("dropped_"):
                dropped[key.removeprefix("dropped_")] += count
        return dict(dropped)

    def room_counts(self) -> dict[str, int]:
        """Per-room table sizes; all zero once every room was cleared."""
        return {"senders": len(self._senders), "receivers": len(self._receivers),
                "early_rooms": len(self._early), "registrations_pending": sum(
                    1 for f in self._registrations.values() if not f.done()),
                "inflight_bytes": self._inflight_bytes}

    def __repr__(self) -> str:
        return (f"<KVManager {self.mode.value} {self.name[:8]} at {self.endpoint or '-'} "
                f"senders={len(self._senders)} receivers={len(self._receivers)}>")
