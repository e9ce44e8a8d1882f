"""KVManager: one rank's data plane, control channel, core and (optionally) bootstrap server.

The manager wires the pieces and keeps the public API; the rules live in the rank's core
(``asynckv.proto.prefill`` or ``asynckv.proto.decode``) and the I/O in its pump
(``service.prefill`` or ``service.decode``). Everything runs on the event loop that
entered the manager, except NIXL calls (on the data plane's engine thread) and large
descriptor math (on a worker thread).
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np

from ..config import Config
from ..errors import ClosedError, InvalidArgument, LocalProtocolError
from ..layout import KVArgs
from ..proto.auth import PROTECTED_MODE_REASON, Authenticator, is_loopback
from ..proto.bootstrap import PrefillRank
from ..proto.decode import DecodeCore, random_sessions
from ..proto.endpoints import endpoint_host
from ..proto.liveness import PeerState
from ..proto.messages import Message, Register, RegisterResult, VersionMismatch
from ..proto.messages import decode as decode_message
from ..proto.messages import encode as encode_message
from ..proto.prefill import PrefillCore
from ..proto.sglang import SglangRegister, decode_frames
from ..proto.sglang import encode_message as encode_sglang
from ..proto.sglang_decode import SglangDecodeCore
from ..proto.sglang_prefill import SglangPrefillCore
from ..proto.topology import PrefillInstance
from ..transport.base import ControlPlane, DataPlane
from ..transport.closing import CloseOnce
from ..transport.control import ControlChannel
from ..transport.lanes import LanedDataPlane
from ..transport.merging import MERGE_MAX_BYTES
from ..transport.nixl import NixlDataPlane
from ..transport.stream import StreamChannel
from . import metrics
from .bootstrap import BootstrapClient, BootstrapServer, split_addr
from .decode import DecodeService, ReceiverPump
from .decode_staging import DecodeStaging
from .decode_staging import applies as staging_applies
from .ops import OpsServer
from .prefill import PrefillService
from .receiver import KVReceiver
from .sender import KVSender
from .sglang_bootstrap import SglangBootstrapClient, SglangBootstrapServer, sglang_rank
from .sglang_decode import SglangDecodeService
from .writes import SCRATCH_BYTES, WriteBuilder

__all__ = ["KVManager", "Mode"]

log = logging.getLogger("asynckv.manager")


class Mode(enum.Enum):
    """Which side of the transfer a manager serves."""

    PREFILL = "prefill"
    DECODE = "decode"


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
        """The rank's buffers; once closed, the same without ``owners`` (a closed manager pins no memory)."""
        self._args = dataclasses.replace(kv_args, owners=())
        """What the services and the write builder hold: they live in reference cycles (bound methods
        as callbacks), freed only by the cyclic GC; holding the owners there kept a closed manager's
        pools (4 GiB each in the reference workload) alive until a collection, and 5 rounds ran out of
        memory. The data plane keeps the owners while registered (``MemoryLayout.keep``)."""
        self.config = config if config is not None else Config.from_env()
        self.bootstrap_addr = bootstrap_addr
        self.name = str(uuid.uuid4())
        self.bootstrap_server: BootstrapServer | SglangBootstrapServer | None = None
        self.ops_server: OpsServer | None = None
        self.page_bytes = int(sum(kv_args.kv_item_lens))
        """Bytes one page index moves across all KV entries."""
        self.data_plane_factory: Callable[[str, Config, Callable[[], bool], int], DataPlane] = _nixl_plane
        """(name, config, expecting, lanes) -> this manager's data plane, made at ``start()`` (``asynckv.testing``
        swaps in fakes)."""
        self._svc: PrefillService | DecodeService | SglangDecodeService | None = None
        self._data: DataPlane | None = None
        self._control: ControlPlane | None = None
        self.sglang = self.config.wire != "asynckv"
        """Speaks SGLang 0.5.10's wire (``Config.wire``), to pair with stock SGLang ranks."""
        self._http = SglangBootstrapClient(self.config.http_timeout_s) if self.sglang \
            else BootstrapClient(self.config.http_timeout_s, self.config.auth_token)
        self._scratch = np.zeros(SCRATCH_BYTES, dtype=np.uint8)
        self._my_rank: PrefillRank | None = None
        self._started = False
        self._closer = CloseOnce(self._close)
        self._close_step = 0  # (the first of _close's steps not done yet)
        self._pump_closed = False
        """The service finished closing: messages are dropped from then on (until then they are fed:
        closing waits for peers' answers)."""

    # -- lifecycle -----------------------------------------------------------------------

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
        if self._svc is None:
            raise ClosedError("KVManager is not started")
        return self._svc.loop

    @property
    def healthy(self) -> bool:
        """The control reader and the data-plane thread are alive, and the manager is open."""
        return (self._started and not self._closer.begun and self._svc is not None and self._data is not None
                and self._data.alive and self._control is not None and self._control.reader_alive)

    @property
    def data_plane(self) -> DataPlane:
        if self._data is None:
            raise ClosedError("KVManager is not started")
        return self._data

    def use_data_plane(self, data: DataPlane) -> None:
        """Swap the data plane of a started manager (``asynckv.testing.inject`` wraps it with faults)."""
        self._data = data
        if isinstance(self._svc, PrefillService):
            self._svc.use_data_plane(data)

    @property
    def control(self) -> ControlPlane:
        if self._control is None:
            raise ClosedError("KVManager is not started")
        return self._control

    async def start(self) -> None:
        if self._started:
            raise LocalProtocolError("KVManager already started")
        self._started = True
        try:
            await self._start()
        except BaseException:
            await self.close()
            raise
        log.info("%s manager %s ready at %s", self.mode.value, self.name[:8], self.endpoint)
        self._log_security()

    def _log_security(self) -> None:
        """One line at start saying who this manager hears (see docs/security.md)."""
        cfg = self.config
        if cfg.auth_token:
            log.info("%s: control traffic authenticated (ASYNCKV_AUTH_TOKEN set)", self.name[:8])
        elif cfg.allow_unauthenticated:
            log.warning("%s: ASYNCKV_ALLOW_UNAUTHENTICATED=1: unauthenticated control traffic accepted from any "
                        "host; anyone who reaches %s can make this rank write or read KV pages",
                        self.name[:8], self.endpoint)
        else:
            log.info("%s: protected mode: no ASYNCKV_AUTH_TOKEN, control traffic accepted from loopback only%s",
                     self.name[:8], "" if is_loopback(cfg.host) else f" (bound to {cfg.host}: remote peers refused)")

    async def _start(self) -> None:
        cfg, prefill = self.config, self.mode is Mode.PREFILL
        labels = (self.mode.value, self.name[:8])
        builder = WriteBuilder(self._args, cfg)
        # A decode target must keep progressing while prefill may write into it (an unpolled
        # target stalls its initiators); with no room waiting it can sleep longer.
        # Only the side that posts copies, so only prefill spreads its writes over lanes.
        data = self._data = self.data_plane_factory(self.name, cfg, (lambda: False) if prefill else self._expecting,
                                                    cfg.write_lanes if prefill else 1)
        scratch = (int(self._scratch.ctypes.data), SCRATCH_BYTES)
        keep = (*self.kv_args.owners, self._scratch)  # (the scratch area is the source of warm-up writes)
        staging = DecodeStaging(cfg.decode_staging_bytes, self._args) if (
            not prefill and not self.sglang and cfg.decode_staging_bytes > 0 and staging_applies(self._args)) else None
        extra = () if staging is None else ((staging.addr, staging.capacity),)
        keep = keep if staging is None else (*keep, staging.buffer)
        metadata = await data.start(builder.memory_layout(scratch, prepare_local=prefill, keep=keep, extra_dram=extra))
        auth = Authenticator(cfg.auth_token) if cfg.auth_token else None
        codec = (decode_frames, encode_sglang) if self.sglang else (decode_message, encode_message)
        channel = StreamChannel if cfg.control == "stream" else ControlChannel
        control = self._control = channel(cfg.host, self._on_message, self._on_version_mismatch,
                                          cfg.send_timeout_s, auth, loopback_only=cfg.protected,
                                          on_refused=self._on_refused, codec=codec, one_frame=not self.sglang)
        endpoint = await control.start()
        if prefill:
            core = (SglangPrefillCore if self.sglang else PrefillCore)(self.name, endpoint, self._args, cfg)
            self._svc = PrefillService(core, control, data, builder, cfg, labels)
            await self._start_prefill()
        elif self.sglang:
            if not isinstance(data, NixlDataPlane) or not isinstance(self._http, SglangBootstrapClient):
                raise InvalidArgument("the SGLang wire completes rooms with NIXL notifications: it needs the NIXL "
                                      "data plane")
            host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
            a = self._args
            sglang_register = SglangRegister(
                ip=host.strip("[]"), port=int(port), agent_name=self.name, agent_metadata=metadata,
                kv_ptrs=tuple(int(x) for x in a.kv_data_ptrs), aux_ptrs=tuple(int(x) for x in a.aux_data_ptrs),
                state_ptrs=(), gpu_id=a.gpu_id, tp_size=a.tp_size, engine_rank=a.engine_rank,
                kv_item_len=int(a.kv_item_lens[0]))
            core_d = SglangDecodeCore(self.name, endpoint, a, cfg, sglang_register)
            sglang = SglangDecodeService(core_d, control, self._http, cfg, labels)
            data.on_notified = sglang.on_notified
            self._svc = sglang
        else:
            register = _register_template(self.name, endpoint, self._args, scratch, metadata)
            decode = DecodeCore(self.name, endpoint, self._args, cfg, register, random_sessions(), staging)
            self._svc = DecodeService(decode, control, self._http, cfg, labels, staging=staging)
        metrics.register_manager(self)
        if cfg.ops_port >= 0:
            self.ops_server = await OpsServer(cfg.host, cfg.ops_port, lambda: self.healthy, auth_token=cfg.auth_token,
                                              allow_unauthenticated=cfg.allow_unauthenticated).start()

    def _expecting(self) -> bool:
        svc = self._svc
        if isinstance(svc, SglangDecodeService):
            return bool(svc.core.progress)
        return isinstance(svc, DecodeService) and bool(svc.core.rooms or svc.core.fencing)

    async def _start_prefill(self) -> None:
        addr = self.bootstrap_addr
        if addr is None:
            raise InvalidArgument("a PREFILL manager needs bootstrap_addr")
        host, port = split_addr(addr)
        cfg = self.config
        # Port 0 asks for an embedded server on a free port (tests, single-instance demos).
        if port == 0 or (cfg.host_bootstrap and not await self._http.is_up(addr)):
            server: BootstrapServer | SglangBootstrapServer = \
                SglangBootstrapServer(host, port, allow_unauthenticated=cfg.allow_unauthenticated) if self.sglang \
                else BootstrapServer(host, port, cfg.auth_token, allow_unauthenticated=cfg.allow_unauthenticated)
            try:
                await server.start()
            except OSError as exc:  # another rank of this instance won the race
                log.debug("embedded bootstrap server not started: %s", exc)
            else:
                self.bootstrap_server = server
                self.bootstrap_addr = addr = server.addr
                if isinstance(server, BootstrapServer):
                    server.add_health_check(f"manager-{self.name[:8]}", lambda: self.healthy)
        a = self._args
        if isinstance(self._http, SglangBootstrapClient):  # SGLang's registration has no lease to renew
            await self._http.register_sglang(addr, sglang_rank(a, self.endpoint, cfg.sglang_kv_cache_dtype),
                                             cfg.register_attempts)
            return
        self._my_rank = PrefillRank(
            tp_size=a.tp_size, tp_rank=a.engine_rank, pp_size=a.pp_size, pp_rank=a.pp_rank,
            dp_size=a.dp_size, dp_rank=a.dp_rank, endpoint=self.endpoint, agent_id=self.name,
            page_size=a.page_size, kv_dtype=a.kv_dtype, is_mla=a.is_mla)
        lease_s = await self._http.register(addr, self._my_rank, self.config.register_attempts)
        # Renewed until close() unregisters: a crashed rank's entry lapses, so its restart may replace it.
        self._http.keep_registered(addr, self._my_rank, lease_s)

    async def close(self) -> None:
        """Fail every unfinished room; once every write settled say goodbye; release everything (as ``CloseOnce``)."""
        if self._closer.finished:
            return
        if self._svc is not None and self._svc.loop is not asyncio.get_running_loop():  # (its futures are that loop's)
            why = "a closed event loop: close it before its loop ends" if self._svc.loop.is_closed() else \
                "another event loop: close it there"
            raise LocalProtocolError(f"KVManager {self.name[:8]} runs on {why}")
        await self._closer()

    async def _close(self) -> None:
        """Each step once, in order: one cut short runs again at the next close; one failing is logged, the rest run."""
        parts = (self._control, self._data, self.bootstrap_server, self.ops_server)
        steps = [self._close_service, self._unregister, self._http.close, *(p.close for p in parts if p is not None)]
        for step in steps[self._close_step:]:
            try:
                await step()
            except Exception:
                log.exception("%s manager %s: closing (%s) failed", self.mode.value, self.name[:8], step.__qualname__)
            self._close_step += 1
        metrics.forget_manager(self)
        self.kv_args = self._args  # (every step closed: nothing of ours can touch the memory now)

    async def _close_service(self) -> None:
        if self._svc is not None:
            await self._svc.close(self.config.close_bound_s)
        self._pump_closed = True

    async def _unregister(self) -> None:  # (not from a server of ours: it closes next, table and all)
        if self._my_rank is not None and self.bootstrap_addr is not None and self.bootstrap_server is None:
            await self._http.unregister(self.bootstrap_addr, self._my_rank)

    # -- rooms -----------------------------------------------------------------------------

    def sender(self, room: int) -> KVSender:
        """Create the sender of ``room`` (prefill only)."""
        svc = self._open(Mode.PREFILL)
        if not isinstance(svc, PrefillService):
            raise LocalProtocolError("this is a decode manager")
        return svc.open(room)

    def receiver(self, bootstrap_addr: str, room: int) -> KVReceiver:
        """Create the receiver of ``room``, served by the prefill at ``bootstrap_addr`` (decode only)."""
        svc = self._open(Mode.DECODE)
        split_addr(bootstrap_addr)
        if not isinstance(svc, ReceiverPump):
            raise LocalProtocolError("this is a prefill manager")
        return svc.open(bootstrap_addr, room)

    def _open(self, mode: Mode) -> PrefillService | DecodeService | SglangDecodeService:
        if self.mode is not mode:
            raise LocalProtocolError(f"this is a {self.mode.value} manager")
        if not self._started or self._closer.begun or self._svc is None:
            raise ClosedError("KVManager is not running (use `async with`)")
        return self._svc

    async def prefill_instance(self, addr: str, *, connect: bool = False) -> PrefillInstance:
        """The topology of the prefill at ``addr``, fetched once and cached (decode only). With
        ``connect``, this rank also starts registering with the prefill ranks its rooms will write
        from (first contact: NIXL and UCX set-up, 23-50 ms on a 2-core VM), without waiting for it,
        so the first room does not pay it."""
        svc = self._open(Mode.DECODE)
        if not isinstance(svc, DecodeService):
            raise LocalProtocolError("prefill_instance() is for decode managers on asynckv's wire")
        return await svc.instance(addr, connect)

    # -- peers and messages ------------------------------------------------------------------

    def _on_message(self, msg: Message) -> None:
        if self._svc is not None and not self._pump_closed:
            self._svc.feed("receive", msg)

    def _on_refused(self, msg: Message, origin: str) -> None:
        """Protected mode refused a message from ``origin``: a registration hears why, if its endpoint
        is on that same address (a forged endpoint must not turn us into a reflector)."""
        control = self._control
        if control is None or self.mode is not Mode.PREFILL or not isinstance(msg, Register):
            return
        if endpoint_host(msg.endpoint) == origin:
            control.send(msg.endpoint, RegisterResult(self.name, msg.decode_id, msg.session, False,
                                                      PROTECTED_MODE_REASON), transient=True)

    def _on_version_mismatch(self, exc: VersionMismatch) -> None:
        svc = self._svc
        if isinstance(svc, PrefillService):
            svc.feed("version_mismatch", exc.msg_type, exc.body, str(exc))

    def liveness(self, peer_id: str) -> PeerState | None:
        """Heartbeat and lease state of a peer this manager works with."""
        return None if self._svc is None else self._svc.core.liveness.get(peer_id)

    def declare_dead(self, peer_id: str, exc: BaseException) -> None:
        """Treat a peer as dead now: fail exactly the rooms that involve it, forget it."""
        if self._svc is not None:
            self._svc.feed("declare_dead", peer_id, exc)

    def send_control(self, endpoint: str, msg: Message) -> None:
        """Send a raw control message (tools and tests); messages to one endpoint stay in order."""
        self.control.send(endpoint, msg)

    # -- introspection ----------------------------------------------------------------------

    @property
    def stats(self) -> dict[str, int]:
        """Counters of the core: messages by type, drops by reason, posts and bytes by kind (an aux
        row that rode on a KV post counts in ``aux_bytes`` and ``aux_riding``, not ``aux_posts``)."""
        return {} if self._svc is None else dict(self._svc.core.stats)

    def snapshot(self) -> dict[str, Any]:
        """Rooms by state, peers, table sizes, drops and health, as plain JSON types."""
        if self._svc is None:
            return {"mode": self.mode.value, "name": self.name, "rooms": {}, "peers": [], "tables": {},
                    "dropped": {}, "healthy": False}
        snap = self._svc.snapshot()
        dropped = dict(self._control.dropped) if self._control is not None else {}
        for key, count in self._svc.core.stats.items():
            if key.startswith("dropped_"):
                dropped[key.removeprefix("dropped_")] = dropped.get(key.removeprefix("dropped_"), 0) + count
        snap.update(dropped=dropped, healthy=self.healthy)
        return snap

    def room_counts(self) -> dict[str, int]:
        """Per-room table sizes; all zero once every room was cleared and settled."""
        return {} if self._svc is None else self._svc.snapshot()["tables"]

    def __repr__(self) -> str:
        rooms = 0 if self._svc is None else len(self._svc.core.rooms)
        return f"<KVManager {self.mode.value} {self.name[:8]} at {self.endpoint or '-'} rooms={rooms}>"


