"""SGLang's backend interface on asynckv: the manager, sender, receiver and bootstrap-server classes
(see the package docstring for what they promise)."""

from __future__ import annotations

import logging
import os
from typing import Any, cast

import numpy as np
from sglang.srt.disaggregation.base.conn import (
    BaseKVBootstrapServer,
    BaseKVManager,
    BaseKVReceiver,
    BaseKVSender,
    KVArgs,
)

from ...config import Config
from ...errors import AsyncKVError
from ...layout import KVArgs as AsynckvArgs
from ...layout import MemKind, StateType
from ...proto.states import KVPoll as Poll
from ...service.bootstrap import BootstrapServer
from ...service.manager import KVManager, Mode
from ...service.receiver import KVReceiver
from ...service.sender import KVSender
from ..loop_thread import LoopThread
from ..poll_state import PollState

__all__ = [
    "CLASSES",
    "AsynckvKVBootstrapServer",
    "AsynckvKVManager",
    "AsynckvKVReceiver",
    "AsynckvKVSender",
    "SglangTransferError",
    "asynckv_args",
]

log = logging.getLogger("asynckv.sglang")

START_TIMEOUT_S = 120.0


class SglangTransferError(RuntimeError):
    """What ``failure_exception()`` raises: asynckv's reason, with its exception as the cause."""


# -- the manager -----------------------------------------------------------------------------


def _parallelism(server_args: Any) -> tuple[int, int, int, int]:
    """(attention TP size, attention TP rank, attention DP size, attention DP rank) of this rank, as
    SGLang's own accessors say: 0.5.23's runtime context, 0.5.10's ``dp_attention`` functions (which
    read the process groups the scheduler made)."""
    try:
        from sglang.srt import runtime_context
    except ImportError:
        from sglang.srt.layers import dp_attention

        return (dp_attention.get_attention_tp_size(), dp_attention.get_attention_tp_rank(),
                dp_attention.get_attention_dp_size(), dp_attention.get_attention_dp_rank())
    p = runtime_context.get_parallel()
    return int(p.attn_tp_size), int(p.attn_tp_rank), int(p.attn_dp_size), int(p.attn_dp_rank)


def _state(args: Any) -> tuple[str, list[int], list[int], list[int], Any]:
    """(type, pointers, lengths, item lengths, dims) of the hybrid state: 0.5.10 has one state kind
    (``state_type``); 0.5.23 lists several (``state_types``, lists of lists), taken when it is one."""
    if hasattr(args, "state_types"):  # SGLang 0.5.23
        kinds = [str(getattr(k, "value", k)) for k in (getattr(args, "state_types", None) or [])]
        if not kinds:
            return "none", [], [], [], None
        if len(kinds) > 1:
            raise AsyncKVError(f"state_types {kinds}: more than one hybrid state kind per rank is not supported by "
                               f"asynckv's SGLang backend")
        dims = (getattr(args, "state_dim_per_tensor", None) or [None])[0]
        return (kinds[0], list(args.state_data_ptrs[0]), list(args.state_data_lens[0]), list(args.state_item_lens[0]),
                dims)
    kind = getattr(args, "state_type", "none") or "none"
    return (kind, list(getattr(args, "state_data_ptrs", []) or []), list(getattr(args, "state_data_lens", []) or []),
            list(getattr(args, "state_item_lens", []) or []), getattr(args, "state_dim_per_tensor", None))


def asynckv_args(args: Any, server_args: Any, is_mla: bool) -> AsynckvArgs:
    """SGLang's ``KVArgs`` (plain attributes the scheduler set; 0.5.10's or 0.5.23's) as asynckv's."""
    tp_size, tp_rank, dp_size, dp_rank = _parallelism(server_args)
    mem_kind = cast(MemKind, os.environ.get("ASYNCKV_MEM_KIND") or _memory_kind())
    kind, state_ptrs, state_lens, state_items, state_dims = _state(args)
    state_type = cast(StateType, kind)  # (KVArgs checks both)
    layer_ids = getattr(args, "kv_layer_ids", None)
    return AsynckvArgs(
        kv_data_ptrs=list(args.kv_data_ptrs), kv_data_lens=list(args.kv_data_lens),
        kv_item_lens=list(args.kv_item_lens), page_size=int(args.page_size),
        aux_data_ptrs=list(args.aux_data_ptrs), aux_data_lens=list(args.aux_data_lens),
        aux_item_lens=list(args.aux_item_lens), engine_rank=tp_rank, tp_size=tp_size,
        pp_rank=int(getattr(args, "pp_rank", 0) or 0), pp_size=int(getattr(server_args, "pp_size", 1) or 1),
        dp_rank=dp_rank, dp_size=dp_size, gpu_id=int(getattr(args, "gpu_id", 0) or 0), mem_kind=mem_kind,
        is_mla=bool(is_mla), kv_head_num=int(getattr(args, "kv_head_num", 1) or 1),
        total_kv_head_num=int(getattr(args, "total_kv_head_num", 1) or 1),
        kv_dtype=str(getattr(server_args, "kv_cache_dtype", "auto")),
        kv_layer_ids=list(layer_ids) if layer_ids else None,
        prefill_start_layer=int(getattr(args, "prefill_start_layer", 0) or 0), state_type=state_type,
        state_data_ptrs=state_ptrs, state_data_lens=state_lens, state_item_lens=state_items,
        state_dim_per_tensor=state_dims if state_type == "mamba" else None)


