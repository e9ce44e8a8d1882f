"""Every parallel layout, checked byte for byte against a sharded numpy reference model.

Real managers (one NIXL agent each, several per process), real ZMQ and bootstrap server.
The default run covers a representative subset; the whole matrix (prefill TP x decode TP
in {1,2,4,8}, H in {1,2,4,8}, prefill PP in {1,2}, MHA and MLA) is marked slow, and so is the same
with every hybrid state kind (up to 12 ranks), per token and staged.
"""

from __future__ import annotations

import itertools
from typing import Any, cast

import numpy as np
import pytest

from asynckv import KVManager
from asynckv.service.prefill import PrefillService

from .model import Layout, check_decode, cluster, run_room

pytestmark = pytest.mark.integration

TPS = (1, 2, 4, 8)


def full_matrix() -> list[Layout]:
    mha = itertools.product(TPS, TPS, TPS, (1, 2))
    mla = itertools.product(TPS, TPS, (1, 2))
    layouts = [Layout(tp_p, tp_d, h, pp_prefill=pp) for tp_p, tp_d, h, pp in mha]
    layouts += [Layout(tp_p, tp_d, 1, pp_prefill=pp, mla=True) for tp_p, tp_d, pp in mla]
    return layouts


def state_matrix() -> list[Layout]:
    """Every state kind over prefill x decode TP (at most 12 ranks) x heads x prefill PP, and MLA: where the
    state's split and the KV heads' replication differ (prefill TP above the head count lost mamba slices)."""
    layouts = []
    for state in ("mamba", "swa", "nsa"):
        for tp_p, tp_d, h, pp in itertools.product(TPS, TPS, TPS, (1, 2)):
            if tp_p * pp + tp_d <= 12:
                layouts.append(Layout(tp_p, tp_d, h, pp_prefill=pp, state=state))
        for tp_p, tp_d, pp in itertools.product(TPS, TPS, (1, 2)):
            if tp_p * pp + tp_d <= 12:
                layouts.append(Layout(tp_p, tp_d, 1, pp_prefill=pp, mla=True, state=state))
    return layouts


REPRESENTATIVE = [
    Layout(1, 1, 8), Layout(4, 2, 8), Layout(2, 4, 8), Layout(8, 2, 2), Layout(2, 8, 4), Layout(8, 8, 1),
    Layout(4, 1, 8, pp_prefill=2), Layout(2, 2, 4, pp_prefill=2, pp_decode=2), Layout(1, 4, 1),
    Layout(4, 1, 1, mla=True), Layout(1, 4, 1, mla=True), Layout(2, 2, 1, pp_prefill=2, mla=True),
]


def layout_id(lay: Layout) -> str:
    kind = "mla" if lay.mla else f"h{lay.heads}"
    extra = f"-{lay.state}" if lay.state != "none" else ""
    extra += f"-draft{lay.draft_layers}" if lay.draft_layers else ""
    return f"tp{lay.tp_prefill}to{lay.tp_decode}-pp{lay.pp_prefill}to{lay.pp_decode}-{kind}{extra}"


