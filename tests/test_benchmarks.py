"""Each benchmark runs at a tiny size so it cannot rot (no timing is asserted)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from benchmarks import bench_head_slice

ROOT = pathlib.Path(__file__).parent.parent


def test_head_slice_benchmark_smoke(tmp_path: pathlib.Path) -> None:
    result = bench_head_slice.run([16], out_dir=tmp_path)
    saved = json.loads((tmp_path / "head_slice.json").read_text())
    assert saved["rows"][0]["descriptors"] == result["rows"][0]["descriptors"] == 2 * 16 * 16  # type: ignore[index]
    assert saved["machine"]["cores"] >= 1


@pytest.mark.slow
def test_every_benchmark_runs_at_a_tiny_size(tmp_path: pathlib.Path) -> None:
    out = subprocess.run([sys.executable, "-m", "benchmarks", "--smoke", "--out", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    written = sorted(p.name for p in tmp_path.glob("*.json"))
    assert written == ["concurrency.json", "control_transport.json", "first_contact.json", "head_slice.json",
                       "hetero_tp.json", "hetero_tp_mamba.json", "hetero_tp_mixed.json", "idle.json",
                       "kernels.json", "room_trace.json",
                       "scaling.json", "sglang_poll.json", "sglang_side_by_side.json", "simulator.json",
                       "small_requests.json", "throughput.json"]
    for name in written:
        data = json.loads((tmp_path / name).read_text())
        assert data["machine"]["versions"]["numpy"] and data["question"]
    assert "| Q1 bulk" not in out.stdout or "x raw" in out.stdout
    assert (tmp_path / "throughput.png").exists()


def test_the_room_trace_of_a_large_room_between_raw_writes(tmp_path: pathlib.Path) -> None:
    code = ("import pathlib, sys; from benchmarks import trace_room; "
            "trace_room.main(['--rooms', '3', '--pages', '4', '--interleave'], out_dir=pathlib.Path(sys.argv[1]))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    data = json.loads((tmp_path / "room_trace_4p_interleaved.json").read_text())
    stages = [row["stage"] for row in data["rows"]]
    assert data["pages"] == 4 and data["raw_write_p50_ms"] > 0 and "copied_last" in stages and stages[-1] == "end"