def _memory_kind() -> str:
    try:
        import torch
    except ImportError:
        return "DRAM"
    return "VRAM" if torch.cuda.is_available() else "DRAM"


def _client_host(host: str) -> str:
    return "127.0.0.1" if host in ("", "0.0.0.0", "::") else host


class _PrefillInfo:
    """What SGLang's decode scheduler reads from ``prefill_info_table``."""

    __slots__ = ("dp_size", "follow_bootstrap_room", "tp_size")

    def __init__(self, dp_size: int, tp_size: int) -> None:
        self.dp_size = dp_size
        self.tp_size = tp_size
        self.follow_bootstrap_room = True  # asynckv routes room r to DP rank r % dp_size


class AsynckvKVManager(BaseKVManager):  # type: ignore[misc]
    """One asynckv ``KVManager`` per scheduler (TP rank) process, on the background loop."""

    def __init__(self, args: KVArgs, disaggregation_mode: Any, server_args: Any,
                 is_mla_backend: bool | None = False) -> None:
        self.kv_args = args
        self.server_args = server_args
        self.is_mla_backend = bool(is_mla_backend)
        self.disaggregation_mode = disaggregation_mode
        self.thread = LoopThread.shared()
        prefill = getattr(disaggregation_mode, "value", disaggregation_mode) == "prefill"
        host = os.environ.get("ASYNCKV_HOST") or _local_ip()
        config = Config.from_env(host=host, host_bootstrap=False)
        bootstrap = f"{_client_host(_bootstrap_host(server_args))}:{server_args.disaggregation_bootstrap_port}"
        self.manager = KVManager(Mode.PREFILL if prefill else Mode.DECODE,
                                 asynckv_args(args, server_args, self.is_mla_backend),
                                 bootstrap_addr=bootstrap if prefill else None, config=config)
        self.thread.run(self.manager.start(), START_TIMEOUT_S)
        self.prefill_info_table: dict[str, _PrefillInfo] = {}
        """Decode: prefill instances looked up (SGLang's decode scheduler reads ``dp_size`` and
        ``follow_bootstrap_room`` from it)."""
        self._looking_up: set[str] = set()
        self._lookup_errors: dict[str, BaseException] = {}

    def should_verify_kv_checksum(self, bootstrap_addr: str) -> bool:
        """SGLang 0.5.23 compares a checksum prefill computed over its KV with one over ours: only
        comparable when both sides hold the same heads (equal TP)."""
        info = self.prefill_info_table.get(bootstrap_addr)
        return info is not None and info.tp_size == self.manager.kv_args.tp_size

    def register_to_bootstrap(self) -> None:
        """Done by the prefill manager when it starts (and renewed until it closes)."""

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """Decode: whether the prefill at ``bootstrap_addr`` is known; if not, start looking it up
        (never blocks: the scheduler calls again on a later iteration)."""
        if bootstrap_addr in self.prefill_info_table:
            return True
        if bootstrap_addr not in self._looking_up:
            self._looking_up.add(bootstrap_addr)
            self.thread.submit(self._look_up, bootstrap_addr)
        return False

    def _look_up(self, addr: str) -> None:
        task = self.manager.loop.create_task(self.manager.prefill_instance(addr))

        def done(task: Any) -> None:
            self._looking_up.discard(addr)
            if task.cancelled():
                return
            error = task.exception()
            if error is None:
                self.prefill_info_table[addr] = _PrefillInfo(task.result().dp_size, task.result().tp_size)
            else:
                self._lookup_errors[addr] = error
                log.warning("prefill at %s: %s", addr, error)

        task.add_done_callback(done)

    enable_deferred_decode_kv_release = False
    """SGLang 0.5.23's deferred release of an aborted room's pages is not needed: asynckv reports a
    room Failed only once no prefill can still write into its pages (its fence)."""

    def close(self) -> None:
        """Close the asynckv manager (SGLang 0.5.23 calls ``teardown()``; 0.5.10 has no such call)."""
        self.thread.run(self.manager.close(), START_TIMEOUT_S)

    def teardown(self) -> None:
        self.close()