async def check_layout(lay: Layout, prefix_pages: int = 0, rooms: int = 2, **config: Any) -> None:
    rng = np.random.default_rng(hash(layout_id(lay)) % 2**32)
    async with cluster(lay, **config) as (prefill, decode, addr):
        for room in range(1, rooms + 1):
            for r in decode:  # each room checks its own pages only
                for arr in r.kv + r.state:
                    arr[:] = 0
            dst, state_dst = await run_room(lay, prefill, decode, addr, room * 1000 + 7, 7, rng,
                                            prefix_pages=prefix_pages)
            check_decode(lay, prefill, decode, room * 1000 + 7, 7, dst, state_dst, prefix_pages=prefix_pages)
        if lay.state == "nsa" or (lay.mla and lay.state == "swa"):  # the same on every TP rank: one writer a stage
            posts = sum(cast(PrefillService, cast(KVManager, r.mgr)._svc).core.stats["state_posts"] for r in prefill)
            stages = lay.pp_prefill if lay.pp_decode == 1 else 1
            assert posts == rooms * len(decode) * stages, f"{posts} state writes for {rooms} rooms"
        for r in prefill + decode:
            assert r.mgr is not None
            assert all(v == 0 for v in r.mgr.room_counts().values())
            staging = getattr(r.mgr._svc, "builder", None) and r.mgr._svc.builder.staging  # type: ignore[union-attr]
            if staging is not None:  # every run given back, nothing held (and /metrics says so)
                assert staging.held == 0 and staging.free_bytes == staging.capacity
                assert r.mgr.snapshot()["staging"] == {"capacity_bytes": staging.capacity, "held_bytes": 0}
            slots = getattr(r.mgr._svc, "staging", None)
            if slots is not None:  # (decode) every staging slot given back
                assert slots.free_slots == slots.slots


@pytest.mark.parametrize("lay", REPRESENTATIVE, ids=layout_id)
async def test_layout(lay: Layout) -> None:
    await check_layout(lay)


@pytest.mark.slow
@pytest.mark.parametrize("lay", [lay for lay in full_matrix() if lay not in REPRESENTATIVE], ids=layout_id)
async def test_layout_full_matrix(lay: Layout) -> None:
    await check_layout(lay, rooms=1)


@pytest.mark.slow
@pytest.mark.parametrize("lay", state_matrix(), ids=layout_id)
async def test_hybrid_state_full_matrix(lay: Layout) -> None:
    """Per token, and staged on decode where the prefill TP is larger (MHA)."""
    await check_layout(lay, rooms=1)
    if lay.tp_prefill > lay.tp_decode and not lay.mla:
        await check_layout(lay, rooms=1, decode_staging_bytes=8 * 2**20)


@pytest.mark.parametrize("lay", [
    Layout(2, 2, 4, state="mamba"), Layout(4, 2, 4, state="mamba"), Layout(2, 4, 4, state="mamba"),
    Layout(2, 1, 4, pp_prefill=2, state="mamba"),
    Layout(2, 2, 4, state="swa"), Layout(4, 2, 8, state="swa"), Layout(1, 2, 2, state="swa"),
    Layout(2, 2, 4, state="nsa"), Layout(4, 1, 4, state="nsa"), Layout(2, 4, 1, mla=True, state="nsa"),
    # State the same on every prefill TP rank (NSA, and any state of MLA) comes from one rank per PP stage:
    # each stage holds its own layers' entries.
    Layout(4, 1, 4, pp_prefill=2, state="nsa"), Layout(2, 2, 4, pp_prefill=2, pp_decode=2, state="nsa"),
    Layout(2, 1, 1, mla=True, pp_prefill=2, state="nsa"), Layout(2, 4, 1, mla=True, pp_prefill=2, state="swa"),
    # Prefill ranks replicating KV heads (TP > heads) are dummies for the KV, but each holds its own slice of
    # split mamba state: they write it and report (a quarter of every entry was never written before).
    Layout(4, 1, 2, state="mamba"), Layout(4, 2, 2, state="mamba"), Layout(4, 1, 1, mla=True, state="mamba"),
], ids=layout_id)
async def test_hybrid_state(lay: Layout) -> None:
    await check_layout(lay)


@pytest.mark.parametrize("lay", [Layout(2, 2, 4), Layout(4, 2, 8, state="mamba"), Layout(2, 1, 1, mla=True)],
                         ids=layout_id)
async def test_decode_prefix_reuse(lay: Layout) -> None:
    await check_layout(lay, prefix_pages=3)


async def test_full_prefix_hit_still_sends_aux_and_state() -> None:
    await check_layout(Layout(2, 2, 4, state="mamba"), prefix_pages=7)


