"""A numpy reference model of one model's KV cache, sharded for prefill and decode ranks.

Every element of the full cache has a distinct value derived from (kind, layer, logical
page, token, head, element), so a byte landing anywhere but its place shows up. Each rank
is a real KVManager with its own NIXL agent; several ranks share this process.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

from asynckv import BootstrapServer, Config, KVArgs, KVManager, KVPoll, Mode

from .conftest import CONTROL

DTYPE = np.uint16


def model_values(kind: int, layer: int, pages: np.ndarray, page_size: int, heads: np.ndarray, dim: int,
                 seed: int) -> np.ndarray:
    """Values of logical ``pages`` of one (kind, layer): shape [pages, tokens, heads, dim]."""
    p = pages.astype(np.uint64)[:, None, None, None]
    t = np.arange(page_size, dtype=np.uint64)[None, :, None, None]
    h = heads.astype(np.uint64)[None, None, :, None]
    d = np.arange(dim, dtype=np.uint64)[None, None, None, :]
    with np.errstate(over="ignore"):
        x = (np.uint64(seed) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(kind * 1_000_003 + layer * 7919)
             + p * np.uint64(104729) + t * np.uint64(1299709) + h * np.uint64(15485863) + d)
        x ^= x >> np.uint64(29)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(32)
    values: np.ndarray = (x & np.uint64(0xFFFF)).astype(DTYPE)
    return values


@dataclasses.dataclass(frozen=True)
class Layout:
    tp_prefill: int
    tp_decode: int
    heads: int
    pp_prefill: int = 1
    pp_decode: int = 1
    mla: bool = False
    layers: int = 4
    head_dim: int = 16
    page_size: int = 4
    pages: int = 24
    state: str = "none"
    """"none", "mamba", "swa" or "nsa"."""
    draft_layers: int = 0

    def heads_on(self, tp: int, rank: int) -> np.ndarray:
        if self.mla:
            return np.arange(1)
        per = max(1, self.heads // tp)
        group = rank // max(1, tp // self.heads)
        return np.arange(group * per, (group + 1) * per)

    def layers_on(self, pp: int, stage: int) -> list[int]:
        per = self.layers // pp
        return list(range(stage * per, (stage + 1) * per))

    def kinds(self) -> list[int]:
        return [0] if self.mla else [0, 1]


@dataclasses.dataclass
class Rank:
    tp: int
    pp: int
    layer_ids: list[int]
    heads: np.ndarray
    kv: list[np.ndarray]
    """One [pages, tokens, heads, dim] array per entry."""
    entry_keys: list[tuple[int, int]]
    """(kind, layer) of each entry."""
    aux: np.ndarray
    state: list[np.ndarray]
    state_keys: list[tuple[int, int]]
    args: KVArgs
    mgr: KVManager | None = None


MAMBA_DIM, MAMBA_OUTER, MAMBA_ELEM = 8, 2, 4  # sliced dim per full model, rows before it, element bytes


def build_rank(lay: Layout, tp_size: int, tp: int, pp_size: int, pp: int) -> Rank:
    heads = lay.heads_on(tp_size, tp)
    layers = lay.layers_on(pp_size, pp)
    draft = list(range(lay.layers, lay.layers + lay.draft_layers))  # draft layers live on every stage's side
    keys = [(k, layer) for k in lay.kinds() for layer in layers] + [(k, layer) for k in lay.kinds() for layer in draft]
    kv = [np.zeros((lay.pages, lay.page_size, len(heads), lay.head_dim), dtype=DTYPE) for _ in keys]
    layer_ids = [layer for _, layer in keys]
    state: list[np.ndarray] = []
    state_keys: list[tuple[int, int]] = []
    extra: dict[str, Any] = {}
    if lay.state == "mamba":
        dim = MAMBA_DIM // tp_size
        state = [np.zeros((8, MAMBA_OUTER, dim, MAMBA_ELEM), dtype=np.uint8) for _ in layers]
        state_keys = [(2, layer) for layer in layers]
        extra = dict(state_dim_per_tensor=[dim] * len(layers), state_outer=[MAMBA_OUTER] * len(layers))
    elif lay.state in ("swa", "nsa"):
        state_heads = len(heads) if lay.state == "swa" else 1
        kinds = lay.kinds() if lay.state == "swa" else [3]
        state_keys = [(10 + k, layer) for k in kinds for layer in layers]
        state = [np.zeros((lay.pages, lay.page_size, state_heads, lay.head_dim), dtype=DTYPE) for _ in state_keys]
    if state:
        extra.update(state_type=lay.state, state_layer_ids=[layer for _, layer in state_keys])
    args = KVArgs.from_arrays(kv, page_size=lay.page_size, aux=[np.zeros((4, 64), dtype=np.uint8)], state=state,
                              engine_rank=tp, tp_size=tp_size, pp_rank=pp, pp_size=pp_size, is_mla=lay.mla,
                              kv_head_num=len(heads), total_kv_head_num=1 if lay.mla else lay.heads,
                              kv_layer_ids=layer_ids, **extra)
    return Rank(tp, pp, layer_ids, heads, kv, keys, args.owners[1][0], state, state_keys, args)


def fill_prefill(lay: Layout, rank: Rank, room: int, src_pages: np.ndarray, logical: np.ndarray) -> None:
    for arr, (kind, layer) in zip(rank.kv, rank.entry_keys, strict=True):
        arr[src_pages] = model_values(kind, layer, logical, lay.page_size, rank.heads, lay.head_dim, room)
    rank.aux[0] = (room + 31 * rank.tp + 7 * rank.pp) % 251  # rank-specific: shows who wrote it


def expected_state(lay: Layout, rank: Rank, key: tuple[int, int], room: int, slots: np.ndarray, tp_size: int,
                   tp: int) -> np.ndarray:
    kind, layer = key
    if lay.state == "mamba":  # [slot, outer, dim, elem] slice of the full model's dim axis
        full = model_values(kind, layer, np.arange(1), MAMBA_OUTER, np.arange(MAMBA_DIM), MAMBA_ELEM, room)
        dim = MAMBA_DIM // tp_size
        state: np.ndarray = full[0][:, tp * dim:(tp + 1) * dim, :].astype(np.uint8)[None]
        return state
    heads = rank.heads if lay.state == "swa" else np.arange(1)
    return model_values(kind, layer, slots, lay.page_size, heads, lay.head_dim, room)


@contextlib.asynccontextmanager
async def cluster(lay: Layout, **config: Any) -> AsyncIterator[tuple[list[Rank], list[Rank], str]]:
    # These tests check where bytes land, not liveness: a VM stalled for seconds (24 ranks and 48 engine
    # threads in one process) must not lapse a lease (10 s of silence here, not 3.5 s).
    cfg = Config(**{"waiting_timeout_s": 60, "bootstrap_timeout_s": 60, "host_bootstrap": False,
                    "heartbeat_max_failures": 20, **CONTROL, **config})
    async with BootstrapServer("127.0.0.1", 0) as server, contextlib.AsyncExitStack() as stack:
        prefill = [build_rank(lay, lay.tp_prefill, tp, lay.pp_prefill, pp)
                   for pp in range(lay.pp_prefill) for tp in range(lay.tp_prefill)]
        decode = [build_rank(lay, lay.tp_decode, tp, lay.pp_decode, pp)
                  for pp in range(lay.pp_decode) for tp in range(lay.tp_decode)]
        managers = [KVManager(Mode.PREFILL, r.args, bootstrap_addr=server.addr, config=cfg) for r in prefill]
        managers += [KVManager(Mode.DECODE, r.args, config=cfg) for r in decode]
        await asyncio.gather(*(m.start() for m in managers))
        for m in managers:
            stack.push_async_callback(m.close)
        for r, m in zip(prefill + decode, managers, strict=True):
            r.mgr = m
        yield prefill, decode, server.addr


async def run_room(lay: Layout, prefill: list[Rank], decode: list[Rank], addr: str, room: int, num_pages: int,
                   rng: np.random.Generator, prefix_pages: int = 0,
                   chunk: int = 3) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray]]:
    """Move one request; returns each decode rank's destination pages (after the prefix) and state slots."""
    logical = np.arange(prefix_pages, num_pages)
    n = len(logical)
    src_pages = rng.choice(lay.pages, n, replace=False)
    state_src = np.array([5]) if lay.state == "mamba" else rng.choice(lay.pages, 2, replace=False)
    for r in prefill:
        fill_prefill(lay, r, room, src_pages, logical)
        for arr, key in zip(r.state, r.state_keys, strict=True):
            arr[state_src] = expected_state(lay, r, key, room, np.arange(len(state_src)), lay.tp_prefill, r.tp)
    dst: dict[int, np.ndarray] = {}
    receivers = []
    for i, r in enumerate(decode):
        assert r.mgr is not None
        dst[i] = rng.choice(lay.pages, n, replace=False)
        state_dst = np.array([2]) if lay.state == "mamba" else rng.choice(lay.pages, 2, replace=False)
        receiver = r.mgr.receiver(addr, room)
        receivers.append((receiver, state_dst))
        init = receiver.init(dst[i], 0, state_dst if lay.state != "none" else None, prefix_pages * lay.page_size)
        assert await init == KVPoll.WaitingForInput, receiver.failure_reason

    async def send(r: Rank) -> KVPoll:
        assert r.mgr is not None
        sender = r.mgr.sender(room)
        assert await sender.wait_ready(30) == KVPoll.WaitingForInput, sender.failure_reason
        assert sender.decode_prefix_len == prefix_pages * lay.page_size
        sender.init(n, 0)
        for k in range(0, max(n, 1), chunk):
            last = k + chunk >= n
            await sender.send(src_pages[k:k + chunk], state_src if last and lay.state != "none" else None)
        result = await sender.wait(30)
        assert result == KVPoll.Success, sender.failure_reason
        sender.clear()
        return result

    await asyncio.gather(*(send(r) for r in prefill))
    for receiver, _ in receivers:
        assert await receiver.wait(30) == KVPoll.Success, receiver.failure_reason
        receiver.clear()
    return dst, {i: state_dst for i, (_, state_dst) in enumerate(receivers)}