def _nixl_plane(name: str, config: Config, expecting: Callable[[], bool], lanes: int) -> DataPlane:
    def make(agent: str) -> NixlDataPlane:
        plane = NixlDataPlane(agent, backend=config.nixl_backend, idle_poll_s=config.idle_poll_s, expecting=expecting,
                              loopback_only=config.protected)  # protected mode: UCX listens on loopback only too
        # A merged handle keeps the bounds on one handle: what may land after its lease check, and descriptors.
        plane.merge_limits = (min(MERGE_MAX_BYTES, config.xfer_handle_bytes), config.max_descs_per_xfer)
        return plane
    return make(name) if lanes == 1 else LanedDataPlane.make(name, lanes, make)


def _register_template(name: str, endpoint: str, a: KVArgs, scratch: tuple[int, int], metadata: bytes) -> Register:
    """This decode rank's Register; the core fills in prefill_id, session and lease per registration."""
    return Register(
        decode_id=name, prefill_id="", session=0, lease_ms=0, endpoint=endpoint, engine_rank=a.engine_rank,
        tp_size=a.tp_size, page_size=a.page_size, kv_dtype=a.kv_dtype, mem_kind=a.mem_kind, is_mla=a.is_mla,
        gpu_id=a.gpu_id, kv_ptrs=tuple(int(x) for x in a.kv_data_ptrs),
        kv_lens=tuple(int(x) for x in a.kv_data_lens), kv_item_lens=tuple(int(x) for x in a.kv_item_lens),
        kv_layer_ids=a.layer_ids, aux_ptrs=tuple(int(x) for x in a.aux_data_ptrs),
        aux_lens=tuple(int(x) for x in a.aux_data_lens), aux_item_lens=tuple(int(x) for x in a.aux_item_lens),
        scratch_ptr=scratch[0], scratch_len=scratch[1], kv_head_num=a.kv_head_num,
        total_kv_head_num=a.total_kv_head_num, state_type=a.state_type,
        state_ptrs=tuple(int(x) for x in a.state_data_ptrs), state_lens=tuple(int(x) for x in a.state_data_lens),
        state_item_lens=tuple(int(x) for x in a.state_item_lens),
        state_layer_ids=tuple(int(x) for x in a.state_layer_ids or ()),
        state_dims=tuple(int(x) for x in a.state_dim_per_tensor or ()),
        state_outer=tuple(int(x) for x in a.state_outer or ()), agent_metadata=metadata)
