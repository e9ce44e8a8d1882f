"""PrefillCore on SGLang 0.5.10's wire: an asynckv prefill rank serving stock SGLang decode ranks.

SGLang's decode sends two messages (``asynckv.proto.sglang``): a registration once per prefill
rank, and one transfer info per room. This core translates them into asynckv's own
``Register`` and ``TransferInfo`` and lets ``PrefillCore`` apply every rule it applies to
asynckv peers (checked destinations, the byte budget, one handle in flight, cancel on failure).
What differs, because a stock SGLang decode cannot take part:

- it never hears from prefill over ZMQ: registration results, statuses and goodbyes are not
  sent (a refused registration or a failed room is logged and counted instead; that decode
  learns of it only from its own waiting timeout);
- completion travels as NIXL notifications: each KV write is followed by
  ``{room}_kv_{chunk}_{is_last}_{pp}``, the aux write by ``{room}_aux`` (``Post.notif``). The
  data plane sends one only once every byte of its write landed, and never for a write that
  stopped (cancelled, lease, deadline), so a room that fails here before its last write
  completed is never completed there;
- SGLang's decode registers once: a peer dropped on a NIXL error is connected anew from its
  kept registration when it sends another transfer info (a false death must not refuse it for
  good);
- no heartbeat and no write lease: SGLang's decode answers no pings (it checks prefill's
  ``GET /health`` instead), so its writes are bounded by their deadlines and NIXL's errors;
- its registration does not say the pool size, memory kind or page geometry: the pool is
  bounded by NIXL's check of the memory it registered (no destination dlist is prepared),
  the memory kind is taken to be this rank's own, and ``page_size`` and ``kv_cache_dtype``
  were compared by that decode against our bootstrap entry before it registered.

Out of scope on this wire, refused naming the field: pipeline-parallel prefill (a registration
with another number of KV buffers), heterogeneous TP for MHA, hybrid-model state, and empty
chunks (SGLang's decode counts one notification per chunk).
"""

from __future__ import annotations

import collections
import logging
import math
from typing import Any

from ..config import Config
from ..errors import InvalidArgument, LayoutMismatch
from ..layout import KVArgs
from .actions import Action, Send, SetLease
from .messages import Register, RegisterResult, Status, TransferInfo
from .prefill import PrefillCore
from .prefill_writes import Queued
from .registration import INT32_ROWS
from .sender import DecodePeer, PeerPhase, SenderRoom
from .sglang import SglangRegister, SglangTransferInfo, aux_notification, kv_notification
from .topology import PeerPlan, plan_peer

__all__ = ["SglangPrefillCore"]

log = logging.getLogger("asynckv.prefill")

SESSION = 1
"""SGLang has no registration sessions: a decode that restarts comes back under a new agent name."""
KEPT_REGISTRATIONS = 256
"""Registrations kept to connect a dropped decode anew (each holds its NIXL metadata, ~50 KB)."""
MAX_HELD = 1024
"""Destinations kept per decode peer while it connects."""
STATE_REFUSED = "state indices: hybrid-model state (mamba/SWA/NSA) is not supported on the SGLang wire"