@pytest.mark.parametrize("lay", [Layout(2, 2, 4, draft_layers=1), Layout(4, 2, 8, draft_layers=2),
                                 Layout(2, 1, 1, mla=True, draft_layers=1)], ids=layout_id)
async def test_speculative_draft_entries(lay: Layout) -> None:
    await check_layout(lay)


@pytest.mark.parametrize("staging_bytes, staged", [(256 * 2**20, True), (64, False), (0, False)],
                         ids=["staged", "no-room-per-token", "off-per-token"])
async def test_head_slices_for_a_larger_decode_tp_are_staged_into_whole_pages(
        staging_bytes: int, staged: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefill TP2 -> decode TP4 (8 heads): each decode rank takes 2 of a prefill rank's 4 heads, its
    whole token row. Gathered in the staging area they go out one descriptor per page; without
    room (or with staging off) per token. Same bytes either way, and no run is left held."""
    from asynckv.service.staging import StagingArea
    taken: list[int] = []
    real = StagingArea.take

    def spy(self: StagingArea, post_id: int, nbytes: int) -> int | None:
        off = real(self, post_id, nbytes)
        taken.append(-1 if off is None else nbytes)
        return off
    monkeypatch.setattr(StagingArea, "take", spy)
    await check_layout(Layout(2, 4, 8), staging_bytes=staging_bytes)
    assert bool(taken) == (staging_bytes > 0)  # (off: no area at all)
    assert (bool(taken) and all(n > 0 for n in taken)) == staged


DECODE_STAGED = [
    Layout(2, 1, 8), Layout(4, 2, 8), Layout(8, 2, 2), Layout(4, 1, 8, pp_prefill=2), Layout(4, 1, 4, state="nsa"),
    Layout(4, 2, 8, draft_layers=2), Layout(4, 2, 8, state="mamba"), Layout(2, 2, 4), Layout(1, 2, 4),
    Layout(4, 2, 8, pp_prefill=2, pp_decode=2),
    Layout(4, 1, 8, pp_prefill=4, draft_layers=1), Layout(4, 1, 4, pp_prefill=2, state="nsa"),
    Layout(4, 1, 8, state="mamba"), Layout(2, 1, 4, pp_prefill=2, state="mamba"), Layout(4, 2, 8, state="swa"),
    Layout(4, 1, 4, pp_prefill=2, state="swa"), Layout(4, 1, 2, state="mamba"), Layout(8, 1, 8, state="mamba"),
    Layout(8, 2, 8, pp_prefill=2, state="swa"), Layout(8, 1, 8, pp_prefill=4, state="nsa"),
]


@pytest.mark.parametrize("lay", DECODE_STAGED, ids=layout_id)
async def test_decode_staging_for_a_larger_prefill_tp(lay: Layout, monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode rank holding more heads than its prefill ranks takes their whole pages into staging
    slots and copies their rows into its pages: the same bytes as per token, every slot given back.
    Prefill and decode PP stage too (each prefill stage writes its own layers' entries into slots of
    its own); state of every kind goes straight into decode's state, the Register naming decode's real
    rank for it. Equal TP does not stage."""
    from asynckv.service.decode_staging import DecodeStaging
    copied: list[int] = []
    real = DecodeStaging.scatter

    def spy(self: DecodeStaging, pages: Any, slices: Any) -> int:
        n = real(self, pages, slices)
        copied.append(n)
        return n
    monkeypatch.setattr(DecodeStaging, "scatter", spy)
    await check_layout(lay, prefix_pages=2 if lay.draft_layers else 0, decode_staging_bytes=8 * 2**20)
    staged = lay.tp_prefill > lay.tp_decode and lay.heads // lay.tp_decode > max(1, lay.heads // lay.tp_prefill)
    assert bool(copied) == staged
    assert all(n > 0 for n in copied)  # (entries a rank's stage does not hold are left alone: the bytes say so)
