"""SglangDecodeCore: an asynckv decode rank receiving from stock SGLang 0.5.10 prefill ranks, sans-IO.

The rules of SGLang's decode side, with asynckv's guarantees where a stock prefill allows them:

- the prefill instance is looked up with SGLang's ``GET /route`` (``FetchTopology``; the
  service answers with a ``SglangPrefill``); its ``page_size`` and ``kv_cache_dtype`` must equal
  ours (SGLang compares the same two), and what this wire does not cover is refused naming
  the field, at ``init()``: another attention TP size, context or pipeline parallelism, DP
  routing other than ``follow_bootstrap_room``;
- the registration (13 frames) goes once to each prefill rank, before the room's transfer
  info (9 frames); both travel on one ZMQ socket per rank, so they arrive in that order;
- completion comes from the NIXL notifications on the prefill's writes (``notified``):
  ``SglangCompletion`` counts the chunks, in any order, and fails the room on chunk ids SGLang
  would wait on forever; notifications of another agent than the room's first writer (an
  asynckv prefill's write lanes ``<name>.<i>`` count as ``<name>``), or of a room not waiting,
  are dropped and counted (``late_notification`` when the room failed:
  the stock prefill wrote into pages after the failure);
- the room fails with a reason on the waiting timeout, and when the prefill's bootstrap
  server fails ``heartbeat_max_failures`` health checks in a row (``GET /health`` every
  ``heartbeat_interval_s``, as SGLang's decode does);
- no fence: a stock SGLang prefill hears nothing from decode (SGLang has no abort message),
  so a failed or aborted room is Failed at once, and that prefill may still write into its
  pages until its own transfer ends. Reuse such pages only after the prefill is known to be
  done with the request (docs/interop.md).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
from typing import Any

import numpy as np

from ..config import Config
from ..errors import (
    Aborted,
    ClosedError,
    InvalidArgument,
    LayoutMismatch,
    LocalProtocolError,
    PeerUnreachable,
    RemoteProtocolError,
    WaitingTimeout,
)
from ..kernels import validate_pages
from ..layout import KVArgs
from .actions import Action, Closed, FetchTopology, Finished, InitDone, Send
from .core import Core, check_int, check_new_room
from .receiver import ReceiverRoom
from .sglang import SglangCompletion, SglangRegister, SglangTransferInfo, parse_notification
from .states import Event, ReceiverState
from .timers import earliest

__all__ = ["CheckHealth", "SglangDecodeCore", "SglangPrefill", "check_prefill"]

log = logging.getLogger("asynckv.decode")


@dataclasses.dataclass(frozen=True, slots=True)
class SglangPrefill:
    """A prefill instance as SGLang's ``GET /route`` describes it, with the endpoints of the ranks
    this decode rank writes to (by DP rank)."""

    attn_tp_size: int
    attn_cp_size: int
    dp_size: int
    pp_size: int
    page_size: int
    kv_cache_dtype: str
    follow_bootstrap_room: bool
    endpoints: dict[int, str] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_json(cls, body: Any) -> SglangPrefill:
        """The topology answer; raises ``RemoteProtocolError`` naming a missing or mistyped field."""
        if not isinstance(body, dict):
            raise RemoteProtocolError(f"sglang GET /route: not a JSON object: {str(body)[:80]!r}")
        values: dict[str, Any] = {}
        for f in ("attn_tp_size", "attn_cp_size", "dp_size", "pp_size", "page_size"):
            value = body.get(f)
            if type(value) is not int or not 1 <= value <= 1 << 20:
                raise RemoteProtocolError(f"sglang GET /route: field {f!r} must be a positive integer, got {value!r}")
            values[f] = value
        dtype, follow = body.get("kv_cache_dtype"), body.get("follow_bootstrap_room")
        if not isinstance(dtype, str) or not isinstance(follow, bool):
            raise RemoteProtocolError(f"sglang GET /route: kv_cache_dtype {dtype!r} / follow_bootstrap_room "
                                      f"{follow!r} have the wrong type")
        return cls(**values, kv_cache_dtype=dtype, follow_bootstrap_room=follow)


def check_prefill(prefill: SglangPrefill, kv_args: KVArgs, kv_cache_dtype: str) -> None:
    """Refuse a prefill instance this decode rank cannot receive from on this wire, naming the field."""
    a = kv_args
    if prefill.page_size != a.page_size:
        raise LayoutMismatch(f"page_size mismatch: prefill has {prefill.page_size}, decode has {a.page_size}")
    if prefill.kv_cache_dtype != kv_cache_dtype:
        raise LayoutMismatch(f"kv_cache_dtype mismatch: prefill has {prefill.kv_cache_dtype!r}, decode has "
                             f"{kv_cache_dtype!r} (Config.sglang_kv_cache_dtype)")
    if prefill.attn_tp_size != a.tp_size:
        raise LayoutMismatch(f"attn_tp_size: prefill has {prefill.attn_tp_size}, this decode rank has TP {a.tp_size}: "
                             f"the SGLang wire supports equal attention TP only")
    if prefill.attn_cp_size != 1:
        raise LayoutMismatch(f"attn_cp_size {prefill.attn_cp_size}: context-parallel prefill is not supported on "
                             f"the SGLang wire")
    if prefill.pp_size != 1:
        raise LayoutMismatch(f"pp_size {prefill.pp_size}: pipeline-parallel prefill is not supported on the "
                             f"SGLang wire")
    if prefill.dp_size > 1 and not prefill.follow_bootstrap_room:
        raise LayoutMismatch(f"dp_size {prefill.dp_size} without follow_bootstrap_room: routing rooms with "
                             f"/query_dp_ranks is not supported on the SGLang wire")


@dataclasses.dataclass(frozen=True, slots=True)
class CheckHealth(Action):
    """``GET /health`` of the prefill's bootstrap server; answer with ``health_checked``."""

    addr: str
    timeout_s: float