def check_decode(lay: Layout, prefill: list[Rank], decode: list[Rank], room: int, num_pages: int,
                 dst: dict[int, np.ndarray], state_dsts: dict[int, np.ndarray], prefix_pages: int = 0) -> None:
    logical = np.arange(prefix_pages, num_pages)
    for i, r in enumerate(decode):
        for arr, (kind, layer) in zip(r.kv, r.entry_keys, strict=True):
            want = model_values(kind, layer, logical, lay.page_size, r.heads, lay.head_dim, room)
            got = arr[dst[i]]
            assert np.array_equal(got, want), f"decode rank {i} kind {kind} layer {layer}: wrong bytes"
            others = np.setdiff1d(np.arange(lay.pages), dst[i])
            assert not arr[others].any(), f"decode rank {i} layer {layer}: a page outside the request was written"
        writer = writer_of(lay, r)
        assert r.aux[0][0] == (room + 31 * writer[0] + 7 * writer[1]) % 251, "aux not from the one chosen sender"
        state_dst = state_dsts[i]
        for arr, key in zip(r.state, r.state_keys, strict=True):
            want = expected_state(lay, r, key, room, np.arange(len(state_dst)), lay.tp_decode, r.tp)
            assert np.array_equal(arr[state_dst], want.astype(arr.dtype)), f"decode rank {i} state {key} wrong"


def writer_of(lay: Layout, r: Rank) -> tuple[int, int]:
    """(tp, pp) of the prefill rank that must have written decode rank r's aux row."""
    tp_p, tp_d = lay.tp_prefill, lay.tp_decode
    if tp_d >= tp_p:
        tp = r.tp // (tp_d // tp_p)
    else:
        tp = r.tp * (tp_p // tp_d)
    pp = lay.pp_prefill - 1 if lay.pp_decode == 1 else r.pp
    return tp, pp
