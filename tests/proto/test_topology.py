from __future__ import annotations

import dataclasses
from typing import Any, cast

import numpy as np
import pytest

from asynckv.errors import LayoutMismatch, RemoteProtocolError
from asynckv.layout import KVArgs
from asynckv.proto.bootstrap import RankTable
from asynckv.proto.messages import Register
from asynckv.proto.topology import PrefillInstance, check_compatible, head_slice, plan_peer, plan_targets

from .samples import SAMPLES
from .test_bootstrap_table import rank

REGISTER = cast(Register, SAMPLES["register"])


def instance(**kw: Any) -> PrefillInstance:
    table = RankTable()
    for tp in range(kw.get("tp_size", 2)):
        for dp in range(kw.get("dp_size", 1)):
            table.register(rank(tp_rank=tp, dp_rank=dp, agent_id=f"{dp}-{tp}", **kw))
    return PrefillInstance.from_route(table.route())


def test_equal_tp_targets_the_same_rank_and_dp_follows_the_room() -> None:
    inst = instance(tp_size=2, dp_size=3)
    plan = plan_targets(inst, room=7, tp_size=2, engine_rank=1)
    assert [(r.dp_rank, r.tp_rank) for r in plan.ranks] == [(1, 1)]
    assert plan.required_dst_info_num == 1 and plan.required_responses == 1


@pytest.mark.parametrize("tp_p, tp_d, rank, want, dummies, required_dst", [
    (4, 2, 1, [2, 3], [], 1),      # reference worked example: both prefill ranks send their heads
    (2, 4, 3, [1], [], 2),         # prefill rank 1 serves decode ranks 2 and 3
    (8, 2, 0, [0, 1, 2, 3], [1, 2, 3], 1),  # H=2 over TP 8: ranks 0-3 all hold head 0: one sends
])
def test_mha_rank_mapping(tp_p: int, tp_d: int, rank: int, want: list[int], dummies: list[int],
                          required_dst: int) -> None:
    heads = 2 if tp_p == 8 else 8
    plan = plan_targets(instance(tp_size=tp_p), room=0, tp_size=tp_d, engine_rank=rank, total_kv_heads=heads)
    assert [t.rank.tp_rank for t in plan.targets] == want
    assert [t.rank.tp_rank for t in plan.targets if t.is_dummy] == dummies
    assert plan.required_dst_info_num == required_dst
    assert plan.required_responses == len(want) - len(dummies)
    assert sum(t.write_aux for t in plan.targets) == 1


@pytest.mark.parametrize("split", [False, True])
def test_ranks_replicating_kv_heads_still_write_split_state(split: bool) -> None:
    """Prefill TP4 over 2 KV heads into decode TP1: ranks 1 and 3 hold the heads of 0 and 2 (dummies for the
    KV), but with mamba state split by TP each holds a quarter of it: they write that and report."""
    plan = plan_targets(instance(tp_size=4), room=0, tp_size=1, engine_rank=0, total_kv_heads=2, split_state=split)
    assert [(t.rank.tp_rank, t.is_dummy, t.state_only) for t in plan.targets] == [
        (0, False, False), (1, True, split), (2, False, False), (3, True, split)]
    assert plan.required_responses == (4 if split else 2)


def test_mla_with_fewer_decode_ranks_has_one_real_sender() -> None:
    plan = plan_targets(instance(tp_size=4, is_mla=True), room=0, tp_size=1, engine_rank=0, is_mla=True)
    assert [(t.rank.tp_rank, t.is_dummy, t.write_aux) for t in plan.targets] == [
        (0, False, True), (1, True, False), (2, True, False), (3, True, False)]
    assert plan.required_responses == 1


def test_decode_pp1_targets_every_prefill_stage_and_the_last_stage_writes_aux() -> None:
    table = RankTable()
    for pp in range(2):
        table.register(rank(tp_size=1, pp_size=2, pp_rank=pp, agent_id=f"pp{pp}"))
    inst = PrefillInstance.from_route(table.route())
    plan = plan_targets(inst, room=0, tp_size=1, engine_rank=0, total_kv_heads=8)
    assert [(t.rank.pp_rank, t.write_aux) for t in plan.targets] == [(1, True), (0, False)]
    assert plan.required_responses == 2
    equal = plan_targets(inst, room=0, tp_size=1, engine_rank=0, pp_size=2, pp_rank=0, total_kv_heads=8)
    assert [t.rank.pp_rank for t in equal.targets] == [0]
    with pytest.raises(LayoutMismatch, match="pp_size mismatch: prefill has 2, decode has 4"):
        plan_targets(inst, room=0, tp_size=1, engine_rank=0, pp_size=4)


