"""Run every benchmark (``python -m benchmarks`` or ``asynckv bench``), write
benchmarks/results/*.json and charts, and print the summary table.

``--smoke`` runs each at a tiny size into a temporary folder (the test suite does this so
the benchmarks cannot rot); ``--only NAME ...`` picks some.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile
import time

from . import (
    bench_concurrency,
    bench_control,
    bench_first_contact,
    bench_head_slice,
    bench_hetero_tp,
    bench_idle,
    bench_kernels,
    bench_scaling,
    bench_sglang,
    bench_sglang_poll,
    bench_sim,
    bench_small,
    bench_throughput,
    trace_room,
)
from ._common import RESULTS
from .report import render, render_scaling

FULL: dict[str, list[str]] = {"throughput": ["--reps", "9"], "small": [], "concurrency": [], "kernels": [], "idle": [],
                              "first_contact": [], "head_slice": [], "sglang": [],
                              "sglang_poll": [], "scaling": [], "hetero_tp": [], "hetero_tp_mamba": ["--mamba"],
                              "hetero_tp_mixed": ["--mixed"],
                              "control": [], "sim": [], "trace": []}
SMOKE: dict[str, list[str]] = {
    "throughput": ["--sizes-mib", "0.0625", "1", "--reps", "1"],
    "small": ["--pages", "1", "--reps", "5", "--rounds", "1"],
    "concurrency": ["--rooms", "40", "--inflight", "20"],
    "kernels": ["--pages", "64", "--layers", "2"],
    "idle": ["--seconds", "0.3", "--rooms", "10"],
    "first_contact": ["--rounds", "1"],
    "head_slice": ["--pages", "16"],
    "sglang": ["--rounds", "1", "--scale", "16", "--cases", "1", "--requests", "4"],
    "sglang_poll": ["--queued", "20", "--iterations", "20"],
    "scaling": ["--rounds", "1", "--lanes", "1", "2", "--pages", "1", "4", "--inflight", "1", "4",
                "--budget-pages", "16", "--scale", "16"],
    "hetero_tp": ["--rounds", "1", "--layers", "2", "--requests", "4", "--pages", "4", "--inflight", "2"],
    "hetero_tp_mamba": ["--rounds", "1", "--layers", "2", "--requests", "4", "--pages", "4", "--inflight", "2",
                        "--mamba"],
    "hetero_tp_mixed": ["--rounds", "1", "--layers", "2", "--requests", "4", "--pages", "4", "--inflight", "2",
                        "--mixed"],
    "control": ["--messages", "60", "--rounds", "1"],
    "sim": ["--seeds", "500", "--procs", "1"],
    "trace": ["--rooms", "5"],
}
MODULES = {"throughput": bench_throughput, "small": bench_small, "concurrency": bench_concurrency,
           "kernels": bench_kernels, "idle": bench_idle, "first_contact": bench_first_contact,
           "head_slice": bench_head_slice, "sglang": bench_sglang,
           "sglang_poll": bench_sglang_poll, "scaling": bench_scaling, "hetero_tp": bench_hetero_tp,
           "hetero_tp_mamba": bench_hetero_tp, "hetero_tp_mixed": bench_hetero_tp,
           "control": bench_control, "sim": bench_sim, "trace": trace_room}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, results in a temporary folder")
    parser.add_argument("--only", nargs="*", choices=sorted(MODULES), help="run only these")
    parser.add_argument("--out", type=pathlib.Path, help="results folder (default benchmarks/results)")
    args = parser.parse_args(argv)
    names = args.only or list(MODULES)
    out = args.out or (pathlib.Path(tempfile.mkdtemp(prefix="asynckv-bench-")) if args.smoke else RESULTS)
    plan = SMOKE if args.smoke else FULL
    for i, name in enumerate(names, 1):
        t = time.perf_counter()
        print(f"[{i}/{len(names)}] {name}", flush=True)
        module = MODULES[name]
        if name == "head_slice":
            module.run([int(x) for x in plan[name][1:]] if plan[name] else [1024, 16384, 131072], out)
        else:
            module.main(plan[name], out)
        print(f"      done in {time.perf_counter() - t:.1f} s", flush=True)
    print(render(out, charts=True))
    scaling = render_scaling(out)
    if scaling:
        print("\n" + scaling)
    print(f"results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
