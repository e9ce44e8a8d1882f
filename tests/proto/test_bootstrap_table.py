from __future__ import annotations

from typing import Any

import pytest

from asynckv.proto.bootstrap import PayloadError, PrefillRank, RankTable


def rank(**kw: Any) -> PrefillRank:
    base: dict[str, Any] = dict(tp_size=2, tp_rank=0, pp_size=1, pp_rank=0, dp_size=1, dp_rank=0,
                                endpoint="tcp://127.0.0.1:5000", agent_id="a", page_size=16, kv_dtype="bfloat16",
                                is_mla=False)
    base.update(kw)
    return PrefillRank(**base)


def test_readiness_counts_distinct_ranks_not_puts() -> None:
    table = RankTable()
    table.register(rank(tp_rank=0))
    table.register(rank(tp_rank=0, agent_id="restarted"))  # a restart replaces, never inflates
    assert table.registered == 1 and table.expected == 2 and not table.ready
    table.register(rank(tp_rank=1, agent_id="b"))
    assert table.ready
    assert [r["agent_id"] for r in table.route()["ranks"]] == ["restarted", "b"]


def test_rank_disagreeing_with_the_instance_is_refused_naming_both_values() -> None:
    table = RankTable()
    table.register(rank())
    with pytest.raises(PayloadError, match="page_size registered 16, got 32"):
        table.register(rank(tp_rank=1, page_size=32))


def test_unregister_only_removes_the_same_incarnation() -> None:
    table = RankTable()
    table.register(rank(agent_id="new"))
    assert not table.unregister((0, 0, 0), "old")
    assert table.unregister((0, 0, 0), "new")
    assert table.registered == 0


def test_json_round_trip() -> None:
    r = rank()
    assert PrefillRank.from_json(r.to_json()) == r


@pytest.mark.parametrize("patch, needle", [
    ({"tp_rank": 2}, "tp_rank=2 not in"),
    ({"tp_rank": "0"}, "must be int"),
    ({"is_mla": 0}, "must be bool"),
    ({"page_size": 0}, "page_size"),
    ({"endpoint": "127.0.0.1:5"}, "tcp://"),
])
def test_bad_fields_are_refused(patch: dict[str, Any], needle: str) -> None:
    with pytest.raises(PayloadError, match=needle):
        PrefillRank.from_json({**rank().to_json(), **patch})


def test_missing_field_and_non_object() -> None:
    body = rank().to_json()
    del body["endpoint"]
    with pytest.raises(PayloadError, match="missing field 'endpoint'"):
        PrefillRank.from_json(body)
    with pytest.raises(PayloadError, match="JSON object"):
        PrefillRank.from_json([1])
