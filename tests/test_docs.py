"""The docs list every knob and every metric the code has."""

from __future__ import annotations

import dataclasses
import pathlib
import re

from asynckv.config import Config
from asynckv.service import metrics

DOCS = pathlib.Path(__file__).parent.parent / "docs"


def test_operations_lists_every_environment_variable() -> None:
    text = (DOCS / "operations.md").read_text()
    for f in dataclasses.fields(Config):
        assert f"ASYNCKV_{f.name.upper()}" in text, f"docs/operations.md misses ASYNCKV_{f.name.upper()}"


def test_operations_lists_every_metric() -> None:
    text = (DOCS / "operations.md").read_text()
    names = {m._name for m in (metrics.TRANSFER_BYTES, metrics.TRANSFERS, metrics.TRANSFER_SECONDS,
                               metrics.DESCRIPTORS, metrics.TRANSFER_FAILURES, metrics.ROOM_SECONDS,
                               metrics.ROOMS_FINISHED, metrics.FIRST_CONTACT_SECONDS, metrics.PEERS_DEAD)}
    names |= set(re.findall(r'GaugeMetricFamily\("(\w+)"', pathlib.Path(metrics.__file__).read_text()))
    for name in names:
        assert name in text, f"docs/operations.md misses {name}"
