"""What SGLang's objects say about a rank, as asynckv takes it (its ``KVArgs``, 0.5.10's or 0.5.23's,
its parallelism, its hybrid-state indices, the settings this backend refuses), and what SGLang reads
back (``PrefillInfo``, ``SglangTransferError``)."""

from __future__ import annotations

import os
from typing import Any, cast

import numpy as np

from ...errors import AsyncKVError
from ...layout import KVArgs as AsynckvArgs
from ...layout import MemKind, StateType

__all__ = ["PrefillInfo", "SglangTransferError", "as_state_indices", "asynckv_args", "bootstrap_host", "client_host",
           "local_ip", "refuse_unsupported"]


def parallelism(server_args: Any) -> tuple[int, int, int, int]:
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


def hybrid_state(args: Any) -> tuple[str, list[int], list[int], list[int], Any]:
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
    tp_size, tp_rank, dp_size, dp_rank = parallelism(server_args)
    mem_kind = cast(MemKind, os.environ.get("ASYNCKV_MEM_KIND") or memory_kind())
    kind, state_ptrs, state_lens, state_items, state_dims = hybrid_state(args)
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
        kv_dtype=str(getattr(args, "kv_cache_dtype_str", None) or getattr(server_args, "kv_cache_dtype", "auto")),
        kv_layer_ids=list(layer_ids) if layer_ids else None,
        prefill_start_layer=int(getattr(args, "prefill_start_layer", 0) or 0), state_type=state_type,
        state_data_ptrs=state_ptrs, state_data_lens=state_lens, state_item_lens=state_items,
        state_dim_per_tensor=state_dims if state_type == "mamba" else None)


def as_state_indices(value: Any) -> Any:
    """A room's hybrid-state indices as asynckv takes them: 0.5.10 passes one list; 0.5.23 one list per
    state kind (``[payload for each kind]``), of which asynckv takes exactly one."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)) and value and all(
            isinstance(v, (list, tuple, np.ndarray)) or v is None for v in value):
        if len(value) != 1:
            raise AsyncKVError(f"state_indices for {len(value)} state kinds: asynckv's SGLang backend takes one")
        value = value[0]
        if value is None:
            return None
    if isinstance(value, (list, tuple)) and not value:
        return None
    return np.asarray(value, dtype=np.int64).reshape(-1).copy()


def memory_kind() -> str:
    try:
        import torch
    except ImportError:
        return "DRAM"
    return "VRAM" if torch.cuda.is_available() else "DRAM"


def client_host(host: str) -> str:
    return "127.0.0.1" if host in ("", "0.0.0.0", "::") else host


_REFUSED_ENV = {
    "SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX": "early sends of the cached prefix wait on an event "
                                                      "asynckv does not observe",
    "SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK": "DP-rank queries: asynckv routes room r to DP rank "
                                                         "r % dp_size",
}


def refuse_unsupported(server_args: Any, prefill: bool) -> None:
    """Refuse, at start-up and naming it, an SGLang setting this backend cannot honour."""
    for name, why in _REFUSED_ENV.items():
        if os.environ.get(name, "").lower() in ("1", "true", "yes", "on"):
            raise AsyncKVError(f"{name} is set: not supported with --disaggregation-transfer-backend asynckv ({why})")
    method = getattr(server_args, "load_balance_method", None)
    dp = int(getattr(server_args, "dp_size", 1) or 1)
    if prefill and dp > 1 and method not in (None, "auto", "follow_bootstrap_room"):
        raise AsyncKVError(f"--load-balance-method {method} with dp_size {dp}: asynckv's decode sends room r to "
                           f"prefill DP rank r % dp_size; use follow_bootstrap_room")


def bootstrap_host(server_args: Any) -> str:
    dist = getattr(server_args, "dist_init_addr", None)
    if dist:  # multi-node: the bootstrap server runs on the node of dist_init_addr (as SGLang's does)
        return str(dist).rsplit(":", 1)[0].strip("[]")
    return str(server_args.host)


def local_ip() -> str:
    try:
        from sglang.srt.utils import getlocal_ip_auto
    except ImportError:
        return "127.0.0.1"
    return str(getlocal_ip_auto())


class SglangTransferError(RuntimeError):
    """What ``failure_exception()`` raises: asynckv's reason, with its exception as the cause.
    ``failure_reason`` and ``is_from_another_rank`` are what SGLang 0.5.23 reads to log it."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.failure_reason = message
        self.is_from_another_rank = "another TP rank" in message


class PrefillInfo:
    """What SGLang's decode scheduler reads from ``prefill_info_table``."""

    __slots__ = ("dp_size", "follow_bootstrap_room", "tp_size")

    def __init__(self, dp_size: int, tp_size: int) -> None:
        self.dp_size = dp_size
        self.tp_size = tp_size
        self.follow_bootstrap_room = True  # asynckv routes room r to DP rank r % dp_size