STATE_REFUSED = "state_indices: hybrid-model state (mamba/SWA/NSA) is not supported on the SGLang wire"



def writer_of(agent: str) -> str:
    """The prefill rank an agent writes for: an asynckv prefill posts from write lanes named
    ``<name>.<i>`` beside ``<name>`` (``transport.lanes``); SGLang's agents are UUIDs."""
    base, dot, lane = agent.rpartition(".")
    return base if dot and lane.isdigit() else agent

class SglangDecodeCore(Core):
    """The decode side of one rank on SGLang's wire (see the module docstring)."""

    mode = "decode"

    def __init__(self, name: str, endpoint: str, kv_args: KVArgs, config: Config, register: SglangRegister) -> None:
        super().__init__(name, endpoint, kv_args, config)
        self.register = register
        """This rank's registration (sent once to each prefill rank)."""
        self.rooms: dict[int, ReceiverRoom] = {}
        self.progress: dict[ReceiverRoom, SglangCompletion] = {}
        """Rooms waiting for their notifications (their destination went out; no outcome yet)."""
        self.writers: dict[ReceiverRoom, str] = {}
        """The agent whose notification a room heard first: the one prefill rank that writes it."""
        self.instances: dict[str, SglangPrefill] = {}
        self.fetching: dict[str, list[ReceiverRoom]] = {}
        self.registered: set[str] = set()
        """Prefill endpoints this rank's registration went to."""
        self.failures: dict[str, tuple[int, float]] = {}
        """Health checks failed in a row (with no pause in the checks), and when the last one failed,
        by bootstrap address."""
        self.checking: set[str] = set()
        self._check_timeout_s = min(config.http_timeout_s, 2 * config.heartbeat_interval_s)
        """A health check unanswered this long failed (a stopped prefill does not refuse, it hangs)."""
        self._epochs = itertools.count(1)

    # -- the surface the pump drives -------------------------------------------------------

    def get_timer(self) -> float | None:
        when = self.deadlines.next()
        return earliest(when, self._next_beat) if self.progress else when

    def handle_timer(self, now: float) -> None:
        for room in self.deadlines.pop_due(now):
            if room.active:
                self.fail(room, WaitingTimeout(
                    f"room {room.room}: no result from SGLang prefill {room.addr} after "
                    f"{self.config.waiting_timeout_s:.1f}s in {room.poll().name}"), now)
        watched = self._watched()
        if watched and now >= self._next_beat:
            self._next_beat = now + self.config.heartbeat_interval_s
            for addr in watched:
                if addr not in self.checking:
                    self.checking.add(addr)
                    self._emit(CheckHealth(addr, self._check_timeout_s))

    def _watched(self) -> set[str]:
        """Bootstrap addresses of prefills that may be writing a room (their health is checked)."""
        return {room.addr for room in self.progress}

    def health_checked(self, addr: str, error: str | None, now: float) -> None:
        """The answer to ``CheckHealth``: None when ``GET /health`` said 200."""
        self.checking.discard(addr)
        if error is None:
            self.failures.pop(addr, None)
            return
        failed, last = self.failures.get(addr, (0, -math.inf))
        if now - last > self._check_timeout_s + 2 * self.config.heartbeat_interval_s:  # checks paused meanwhile
            # (no room waited): "in a row" starts again
            failed = 0
        failed += 1
        self.failures[addr] = (failed, now)
        if failed < self.config.heartbeat_max_failures:
            return
        del self.failures[addr]
        reason = PeerUnreachable(f"SGLang prefill at {addr} failed {failed} health checks in a row "
                                 f"(every {self.config.heartbeat_interval_s:g}s): {error}")
        log.warning("decode: %s", reason)
        self._forget_instance(addr)
        for room in list(self.rooms.values()):
            if room.addr == addr:
                self.fail(room, reason, now)

    def topology_fetched(self, addr: str, result: SglangPrefill | BaseException, now: float) -> None:
        waiting = self.fetching.pop(addr, [])
        if isinstance(result, SglangPrefill):
            try:
                check_prefill(result, self.kv_args, self.config.sglang_kv_cache_dtype)
            except LayoutMismatch as exc:
                result = exc
            else:
                self.instances[addr] = result
        for room in waiting:
            if room.state is not ReceiverState.RESOLVING:
                continue
            if isinstance(result, BaseException):
                self.fail(room, result, now)
            else:
                self._send(room, result, now)

    def notified(self, agent: str, raw: bytes, now: float) -> None:
        """A NIXL notification from a prefill agent."""
        try:
            note = parse_notification(raw)
        except RemoteProtocolError as exc:
            self._drop("bad_notification", f"from {agent[:8]}: {exc}")
            return
        room = self.rooms.get(note.room)
        progress = None if room is None else self.progress.get(room)  # (there only while it waits)
        if room is None or progress is None:
            if room is not None and room.state is ReceiverState.FAILED:
                self.stats["late_notification"] += 1
                log.warning("room %d: SGLang prefill %s wrote into it after it failed (%s)", note.room, agent[:8],
                            raw[:64])
            else:
                self._drop("unknown_room", f"notification {raw[:64]!r} from {agent[:8]}")
            return
        writer = self.writers.setdefault(room, writer_of(agent))
        if writer != writer_of(agent):
            self._drop("other_agent", f"room {note.room}: notified by {agent[:8]}, written by {writer[:8]}")
            return
        progress.add(note)
        if progress.error is not None:
            self.fail(room, RemoteProtocolError(f"room {room.room}: SGLang prefill {agent[:8]}: {progress.error}"),
                      now)
        elif progress.done:
            room.move(Event.SENDERS_SUCCEEDED)
            self._finish(room, now)

    def close(self, now: float) -> None:
        if self.closing:
            return
        self.closing = True
        for room in list(self.rooms.values()):
            self.fail(room, ClosedError("manager closed"), now)
            self.clear_receiver(room, now)
        self.closed = True
        self._emit(Closed())

    # -- receiver API ------------------------------------------------------------------------

    def open_receiver(self, addr: str, room: int, now: float) -> ReceiverRoom:
        check_new_room(room, self.rooms, self.config.max_rooms, self.closing)
        receiver = self.rooms[room] = ReceiverRoom(room, addr, next(self._epochs))
        return receiver

    def receiver_init(self, room: ReceiverRoom, page_indices: Any, aux_index: Any, state_indices: Any,
                      decode_prefix_len: Any, now: float) -> None:
        if room.initialized:
            raise LocalProtocolError(f"room {room.room}: init() called twice")
        if not room.active:
            return
        pages = validate_pages(page_indices, self.num_pages, "decode page indices")
        if not len(pages):
            raise InvalidArgument("page_indices: empty; SGLang's prefill completes a room with its KV "
                                  "notifications, so a room receives at least one page on the SGLang wire")
        aux = check_int(aux_index, "aux_index")
        if aux >= self.num_aux_rows:
            raise InvalidArgument(f"aux_index {aux} outside the registered aux rows [0, {self.num_aux_rows}) "
                                  f"(SGLang's prefill always writes the metadata row: -1 is not allowed)")
        if state_indices is not None and len(state_indices):
            raise InvalidArgument(STATE_REFUSED)
        if check_int(decode_prefix_len, "decode_prefix_len"):
            raise InvalidArgument("decode_prefix_len: SGLang 0.5.10's transfer info has no prefix length")
        room.pages, room.aux_index = pages.astype(np.int32), aux
        room.initialized, room.started = True, now
        room.move(Event.INIT_CALLED)
        self.deadlines.arm(room, now + self.config.waiting_timeout_s)
        instance = self.instances.get(room.addr)
        if instance is not None:
            self._send(room, instance, now)
            return
        if room.addr not in self.fetching:  # (one look-up in flight per address)
            self._emit(FetchTopology(room.addr))
        self.fetching.setdefault(room.addr, []).append(room)

    def abort_receiver(self, room: ReceiverRoom, error: BaseException, now: float) -> None:
        self.fail(room, error, now)

    def clear_receiver(self, room: ReceiverRoom, now: float) -> None:
        if room.cleared:
            return
        if room.active:
            self.fail(room, Aborted("cleared before completion"), now)
        room.cleared = True
        if self.rooms.get(room.room) is room:
            del self.rooms[room.room]
        self.progress.pop(room, None)
        self.writers.pop(room, None)
        self.deadlines.arm(room, None)
        waiting = self.fetching.get(room.addr)
        if waiting is not None and room in waiting:
            waiting.remove(room)

    def instance(self, addr: str) -> SglangPrefill | None:
        return self.instances.get(addr)

    # -- rooms -----------------------------------------------------------------------------

    def _send(self, room: ReceiverRoom, prefill: SglangPrefill, now: float) -> None:
        dp = room.room % prefill.dp_size
        endpoint = prefill.endpoints.get(dp)
        if endpoint is None:
            self.fail(room, RemoteProtocolError(f"SGLang prefill {room.addr}: no endpoint for DP rank {dp}"), now)
            return
        if endpoint not in self.registered:
            self.registered.add(endpoint)
            self._emit(Send(endpoint, self.register))
        reg = self.register
        self._emit(Send(endpoint, SglangTransferInfo(room.room, reg.ip, reg.port, reg.agent_name, room.pages,
                                                     room.aux_index, 1, np.empty(0, dtype=np.int32))))
        self.progress[room] = SglangCompletion(pp_ranks=1)
        room.move(Event.DESTINATION_SENT)
        self._emit(InitDone(room))

    def fail(self, room: ReceiverRoom, error: BaseException, now: float) -> None:
        """Failed at once: a stock SGLang prefill cannot be told to stop writing (no fence; see above)."""
        if not room.active:
            return
        room.exception = error
        log.info("room %d failed: %s", room.room, room.reason)
        room.move(Event.FAILED)
        self._finish(room, now)

    def _finish(self, room: ReceiverRoom, now: float) -> None:
        room.finished = now
        self.deadlines.arm(room, None)
        self.progress.pop(room, None)  # (only waiting rooms are counted, checked and watched)
        self.writers.pop(room, None)
        self._emit(Finished(room))

    def _forget_instance(self, addr: str) -> None:
        """A prefill declared dead: its next room looks it up again and registers anew."""
        prefill = self.instances.pop(addr, None)
        if prefill is not None:
            self.registered.difference_update(prefill.endpoints.values())

    # -- introspection -----------------------------------------------------------------------

    def room_counts(self) -> dict[str, int]:
        return {"receivers": len(self.rooms), "progress": len(self.progress), "writers": len(self.writers),
                "fetching": sum(len(v) for v in self.fetching.values())}

    def snapshot(self, now: float) -> dict[str, Any]:
        by_state: dict[str, int] = {}
        for room in self.rooms.values():
            by_state[room.poll().name] = by_state.get(room.poll().name, 0) + 1
        peers = [{"peer": addr, "endpoints": sorted(p.endpoints.values()),
                  "health_failures": self.failures.get(addr, (0, 0.0))[0]} for addr, p in self.instances.items()]
        return {"mode": "decode", "wire": "sglang-0.5.10", "name": self.name, "rooms": by_state, "peers": peers,
                "tables": self.room_counts()}