def _bootstrap_host(server_args: Any) -> str:
    dist = getattr(server_args, "dist_init_addr", None)
    if dist:  # multi-node: the bootstrap server runs on the node of dist_init_addr (as SGLang's does)
        return str(dist).rsplit(":", 1)[0].strip("[]")
    return str(server_args.host)


def _local_ip() -> str:
    try:
        from sglang.srt.utils import get_local_ip_auto
    except ImportError:
        return "127.0.0.1"
    return str(get_local_ip_auto())


# -- senders and receivers -----------------------------------------------------------------------


class AsynckvKVSender(BaseKVSender):  # type: ignore[misc]
    """The prefill side of one request; every call returns at once (the loop does the work)."""

    def __init__(self, mgr: AsynckvKVManager, bootstrap_addr: str, bootstrap_room: int,
                 dest_tp_ranks: list[int] | None = None, pp_rank: int = 0,
                 req_has_disagg_prefill_dp_rank: bool = False) -> None:
        # (0.5.10 passes dest_tp_ranks and pp_rank, 0.5.23 req_has_disagg_prefill_dp_rank: asynckv maps
        # ranks itself, from both sides' registrations)
        self.mgr = mgr
        self.bootstrap_room = bootstrap_room
        self._room = PollState()
        self._view: KVSender | None = None
        self._prefix_taken = False
        mgr.thread.submit(self._open)

    def _open(self) -> None:
        try:
            view = self._view = self.mgr.manager.sender(self.bootstrap_room)
        except Exception as exc:
            self._room.advance(Poll.Failed, exc)
            return
        view.on_ready(lambda poll: self._room.advance(int(poll), view.failure_exception()))
        view.on_done(lambda poll: self._room.advance(int(poll), view.failure_exception()))

    def _on_loop(self, fn: Any, *args: Any) -> None:
        """Run ``fn(view, *args)`` on the loop; an error fails the room with it."""
        def run() -> None:
            view = self._view
            if view is None:
                return  # (the room failed to open: poll() says Failed already)
            try:
                fn(view, *args)
            except Exception as exc:
                self._room.advance(Poll.Failed, exc)
                view.abort(str(exc))

        self.mgr.thread.submit(run)

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        self._on_loop(KVSender.init, int(num_kv_indices), -1 if aux_index is None else int(aux_index))

    def send(self, kv_indices: Any, state_indices: Any = None, num_kv_tokens: int | None = None) -> None:
        self._room.advance(Poll.Transferring)
        pages = np.asarray(kv_indices, dtype=np.int64).copy()  # (the scheduler may reuse its array)
        state = None if state_indices is None else np.asarray(state_indices, dtype=np.int64).copy()
        self._on_loop(KVSender.send_nowait, pages, state)

    def poll(self) -> int:
        return self._room.state

    def pop_decode_prefix_len(self) -> int:
        """Tokens decode already holds (SGLang 0.5.23 asks once, after WaitingForInput)."""
        view = self._view
        if view is None or self._prefix_taken:
            return 0
        self._prefix_taken = True
        return int(view.decode_prefix_len)

    def get_transfer_metric(self) -> Any:
        """SGLang 0.5.23's per-request metric: asynckv's are in its own metrics (``/metrics``)."""
        from sglang.srt.disaggregation.base.conn import KVTransferMetric

        return KVTransferMetric()

    def failure_exception(self) -> None:
        self._room.raise_failure(f"asynckv room {self.bootstrap_room}", SglangTransferError)

    def abort(self) -> None:
        self._room.advance(Poll.Failed, AsyncKVError("aborted by the scheduler"))
        self._on_loop(KVSender.abort, "aborted by the scheduler")

    def clear(self) -> None:
        self._on_loop(KVSender.clear)


