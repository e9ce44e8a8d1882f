from __future__ import annotations

from typing import Any

import pytest

from asynckv.proto import bootstrap
from asynckv.proto.bootstrap import PayloadError, PrefillRank, RankTable


def rank(**kw: Any) -> PrefillRank:
    base: dict[str, Any] = dict(tp_size=2, tp_rank=0, pp_size=1, pp_rank=0, dp_size=1, dp_rank=0,
                                endpoint="tcp://127.0.0.1:5000", agent_id="a", page_size=16, kv_dtype="bfloat16",
                                is_mla=False)
    base.update(kw)
    return PrefillRank(**base)


def test_readiness_counts_distinct_ranks_not_puts() -> None:
    table = RankTable(lease_s=10.0)
    table.register(rank(tp_rank=0), now=0.0)
    table.register(rank(tp_rank=0, agent_id="restarted"), now=10.5)  # a restart after the lease lapsed replaces
    assert table.registered == 1 and table.expected == 2 and not table.ready
    table.register(rank(tp_rank=1, agent_id="b"), now=10.5)
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


def test_an_instance_larger_than_max_ranks_is_refused_and_the_real_one_then_registers() -> None:
    """Attack 1: a hostile first registration with tp_size=10**12 fixed the instance, so the table
    took any number of ranks and the real prefill was refused."""
    table = RankTable(max_ranks=4096)
    for sizes in ({"tp_size": 10**12}, {"tp_size": 64, "pp_size": 64, "dp_size": 2}):
        with pytest.raises(PayloadError, match="at most 4096"):
            table.register(rank(**sizes))
    assert table.expected == 0 and table.registered == 0
    table.register(rank(tp_size=1))
    assert table.ready and table.expected == 1


@pytest.mark.parametrize("patch, needle", [
    ({"tp_size": 10**12}, "within"),
    ({"page_size": -(10**40)}, "within"),
    ({"endpoint": "tcp://" + "h" * 300 + ":1"}, "at most 256"),
    ({"agent_id": "a" * 129}, "at most 128"),
    ({"kv_dtype": "bf" * 20}, "at most 32"),
    ({"endpoint": "tcp://127.0.0.1:1\nINFO forged log line"}, "non-printable"),
])
def test_fields_are_bounded(patch: dict[str, Any], needle: str) -> None:
    with pytest.raises(PayloadError, match=needle):
        PrefillRank.from_json({**rank().to_json(), **patch})


def test_a_reason_never_copies_a_hostile_value() -> None:
    nested: Any = 1
    for _ in range(900):
        nested = [nested]
    try:
        PrefillRank.from_json({**rank().to_json(), "tp_size": nested})
    except PayloadError as exc:
        assert len(str(exc)) < 200
    except RecursionError:  # the server answered 500
        pytest.fail("building the reason recursed into the value", pytrace=False)
    else:
        pytest.fail("a nested tp_size was accepted")


def test_a_live_entry_is_refused_to_another_agent_naming_rank_agent_and_when() -> None:
    """Attack 8: an unauthenticated PUT replaced a live prefill rank's entry."""
    table = RankTable(lease_s=10.0)
    table.register(rank(agent_id="8e8e95d2-real", tp_size=1), now=0.0, key="k")
    impostor = rank(agent_id="impostor", tp_size=1, endpoint="tcp://127.0.0.1:6666")
    held = r"dp=0 tp=0 pp=0 is held by live agent 8e8e95d2 .* lapses in 6\.0s"
    with pytest.raises(bootstrap.RouteConflict, match=held):
        table.register(impostor, now=4.0)
    # an agent id is public (GET /route lists it): copying it and moving the endpoint needs the lease key
    moved = rank(agent_id="8e8e95d2-real", tp_size=1, endpoint="tcp://127.0.0.1:6666")
    for key in ("", "guess"):
        with pytest.raises(bootstrap.RouteConflict):
            table.register(moved, now=4.0, key=key)
    assert not table.unregister((0, 0, 0), "8e8e95d2-real", "")  # a forged DELETE does not free it either
    assert table.route()["ranks"][0]["endpoint"] == "tcp://127.0.0.1:5000"
    assert table.register(rank(agent_id="8e8e95d2-real", tp_size=1), now=9.0, key="k") is False  # the owner renews
    with pytest.raises(bootstrap.RouteConflict, match=r"lapses in 10\.0s"):
        table.register(impostor, now=9.0)
    assert table.register(impostor, now=19.5) is True  # the owner stopped renewing: its lease lapsed
    assert table.route()["ranks"][0]["agent_id"] == "impostor"


def test_an_authenticated_request_replaces_a_live_entry_at_once() -> None:
    table = RankTable()
    table.register(rank(tp_size=1), now=0.0, key="k")
    table.register(rank(tp_size=1, agent_id="restarted"), now=1.0, authenticated=True)
    assert table.route()["ranks"][0]["agent_id"] == "restarted"
    assert table.unregister((0, 0, 0), "restarted", authenticated=True)


def test_a_lapsed_entry_stays_listed_and_only_its_owner_removes_it() -> None:
    table = RankTable(lease_s=1.0)
    table.register(rank(tp_size=1), now=0.0, key="k")
    assert table.ready and len(table.route()["ranks"]) == 1  # at now=100 too: lapsed is replaceable, not gone
    assert not table.unregister((0, 0, 0), "a", "wrong")
    assert table.unregister((0, 0, 0), "a", "k") and table.registered == 0


def test_a_new_topology_replaces_an_instance_whose_every_lease_lapsed() -> None:
    table = RankTable(lease_s=1.0)
    table.register(rank(tp_rank=0), now=0.0)
    with pytest.raises(PayloadError, match="tp_size registered 2, got 4"):
        table.register(rank(tp_size=4, tp_rank=1, agent_id="b"), now=0.5)
    table.register(rank(tp_size=4, tp_rank=1, agent_id="b"), now=1.5)
    assert table.expected == 4 and table.registered == 1


@pytest.mark.parametrize("body", [{"lease": 5}, {"lease": "x" * 129}, {"lease": "a\x00"}])
def test_a_bad_lease_key_is_refused(body: dict[str, Any]) -> None:
    with pytest.raises(PayloadError, match="lease"):
        bootstrap.lease_key(body)
    assert bootstrap.lease_key({}) == "" and bootstrap.lease_key({"lease": "k"}) == "k"