def test_unsupported_layouts_are_refused_naming_both_sides() -> None:
    with pytest.raises(LayoutMismatch, match="prefill has 2, decode has 3"):
        plan_targets(instance(tp_size=2), room=0, tp_size=3, engine_rank=0)


@pytest.mark.parametrize("tp_p, tp_d, rp, rd, src_off, dst_off", [
    (4, 2, 3, 1, 0, 512),   # section 4.6 example 1: 2 heads into offset 2 of 4
    (2, 4, 1, 3, 512, 0),   # example 2: heads 2,3 of prefill rank 1's 4
])
def test_head_slice_worked_examples(tp_p: int, tp_d: int, rp: int, rd: int, src_off: int, dst_off: int) -> None:
    hs, hd = 8 // tp_p, 8 // tp_d
    items_s = np.array([16 * hs * 256], dtype=np.uint64)
    items_d = np.array([16 * hd * 256], dtype=np.uint64)
    sl = head_slice(tp_prefill=tp_p, tp_decode=tp_d, prefill_rank=rp, decode_rank=rd, total_heads=8,
                    prefill_heads=hs, decode_heads=hd, page_size=16, src_items=items_s, dst_items=items_d)
    assert (int(sl.src_offs[0]), int(sl.dst_offs[0]), int(sl.nbytes[0])) == (src_off, dst_off, 512)


def test_head_slice_refuses_inconsistent_head_counts() -> None:
    items = np.array([4096], dtype=np.uint64)
    with pytest.raises(LayoutMismatch, match="kv_head_num inconsistent"):
        head_slice(tp_prefill=2, tp_decode=4, prefill_rank=0, decode_rank=0, total_heads=8, prefill_heads=2,
                   decode_heads=2, page_size=16, src_items=items, dst_items=items)


def test_compatibility_names_both_values() -> None:
    inst = instance()
    with pytest.raises(LayoutMismatch, match="page_size mismatch: prefill has 16, decode has 32"):
        check_compatible(inst, page_size=32, kv_dtype="bfloat16", is_mla=False)
    with pytest.raises(LayoutMismatch, match="kv_dtype mismatch: prefill has 'bfloat16', decode has 'float16'"):
        check_compatible(inst, page_size=16, kv_dtype="float16", is_mla=False)


def test_route_answer_without_ranks_is_a_remote_error() -> None:
    with pytest.raises(RemoteProtocolError):
        PrefillInstance.from_route({"ranks": []})
    with pytest.raises(RemoteProtocolError):
        PrefillInstance.from_route({"ranks": [{"tp_size": 1}]})


def local_args(**kw: Any) -> KVArgs:
    base: dict[str, Any] = dict(kv_data_ptrs=[1 << 40, 1 << 41], kv_data_lens=[1 << 20] * 2,
                                kv_item_lens=[32768] * 2, aux_data_ptrs=[1 << 42], aux_data_lens=[4096],
                                aux_item_lens=[64], page_size=16, tp_size=2, engine_rank=1, kv_head_num=4,
                                total_kv_head_num=8, state_type="mamba", state_data_ptrs=[1 << 43],
                                state_data_lens=[65536], state_item_lens=[1024], state_layer_ids=[3],
                                state_dim_per_tensor=[64], state_outer=[2])
    base.update(kw)
    return KVArgs(**base)


def test_equal_layout_copies_whole_pages() -> None:
    plan = plan_peer(local_args(), REGISTER)
    assert plan.whole_pages and plan.src_entries.tolist() == plan.dst_entries.tolist() == [0, 1]
    assert plan.state is not None and plan.state.kind == "items"


def test_tp_difference_plans_head_slices_and_mamba_blocks() -> None:
    local = local_args(tp_size=4, engine_rank=3, kv_head_num=2, kv_item_lens=[16384] * 2, state_item_lens=[512],
                       state_dim_per_tensor=[32])
    plan = plan_peer(local, REGISTER)
    assert plan.head_slice is not None and not plan.whole_pages
    assert plan.head_slice.dst_offs.tolist() == [1024] * 2 and plan.head_slice.nbytes.tolist() == [1024] * 2
    assert plan.state is not None and plan.state.blocks is not None
    src_offs, dst_offs, lens = plan.state.blocks  # 2 outer rows, 8 bytes per element row
    assert src_offs.tolist() == [[0, 256]] and dst_offs.tolist() == [[256, 768]] and lens.tolist() == [[256, 256]]


