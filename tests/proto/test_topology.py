from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from asynckv.errors import LayoutMismatch, RemoteProtocolError
from asynckv.layout import KVArgs
from asynckv.proto.bootstrap import RankTable
from asynckv.proto.topology import PrefillInstance, check_compatible, check_registration, plan_targets

from .samples import SAMPLES
from .test_bootstrap_table import rank


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


def test_unsupported_layouts_are_refused_naming_both_sides() -> None:
    with pytest.raises(LayoutMismatch, match="prefill has 2, decode has 4"):
        plan_targets(instance(tp_size=2), room=0, tp_size=4, engine_rank=0)


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
                                aux_item_lens=[64], page_size=16, tp_size=2, engine_rank=1)
    base.update(kw)
    return KVArgs(**base)


def test_registration_accepted_when_geometry_matches() -> None:
    check_registration(local_args(), SAMPLES["register"])  # type: ignore[arg-type]


@pytest.mark.parametrize("patch, needle", [
    ({"page_size": 32}, "page_size mismatch: prefill has 16, decode has 32"),
    ({"kv_item_lens": (32768, 16384)},
     "KV entry 1 item size mismatch: prefill has 32768 bytes per page, decode has 16384"),
    ({"aux_item_lens": (128,)}, "aux buffer 0 row size mismatch"),
    ({"kv_ptrs": (1,), "kv_lens": (1,), "kv_item_lens": (1,), "kv_layer_ids": (0,)}, "number of KV entries"),
    ({"kv_dtype": "float8"}, "kv_dtype mismatch"),
    ({"mem_kind": "HBM"}, "mem_kind"),
    ({"kv_lens": (1 << 20, 100)}, "decode KV entry 1"),
])
def test_registration_refused_naming_both_values(patch: dict[str, Any], needle: str) -> None:
    reg = dataclasses.replace(SAMPLES["register"], **patch)  # type: ignore[type-var]
    with pytest.raises(LayoutMismatch, match=needle):
        check_registration(local_args(), reg)


def test_kvargs_geometry() -> None:
    args = local_args()
    assert args.num_pages == 32 and args.num_aux_rows == 64 and args.layer_ids == (0, 0)
    kv = np.zeros((4, 10, 128), dtype=np.uint8)
    built = KVArgs.from_arrays(kv, page_size=4, aux=[np.zeros((3, 64), dtype=np.uint8)])
    assert built.kv_item_lens == [128] * 4 and built.num_pages == 10 and built.num_aux_rows == 3
    assert built.kv_data_ptrs[1] - built.kv_data_ptrs[0] == 1280
