"""KVArgs: what one rank registers, and the geometry both sides must agree on.

An *entry* is one registered contiguous buffer ("K of layer 5"); an *item* is one page
of one entry (``kv_item_lens[i]`` bytes). MHA pools list every K entry of this stage,
then every V entry; MLA pools list one latent entry per layer. Aux buffers are indexed
by a per-request row ("aux index").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

from .errors import InvalidArgument

__all__ = ["KVArgs", "MemKind", "StateType", "entry_keys"]

MemKind = Literal["DRAM", "VRAM"]
StateType = Literal["none", "mamba", "swa", "nsa"]


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class KVArgs:
    """Buffers and geometry of one rank (mirrors the reference connector's KVArgs)."""

    kv_data_ptrs: Sequence[int]
    """Base address of each KV entry."""
    kv_data_lens: Sequence[int]
    """Total bytes of each KV entry."""
    kv_item_lens: Sequence[int]
    """Bytes of one page of each KV entry (the page stride)."""
    page_size: int
    """Tokens per page."""
    aux_data_ptrs: Sequence[int] = ()
    """Base address of each aux (per-request metadata) buffer."""
    aux_data_lens: Sequence[int] = ()
    aux_item_lens: Sequence[int] = ()
    """Bytes of one row of each aux buffer."""
    engine_rank: int = 0
    """Attention-TP rank of this process."""
    tp_size: int = 1
    """Attention-TP size of this instance."""
    pp_rank: int = 0
    pp_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    gpu_id: int = 0
    """Device ordinal, used as NIXL dev_id for VRAM entries."""
    mem_kind: MemKind = "DRAM"
    """Where the KV entries live; aux buffers are always DRAM."""
    is_mla: bool = False
    """One latent buffer per layer instead of K and V buffers."""
    kv_head_num: int = 1
    """KV heads held by this rank."""
    total_kv_head_num: int = 1
    """KV heads of the whole model."""
    kv_dtype: str = "bfloat16"
    """Element type name, compared between the two sides."""
    kv_layer_ids: Sequence[int] | None = None
    """Global model layer id of each entry; defaults to positional ids."""
    prefill_start_layer: int = 0
    """First global layer id of this PP stage (used when kv_layer_ids is not given)."""
    state_type: StateType = "none"
    """Hybrid-model state sent with the last chunk: "mamba", "swa", "nsa" or "none"."""
    state_data_ptrs: Sequence[int] = ()
    state_data_lens: Sequence[int] = ()
    state_item_lens: Sequence[int] = ()
    """mamba: bytes of one request slot; swa/nsa: bytes of one page of the state entry."""
    state_layer_ids: Sequence[int] | None = None
    """Global layer id of each state entry (pairing key, like kv_layer_ids); positional if None."""
    state_dim_per_tensor: Sequence[int] | None = None
    """mamba across TP sizes: size on this rank of each entry's sliced dimension (0: replicated)."""
    state_outer: Sequence[int] | None = None
    """mamba across TP sizes: rows before the sliced dimension of each entry (default 1)."""
    owners: tuple[Any, ...] = ()
    """Objects that own the memory (kept alive as long as these args are)."""

    def __post_init__(self) -> None:
        n = len(self.kv_data_ptrs)
        if n == 0:
            raise InvalidArgument("KVArgs needs at least one KV entry")
        if len(self.kv_data_lens) != n or len(self.kv_item_lens) != n:
            raise InvalidArgument(
                f"kv_data_ptrs/lens/item_lens lengths differ: "
                f"{n}/{len(self.kv_data_lens)}/{len(self.kv_item_lens)}")
        na = len(self.aux_data_ptrs)
        if len(self.aux_data_lens) != na or len(self.aux_item_lens) != na:
            raise InvalidArgument("aux_data_ptrs/lens/item_lens lengths differ")
        for what, lens, items in (("kv", self.kv_data_lens, self.kv_item_lens),
                                  ("aux", self.aux_data_lens, self.aux_item_lens)):
            for i, (length, item) in enumerate(zip(lens, items, strict=True)):
                if item <= 0 or length < item:
                    raise InvalidArgument(
                        f"{what} entry {i}: item_len {item} must be > 0 and <= data_len {length}")
        if self.page_size <= 0:
            raise InvalidArgument(f"page_size must be > 0, got {self.page_size}")
        if not self.is_mla and n % 2:
            raise InvalidArgument(f"MHA needs K and V entries (an even count), got {n}")
        if self.mem_kind not in ("DRAM", "VRAM"):
            raise InvalidArgument(f"mem_kind must be 'DRAM' or 'VRAM', got {self.mem_kind!r}")
        if not 0 <= self.engine_rank < self.tp_size:
            raise InvalidArgument(f"engine_rank {self.engine_rank} not in [0, tp_size={self.tp_size})")
        if not 0 <= self.pp_rank < self.pp_size or not 0 <= self.dp_rank < self.dp_size:
            raise InvalidArgument("pp_rank/dp_rank out of range of pp_size/dp_size")
        if self.kv_layer_ids is not None and len(self.kv_layer_ids) != n:
            raise InvalidArgument("kv_layer_ids must have one id per KV entry")
        if self.kv_head_num < 1 or self.total_kv_head_num < 1:
            raise InvalidArgument("kv_head_num and total_kv_head_num must be >= 1")
        if self.state_type not in ("none", "mamba", "swa", "nsa"):
            raise InvalidArgument(f"state_type must be none, mamba, swa or nsa, got {self.state_type!r}")
        ns = len(self.state_data_ptrs)
        if len(self.state_data_lens) != ns or len(self.state_item_lens) != ns:
            raise InvalidArgument("state_data_ptrs/lens/item_lens lengths differ")
        if (self.state_type == "none") != (ns == 0):
            raise InvalidArgument(f"state_type {self.state_type!r} with {ns} state entries")
        for name in ("state_layer_ids", "state_dim_per_tensor", "state_outer"):
            value = getattr(self, name)
            if value is not None and len(value) != ns:
                raise InvalidArgument(f"{name} must have one value per state entry")
        for i, (length, item) in enumerate(zip(self.state_data_lens, self.state_item_lens, strict=True)):
            if item <= 0 or length < item:
                raise InvalidArgument(f"state entry {i}: item_len {item} must be > 0 and <= data_len {length}")

    @property
    def num_entries(self) -> int:
        return len(self.kv_data_ptrs)

    @property
    def num_pages(self) -> int:
        """Pages addressable in every entry (the smallest entry bounds the index range)."""
        return min(length // item for length, item in zip(self.kv_data_lens, self.kv_item_lens, strict=True))

    @property
    def num_aux_rows(self) -> int:
        """Rows addressable in every aux buffer (0 when there are no aux buffers)."""
        if not self.aux_data_ptrs:
            return 0
        return min(length // item for length, item in zip(self.aux_data_lens, self.aux_item_lens, strict=True))

    @property
    def layer_ids(self) -> tuple[int, ...]:
        """Global layer id of each entry (K entries then V entries share ids for MHA)."""
        if self.kv_layer_ids is not None:
            return tuple(int(x) for x in self.kv_layer_ids)
        per_kind = self.num_entries if self.is_mla else self.num_entries // 2
        ids = tuple(self.prefill_start_layer + i for i in range(per_kind))
        return ids if self.is_mla else ids + ids

    @property
    def state_split_by_tp(self) -> bool:
        """Each TP rank holds a slice of the state of its own (mamba entries with a sliced dimension):
        ranks that replicate KV heads still differ in it."""
        dims = self.state_dim_per_tensor
        return self.state_type == "mamba" and bool(self.state_data_ptrs) and (dims is None or any(dims))

    @property
    def num_state_slots(self) -> int:
        """Slots (mamba) or pages (swa/nsa) addressable in every state entry."""
        if not self.state_data_ptrs:
            return 0
        return min(n // i for n, i in zip(self.state_data_lens, self.state_item_lens, strict=True))

    def kv_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ptrs, lens, item_lens) as uint64 arrays for the kernels."""
        return (np.asarray(self.kv_data_ptrs, dtype=np.uint64),
                np.asarray(self.kv_data_lens, dtype=np.uint64),
                np.asarray(self.kv_item_lens, dtype=np.uint64))

    @classmethod
    def from_arrays(cls, kv: Sequence[np.ndarray] | np.ndarray, *, page_size: int,
                    aux: Sequence[np.ndarray] = (), state: Sequence[np.ndarray] = (), **fields: Any) -> KVArgs:
        """Build KVArgs from numpy arrays whose first axis is the page (aux: the row).

        ``kv`` is a list of per-entry arrays or one array whose first axis is the entry.
        Every array must be C-contiguous. Torch tensors work too (anything with
        ``data_ptr()``, ``nbytes`` and ``shape``/``stride`` in bytes via ``element_size``).
        """
        entries = [kv[i] for i in range(len(kv))]
        if not entries:
            raise InvalidArgument("KVArgs.from_arrays needs at least one KV array")
        ptrs, lens, items = zip(*(_describe(a, f"kv[{i}]") for i, a in enumerate(entries)), strict=True)
        aux_desc = [_describe(a, f"aux[{i}]") for i, a in enumerate(aux)]
        state_desc = [_describe(a, f"state[{i}]") for i, a in enumerate(state)]
        return cls(kv_data_ptrs=list(ptrs), kv_data_lens=list(lens), kv_item_lens=list(items),
                   aux_data_ptrs=[d[0] for d in aux_desc], aux_data_lens=[d[1] for d in aux_desc],
                   aux_item_lens=[d[2] for d in aux_desc], page_size=page_size,
                   state_data_ptrs=[d[0] for d in state_desc], state_data_lens=[d[1] for d in state_desc],
                   state_item_lens=[d[2] for d in state_desc],
                   owners=(kv, tuple(aux), tuple(state)), **fields)


def _describe(a: Any, what: str) -> tuple[int, int, int]:
    """(address, total bytes, bytes per first-axis row) of an array or tensor."""
    if isinstance(a, np.ndarray):
        if not a.flags.c_contiguous or a.ndim < 1 or a.shape[0] == 0:
            raise InvalidArgument(f"{what} must be a non-empty C-contiguous array")
        return int(a.ctypes.data), int(a.nbytes), int(a.nbytes // a.shape[0])
    if hasattr(a, "data_ptr") and hasattr(a, "element_size"):
        if not a.is_contiguous() or a.dim() < 1 or a.shape[0] == 0:
            raise InvalidArgument(f"{what} must be a non-empty contiguous tensor")
        nbytes = int(a.numel() * a.element_size())
        return int(a.data_ptr()), nbytes, nbytes // int(a.shape[0])
    raise InvalidArgument(f"{what}: expected a numpy array or a tensor, got {type(a).__name__}")


def entry_keys(layer_ids: Sequence[int]) -> list[tuple[int, int]]:
    """Pairing key of each entry: (global layer id, occurrence of that id so far).

    MHA lists K entries then V entries, so K of layer 5 is (5, 0) and V of layer 5 is
    (5, 1) on both sides, whatever slice of the model each side holds; draft (speculative)
    entries appended after the target's keep their own layer ids.
    """
    seen: dict[int, int] = {}
    keys = []
    for layer in layer_ids:
        occurrence = seen.get(int(layer), 0)
        seen[int(layer)] = occurrence + 1
        keys.append((int(layer), occurrence))
    return keys