def staged_register(**kw: Any) -> Any:
    """The sample decode (TP2 rank 1, 4 heads) as its staging area registers with prefill TP4 rank 3: a
    rank of TP4 holding 2 heads, whose state entries are the real rank's (``state_tp_size``)."""
    return dataclasses.replace(REGISTER, tp_size=4, engine_rank=3, kv_head_num=2, kv_item_lens=(16384, 16384), **kw)


def test_a_staging_areas_register_gets_whole_pages_and_state_for_the_real_rank() -> None:
    """KV as whole pages into the slots; mamba state as the same blocks as into the real rank per token
    (``test_tp_difference_plans_head_slices_and_mamba_blocks``)."""
    local = local_args(tp_size=4, engine_rank=3, kv_head_num=2, kv_item_lens=[16384] * 2, state_item_lens=[512],
                       state_dim_per_tensor=[32])
    plan = plan_peer(local, staged_register())
    assert plan.whole_pages and plan.state is not None and plan.state.blocks is not None
    src_offs, dst_offs, lens = plan.state.blocks
    assert src_offs.tolist() == [[0, 256]] and dst_offs.tolist() == [[256, 768]] and lens.tolist() == [[256, 256]]
    assert plan.state.nbytes == 512  # (per slot: the blocks' bytes)
    with pytest.raises(LayoutMismatch, match="mamba state item sizes differ"):  # (taken for a rank of TP4)
        plan_peer(local, staged_register(state_tp_size=0))


def test_a_staging_areas_register_gets_swa_head_slices_for_the_real_rank() -> None:
    """SWA state pages of the real rank's 4 heads: prefill rank 3's 2 heads go to its heads 2-3."""
    local = local_args(tp_size=4, engine_rank=3, kv_head_num=2, kv_item_lens=[16384] * 2, state_type="swa",
                       state_item_lens=[16384], state_dim_per_tensor=None, state_outer=None)
    plan = plan_peer(local, staged_register(state_type="swa", state_item_lens=(32768,), state_dims=(),
                                            state_outer=()))
    assert plan.whole_pages and plan.state is not None and plan.state.head_slice is not None
    hs = plan.state.head_slice
    assert hs.src_offs.tolist() == [0] and hs.dst_offs.tolist() == [1024] and hs.nbytes.tolist() == [1024]
    assert plan.state.nbytes == 16 * 1024  # (per page: 16 token rows of 2 heads)
    with pytest.raises(LayoutMismatch, match="state_head_num 2 at state_tp_size 2, expected 4"):  # the real rank's
        plan_peer(local, staged_register(state_type="swa", state_item_lens=(32768,), state_head_num=2))


@pytest.mark.parametrize("patch, needle", [
    ({"page_size": 32}, "page_size mismatch: prefill has 16, decode has 32"),
    ({"tp_size": 0}, "tp_size mismatch: prefill has 2, decode has 0; both must be at least 1"),
    ({"state_tp_size": 3}, "tp_size mismatch: prefill has 2, decode has 3"),
    ({"kv_item_lens": (32768, 16384)}, "KV entry 1 item size mismatch: prefill has 32768 bytes per page, "
                                       "decode has 16384"),
    ({"aux_item_lens": (128,)}, "aux buffer 0 row size mismatch"),
    ({"kv_ptrs": (1,), "kv_lens": (1,), "kv_item_lens": (1,), "kv_layer_ids": (0,)},
     r"prefill KV entry 1 \(layer 0, occurrence 1\) has no decode entry"),
    ({"kv_dtype": "float8"}, "kv_dtype mismatch"),
    ({"mem_kind": "HBM"}, "mem_kind"),
    ({"kv_lens": (1 << 20, 100)}, "decode KV entry 1"),
    ({"state_type": "swa"}, "state_type mismatch: prefill has 'mamba', decode has 'swa'"),
    ({"tp_size": 3}, "tp_size mismatch: prefill has 2, decode has 3"),
    ({"tp_size": 4, "state_dims": ()}, "kv_head_num inconsistent"),
])
def test_registration_refused_naming_both_values(patch: dict[str, Any], needle: str) -> None:
    reg = dataclasses.replace(REGISTER, **patch)
    with pytest.raises(LayoutMismatch, match=needle):
        plan_peer(local_args(), reg)


def test_kvargs_geometry() -> None:
    args = local_args()
    assert args.num_pages == 32 and args.num_aux_rows == 64 and args.layer_ids == (0, 0)
    kv = np.zeros((4, 10, 128), dtype=np.uint8)
    built = KVArgs.from_arrays(kv, page_size=4, aux=[np.zeros((3, 64), dtype=np.uint8)])
    assert built.kv_item_lens == [128] * 4 and built.num_pages == 10 and built.num_aux_rows == 3
    assert built.kv_data_ptrs[1] - built.kv_data_ptrs[0] == 1280