class SglangPrefillCore(PrefillCore):
    """A prefill rank whose decode peers are stock SGLang 0.5.10 ranks (see the module docstring)."""

    MERGE_AUX = False  # (SGLang's decode counts a notification per kind: the aux row is a post of its own)

    def __init__(self, name: str, endpoint: str, kv_args: KVArgs, config: Config) -> None:
        super().__init__(name, endpoint, kv_args, config)
        self._handlers.update({SglangRegister: self._on_sglang_register, SglangTransferInfo: self._on_sglang_info})
        self._registrations: collections.OrderedDict[str, SglangRegister] = collections.OrderedDict()
        """Registrations of decodes that connected (the most recent ``KEPT_REGISTRATIONS``): SGLang's
        decode registers once, so a peer dropped on a NIXL error that sends again is connected anew
        from this (one false death must not wedge the pair until that decode restarts)."""
        self._connecting_infos: dict[str, list[tuple[TransferInfo, str | None]]] = {}
        """Destinations of decode peers still connecting (SGLang's decode does not wait for an answer to
        its registration: its first transfer info follows at once), replayed once they connected."""
        self._held_bytes = 0
        """Bytes of page arrays in ``_connecting_infos`` (bounded by ``max_early_bytes``)."""

    # -- messages --------------------------------------------------------------------------

    def _on_sglang_register(self, msg: SglangRegister, now: float) -> None:
        if msg.agent_name in self.peers:  # SGLang registers once per prefill rank and agent
            self._drop("duplicate", f"sglang decode {msg.agent_name[:8]} registered again")
            return
        self._registrations.pop(msg.agent_name, None)
        try:
            reg = self._as_register(msg)
        except LayoutMismatch as exc:
            self.stats["peers_refused"] += 1
            log.warning("refused SGLang decode %s at %s: %s (a stock SGLang decode cannot be told: its rooms "
                        "wait for its own timeout)", msg.agent_name[:8], msg.endpoint, exc)
            return
        self._on_register(reg, now)
        if msg.agent_name in self.peers:  # accepted (a refused one is not retried)
            self._registrations[msg.agent_name] = msg
            while len(self._registrations) > KEPT_REGISTRATIONS:
                self._registrations.popitem(last=False)

    def _as_register(self, msg: SglangRegister) -> Register:
        a = self.kv_args
        n = len(msg.kv_ptrs)
        if n != a.num_entries:
            raise LayoutMismatch(f"kv pointers: the SGLang decode registered {n} KV buffers, this rank has "
                                 f"{a.num_entries} (pipeline-parallel prefill is not supported on the SGLang wire)")
        if msg.tp_size != a.tp_size and not a.is_mla:
            raise LayoutMismatch(f"decode tp size: {msg.tp_size}, this prefill rank has TP {a.tp_size}: the SGLang "
                                 f"wire supports equal attention TP only (MLA: any)")
        pages = INT32_ROWS // max(1, n)  # (no dlist is prepared: NIXL checks its real registration)
        return Register(
            decode_id=msg.agent_name, prefill_id=self.name, session=SESSION, lease_ms=0, endpoint=msg.endpoint,
            engine_rank=msg.engine_rank, tp_size=msg.tp_size, page_size=a.page_size, kv_dtype=a.kv_dtype,
            mem_kind=a.mem_kind, is_mla=a.is_mla, gpu_id=msg.gpu_id, kv_ptrs=msg.kv_ptrs,
            kv_lens=(msg.kv_item_len * pages,) * n, kv_item_lens=(msg.kv_item_len,) * n, kv_layer_ids=a.layer_ids,
            aux_ptrs=msg.aux_ptrs, aux_lens=tuple(int(i) * INT32_ROWS for i in a.aux_item_lens[:len(msg.aux_ptrs)]),
            aux_item_lens=tuple(int(i) for i in a.aux_item_lens[:len(msg.aux_ptrs)]), scratch_ptr=0, scratch_len=0,
            kv_head_num=a.kv_head_num, total_kv_head_num=a.total_kv_head_num, state_type="none", state_ptrs=(),
            state_lens=(), state_item_lens=(), state_layer_ids=(), state_dims=(), state_outer=(),
            agent_metadata=msg.agent_metadata)

    def _on_sglang_info(self, msg: SglangTransferInfo, now: float) -> None:
        info = TransferInfo(
            room=msg.room, epoch=0, decode_id=msg.agent_name, prefill_id=self.name, aux_index=msg.aux_index,
            required_dst_info_num=msg.required_dst_info_num, is_dummy=msg.is_dummy, write_aux=not msg.is_dummy,
            decode_prefix_len=0, dst_pages=msg.dst_pages, dst_state_indices=msg.state_indices)
        refused = STATE_REFUSED if msg.state_indices.size else None
        if msg.aux_index < 0 and not msg.is_dummy:
            refused = "aux index -1: on the SGLang wire every room carries its metadata row"
        kept = self._registrations.get(info.decode_id)
        if info.decode_id not in self.peers and kept is not None and not self.closing:
            log.info("SGLang decode %s was dropped and sends again: connecting it anew", info.decode_id[:8])
            self.stats["sglang_reconnects"] += 1
            self._on_sglang_register(kept, now)
        peer = self.peers.get(info.decode_id)
        if peer is not None and peer.phase is PeerPhase.CONNECTING:
            held = self._connecting_infos.setdefault(peer.name, [])
            nbytes = info.dst_pages.nbytes + info.dst_state_indices.nbytes
            if len(held) < MAX_HELD and self._held_bytes + nbytes <= self.config.max_early_bytes:
                held.append((info, refused))
                self._held_bytes += nbytes
            else:
                self._drop("held", f"room {info.room}: {len(held)} destinations of {peer.name[:8]} wait already "
                                   f"({self._held_bytes} bytes held, max_early_bytes {self.config.max_early_bytes})")
            return
        self._on_transfer_info(info, now, refused)

    def peer_connected(self, peer: DecodePeer, error: BaseException | None, now: float) -> None:
        super().peer_connected(peer, error, now)
        held = self._connecting_infos.pop(peer.name, [])
        self._held_bytes -= sum(info.dst_pages.nbytes + info.dst_state_indices.nbytes for info, _ in held)
        if peer.phase is PeerPhase.CONNECTED and self.peers.get(peer.name) is peer:
            for info, refused in held:
                self._on_transfer_info(info, now, refused)
            return
        if error is not None:  # (a registration that cannot connect is not retried)
            self._registrations.pop(peer.name, None)
        if held:
            self._drop("held", f"{len(held)} destinations of {peer.name[:8]}, which did not connect")

    # -- what differs from asynckv's wire ----------------------------------------------------

    def _plan_peer(self, reg: Register) -> PeerPlan:
        return plan_peer(self.kv_args, reg, max_rows=None)  # its pool size is unknown (see _as_register)

    def _new_peer(self, reg: Register, plan: PeerPlan, now: float) -> DecodePeer:
        peer = DecodePeer.from_register(reg, plan, now, math.inf, self.kv_args.tp_size)
        peer.pool_known = False
        return peer

    def _watch(self, peer: DecodePeer, now: float) -> None:
        """No heartbeat (SGLang's decode answers no pings) and no lease: its writes are bounded by their
        deadlines, and by NIXL's errors once that decode is gone."""
        self._emit(SetLease(peer.name, math.inf))

    def _notification(self, q: Queued) -> bytes:
        room = q.room
        if q.kind == "aux":
            return aux_notification(room.room)
        if q.kind == "kv":
            last = room.last_queued and q.chunk == room.chunks - 1
            return kv_notification(room.room, q.chunk, last, self.kv_args.pp_rank)
        return b""  # (state never reaches a write: refused on arrival)

    def _emit(self, action: Action) -> None:
        """A stock SGLang decode hears nothing over ZMQ: replies are logged and counted instead."""
        if isinstance(action, Send):
            msg: Any = action.msg
            if isinstance(msg, RegisterResult) and not msg.ok:
                log.warning("refused SGLang decode %s: %s", msg.decode_id[:8], msg.reason)
            elif isinstance(msg, Status) and not msg.ok:
                self.stats["sglang_failures_untold"] += 1
            return
        super()._emit(action)

    # -- sender API ----------------------------------------------------------------------------

    def sender_init(self, room: SenderRoom, num_pages: Any, aux_index: Any, now: float) -> None:
        if num_pages == 0:
            raise InvalidArgument(f"room {room.room}: num_pages 0: SGLang's decode completes a room on its "
                                  f"KV notifications, so a room sends at least one page on the SGLang wire")
        if aux_index == -1:
            raise InvalidArgument(f"room {room.room}: aux_index -1: SGLang's decode completes a room only once "
                                  f"its metadata row arrived, so every room sends one on the SGLang wire")
        super().sender_init(room, num_pages, aux_index, now)

    def send_chunk(self, room: SenderRoom, page_indices: Any, state_indices: Any, now: float) -> int | None:
        if page_indices is not None and hasattr(page_indices, "__len__") and len(page_indices) == 0:
            raise InvalidArgument(f"room {room.room}: an empty chunk: SGLang's decode counts one notification "
                                  f"per chunk, so every chunk carries pages on the SGLang wire")
        if state_indices is not None:
            raise InvalidArgument(f"room {room.room}: {STATE_REFUSED}")
        return super().send_chunk(room, page_indices, state_indices, now)

    def room_counts(self) -> dict[str, int]:
        counts = super().room_counts()
        counts["connecting_destinations"] = sum(len(v) for v in self._connecting_infos.values())
        return counts
