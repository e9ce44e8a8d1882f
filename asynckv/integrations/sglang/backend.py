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
    SGLang's own accessors say (they read the process groups the scheduler made)."""
    from sglang.srt.layers import dp_attention

    return (dp_attention.get_attention_tp_size(), dp_attention.get_attention_tp_rank(),
            dp_attention.get_attention_dp_size(), dp_attention.get_attention_dp_rank())


def asynckv_args(args: Any, server_args: Any, is_mla: bool) -> AsynckvArgs:
    """SGLang's ``KVArgs`` (plain attributes the scheduler set) as asynckv's."""
    tp_size, tp_rank, dp_size, dp_rank = _parallelism(server_args)
    mem_kind = cast(MemKind, os.environ.get("ASYNCKV_MEM_KIND") or _memory_kind())
    state_type = cast(StateType, getattr(args, "state_type", "none") or "none")  # (KVArgs checks both)
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
        prefill_start_layer=int(getattr(args, "prefill_start_layer", 0) or 0), state_type=state_type,
        state_data_ptrs=list(getattr(args, "state_data_ptrs", []) or []),
        state_data_lens=list(getattr(args, "state_data_lens", []) or []),
        state_item_lens=list(getattr(args, "state_item_lens", []) or []),
        state_dim_per_tensor=getattr(args, "state_dim_per_tensor", None) if state_type == "mamba" else None)


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

    __slots__ = ("dp_size", "follow_bootstrap_room")

    def __init__(self, dp_size: int) -> None:
        self.dp_size = dp_size
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
                self.prefill_info_table[addr] = _PrefillInfo(task.result().dp_size)
            else:
                self._lookup_errors[addr] = error
                log.warning("prefill at %s: %s", addr, error)

        task.add_done_callback(done)

    def close(self) -> None:
        """Close the asynckv manager (SGLang has no teardown call in 0.5.10; tests and ``atexit`` use it)."""
        self.thread.run(self.manager.close(), START_TIMEOUT_S)


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
                 dest_tp_ranks: list[int] | None = None, pp_rank: int = 0) -> None:
        self.mgr = mgr
        self.bootstrap_room = bootstrap_room
        self._room = PollState()
        self._view: KVSender | None = None
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

    def send(self, kv_indices: Any, state_indices: Any = None) -> None:
        self._room.advance(Poll.Transferring)
        pages = np.asarray(kv_indices, dtype=np.int64).copy()  # (the scheduler may reuse its array)
        state = None if state_indices is None else np.asarray(state_indices, dtype=np.int64).copy()
        self._on_loop(KVSender.send_nowait, pages, state)

    def poll(self) -> int:
        return self._room.state

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

    def __init__(self, mgr: AsynckvKVManager, bootstrap_addr: str, bootstrap_room: int | None = None,
                 prefill_dp_rank: int | None = None) -> None:
        self.mgr = mgr
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

    def send_metadata(self, kv_indices: Any, aux_index: int | None = None, state_indices: Any = None) -> None:
        self._room.advance(Poll.Transferring)
        pages = np.asarray(kv_indices, dtype=np.int64).copy()
        state = None if state_indices is None else np.asarray(state_indices, dtype=np.int64).copy()
        aux = -1 if aux_index is None else int(aux_index)
        self.mgr.thread.submit(self._start, pages, aux, state)

    def _start(self, pages: Any, aux: int, state: Any) -> None:
        view = self._view
        if view is None:
            return
        try:
            view.init_nowait(pages, aux, state)
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