class AsynckvKVReceiver(BaseKVReceiver):  # type: ignore[misc]
    """The decode side of one request; every call returns at once (the loop does the work)."""

    require_staging = False
    """SGLang's decode scheduler reads it: asynckv never stages."""
    abort_notified = False
    """SGLang 0.5.23's deferred release reads it (never armed: see ``enable_deferred_decode_kv_release``)."""
    bootstrap_infos: tuple[Any, ...] = ()

    def __init__(self, mgr: AsynckvKVManager, bootstrap_addr: str, bootstrap_room: int | None = None,
                 prefill_dp_rank: int | None = None) -> None:
        self.mgr = self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_room = int(bootstrap_room or 0)
        self._room = PollState()
        self._view: KVReceiver | None = None
        mgr.thread.submit(self._open)

    def _open(self) -> None:
        try:
            self._view = self.mgr.manager.receiver(self.bootstrap_addr, self.bootstrap_room)
        except Exception as exc:
            self._room.advance(Poll.Failed, exc)

    def init(self, prefill_dp_rank: int | None = None) -> None:
        """Look the prefill up (asynckv maps the room to its DP rank itself); WaitingForInput follows."""
        self.mgr.thread.submit(self._resolve)

    def _resolve(self) -> None:
        mgr = self.mgr
        task = mgr.manager.loop.create_task(mgr.manager.prefill_instance(self.bootstrap_addr))

        def done(task: Any) -> None:
            if task.cancelled():
                self._room.advance(Poll.Failed, AsyncKVError("look-up cancelled"))
            elif task.exception() is not None:
                self._room.advance(Poll.Failed, task.exception())
            else:
                self._room.advance(Poll.WaitingForInput)

        task.add_done_callback(done)

    def send_metadata(self, kv_indices: Any, aux_index: int | None = None, state_indices: Any = None,
                      decode_prefix_len: int | None = None, destination: Any = None) -> None:
        self._room.advance(Poll.Transferring)
        pages = np.asarray(kv_indices, dtype=np.int64).copy()
        state = None if state_indices is None else np.asarray(state_indices, dtype=np.int64).copy()
        aux = -1 if aux_index is None else int(aux_index)
        if destination is not None and str(getattr(destination, "value", destination)) != "device":
            self._room.advance(Poll.Failed, AsyncKVError(f"destination {destination}: asynckv writes device "
                                                         f"(pool) pages only; host destinations are not supported"))
            return
        self.mgr.thread.submit(self._start, pages, aux, state, int(decode_prefix_len or 0))

    @property
    def conclude_state(self) -> int | None:
        """The outcome once decided (SGLang 0.5.23 reads it), else None."""
        state = self._room.state
        return state if state in (Poll.Success, Poll.Failed) else None

    def _start(self, pages: Any, aux: int, state: Any, prefix: int) -> None:
        view = self._view
        if view is None:
            return
        try:
            view.init_nowait(pages, aux, state, prefix)
        except Exception as exc:
            self._room.advance(Poll.Failed, exc)
            view.abort_nowait(str(exc))
            return
        view.on_done(lambda poll: self._room.advance(int(poll), view.failure_exception()))

    def poll(self) -> int:
        return self._room.state

    def failure_exception(self) -> None:
        self._room.raise_failure(f"asynckv room {self.bootstrap_room}", SglangTransferError)

    def abort(self) -> None:
        self._room.advance(Poll.Failed, AsyncKVError("aborted by the scheduler"))
        self.mgr.thread.submit(self._abort)

    def _abort(self) -> None:
        if self._view is not None:
            self._view.abort_nowait("aborted by the scheduler")

    def clear(self) -> None:
        self.mgr.thread.submit(self._clear)

    def _clear(self) -> None:
        if self._view is not None:
            self._view.clear()


class AsynckvKVBootstrapServer(BaseKVBootstrapServer):  # type: ignore[misc]
    """asynckv's bootstrap server, on the background loop of the process that builds it (SGLang's
    tokenizer manager)."""

    def __init__(self, host: str, port: int) -> None:
        config = Config.from_env()
        self.thread = LoopThread.shared()
        self.server = BootstrapServer(host or "0.0.0.0", port, config.auth_token,
                                      allow_unauthenticated=config.allow_unauthenticated)
        self.thread.run(self.server.start(), START_TIMEOUT_S)

    def close(self) -> None:
        self.thread.run(self.server.close(), START_TIMEOUT_S)


CLASSES: dict[str, Any] = {"kvargs": KVArgs, "manager": AsynckvKVManager, "sender": AsynckvKVSender,
                           "receiver": AsynckvKVReceiver, "bootstrap_server": AsynckvKVBootstrapServer}
"""The classes SGLang's ``get_kv_class`` returns for this backend, by ``KVClassType`` value
(``KVArgs`` is SGLang's own: the scheduler fills its attributes)."""
