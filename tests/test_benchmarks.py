"""Each benchmark runs at a tiny size so it cannot rot (no timing is asserted)."""

from __future__ import annotations

import json
import pathlib

from benchmarks import bench_head_slice


def test_head_slice_benchmark_smoke(tmp_path: pathlib.Path) -> None:
    result = bench_head_slice.run([16], out_dir=tmp_path)
    saved = json.loads((tmp_path / "head_slice.json").read_text())
    assert saved["rows"][0]["descriptors"] == result["rows"][0]["descriptors"] == 2 * 16 * 16  # type: ignore[index]
    assert saved["machine"]["cores"] >= 1
