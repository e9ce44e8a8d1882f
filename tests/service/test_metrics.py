"""asynckv's own lock-free counters and histograms expose exactly what prometheus_client's would."""

from __future__ import annotations

import prometheus_client
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest

from asynckv.service import metrics

BUCKETS = (0.001, 0.01, 0.1, 1, 10)


def exposition(registry: CollectorRegistry) -> list[str]:
    """The sample lines, without comments and prometheus_client's ``_created`` timestamps."""
    return sorted(line for line in generate_latest(registry).decode().splitlines()
                  if line and not line.startswith("#") and "_created" not in line)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "b"]), st.floats(0, 20, allow_nan=False)), max_size=40))
def test_a_histogram_and_a_counter_render_as_prometheus_clients_do(observations: list[tuple[str, float]]) -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    h = metrics.Histogram("t_seconds", "doc", ["peer"], buckets=BUCKETS, registry=ours)
    c = metrics.Counter("t_bytes", "doc", ["peer"], registry=ours)
    ph = prometheus_client.Histogram("t_seconds", "doc", ["peer"], buckets=BUCKETS, registry=theirs)
    pc = prometheus_client.Counter("t_bytes", "doc", ["peer"], registry=theirs)
    for peer, value in [*observations, *((v, b) for v in "ab" for b in BUCKETS)]:  # every bound itself too
        h.labels(peer).observe(value)
        ph.labels(peer).observe(value)
        c.labels(peer).inc(value)
        pc.labels(peer).inc(value)
    assert exposition(ours) == exposition(theirs)


def test_removed_series_disappear_and_counters_refuse_to_go_down() -> None:
    registry = CollectorRegistry()
    c = metrics.Counter("r_total_things", "doc", ["peer"], registry=registry)
    c.labels("a").inc(2)
    c.labels("b").inc(3)
    c.remove("a")
    assert exposition(registry) == ['r_total_things_total{peer="b"} 3.0']
    with pytest.raises(ValueError):
        c.labels("b").inc(-1)
    with pytest.raises(ValueError):
        c.labels("b", "extra")
