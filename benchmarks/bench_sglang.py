"""The reference workload, asynckv against SGLang 0.5.10's own NIXL connector, in the same run.

Both sides move the same pages between two processes on this machine (DRAM, UCX over loopback):
32 layers MHA = 64 buffers of 16-token pages of 32 KiB (2 MiB per page), 10 aux rows for SGLang
(2 for asynckv's pool: one row per request either way), one chunk per request, the cases of the
reference's own document. SGLang runs unmodified from its venv (``bash scripts/sglang-venv.sh``),
driven the way its schedulers drive it: a loop polling every live sender and receiver
(``tests/interop/sglang_peer.py``, roles ``bench-prefill`` and ``bench-decode``). asynckv runs the
same requests with the same slots (``bench_seed_workload.run_case``). The same rounds also measure
the machine's limit for the same pages (``_limits.limit_case``: raw NIXL in its fastest
configuration, ``np.copyto`` on one and two threads). Rounds interleave the three (the side that goes
first rotates); medians and the min-max spread are reported.

Decode latency: SGLang from ``send_metadata`` to ``poll()`` == Success, asynckv from
``receiver.init()`` to ``wait()`` resolving. CPU: both connectors' processes while serving:
SGLang's from the start of the work (after their ~9 s imports), asynckv's prefill from its first
destination to its last room and its decode from the prefill found to the last Success (start-up,
imports and the pool's page faults excluded on both sides). Skipped, with the reason, when the
SGLang venv is not built.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
from typing import Any

import numpy as np

from asynckv.demo import DemoSpec

from . import bench_seed_workload
from ._common import medians, write_result
from ._limits import limit_case

ROOT = pathlib.Path(__file__).resolve().parents[1]
VENV = pathlib.Path(os.environ.get("ASYNCKV_SGLANG_VENV", ROOT / ".cache" / "sglang-0.5.10"))
PEER = ROOT / "tests" / "interop" / "sglang_peer.py"
CASES = bench_seed_workload.CASES


def sglang_python() -> pathlib.Path | None:
    return VENV / "bin" / "python" if (VENV / ".asynckv-sglang-0.5.10-ready-3").exists() else None


def skipped(name: str, question: str, out_dir: pathlib.Path | None) -> dict[str, object]:
    """The result of a benchmark that needs the SGLang venv, when there is none (written, with why)."""
    reason = f"no SGLang 0.5.10 venv at {VENV} (bash scripts/sglang-venv.sh builds it)"
    print(f"  skipped: {reason}", flush=True)
    result: dict[str, object] = {"question": question, "skipped": reason}
    write_result(name, result, out_dir)
    return result


def _json_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def sglang_case(python: pathlib.Path, requests: int, pages: int, inflight: int, scattered: bool,
                scale: int) -> dict[str, float]:
    """One run of SGLang's connector, both sides, on one case."""
    spec = DemoSpec(requests=requests, min_pages=pages, max_pages=pages, chunk_pages=pages, inflight=inflight,
                    fill=False, layers=32 // scale)
    rng = np.random.default_rng(1)
    dst = [bench_seed_workload.decode_pages(rng, inflight, pages, k, scattered).tolist() for k in range(inflight)]
    job = {"requests": requests, "pages": pages, "inflight": inflight, "buffers": spec.entries,
           "item": spec.item_bytes, "page_size": spec.page_size}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({**job, "dst": dst}, f)
    env = {**os.environ, "SGLANG_HOST_IP": "127.0.0.1"}
    prefill = subprocess.Popen([str(python), str(PEER), "bench-prefill", json.dumps(job)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert prefill.stdout is not None
        line = ""
        while not line.startswith("{"):
            line = prefill.stdout.readline()
            if not line:
                raise RuntimeError(f"SGLang prefill did not start: {prefill.stderr.read()[-2000:]}")  # type: ignore[union-attr]
        boot = json.loads(line)["bootstrap"]
        decode = subprocess.run([str(python), str(PEER), "bench-decode", boot, f.name], capture_output=True, text=True,
                                env=env, timeout=900)
        if decode.returncode != 0:
            raise RuntimeError(f"SGLang decode failed: {decode.stderr[-2000:]}")
        out, err = prefill.communicate(timeout=120)
        if prefill.returncode != 0:
            raise RuntimeError(f"SGLang prefill failed: {err[-2000:]}")
    finally:
        if prefill.poll() is None:
            prefill.kill()
            prefill.wait()
        pathlib.Path(f.name).unlink(missing_ok=True)
    d = _json_lines(decode.stdout)[-1]
    p = _json_lines(out)[-1]
    lat = np.asarray(d["latencies_s"]) * 1e3
    nbytes = requests * pages * spec.entries * spec.item_bytes
    return {"gbps": nbytes / d["elapsed_s"] / 1e9, "rps": requests / d["elapsed_s"],
            "p50_ms": float(np.percentile(lat, 50)), "p99_ms": float(np.percentile(lat, 99)),
            "cpu_decode_s": d["cpu_s"], "cpu_prefill_s": p["cpu_s"], "gb": nbytes / 1e9}


def _summary(runs: list[dict[str, float]]) -> dict[str, Any]:
    out = medians(runs, ("gbps", "rps", "p50_ms", "p99_ms", "cpu_decode_s", "cpu_prefill_s"))
    out["cpu_s_per_gb"] = statistics.median((r["cpu_decode_s"] + r["cpu_prefill_s"]) / r["gb"] for r in runs)
    return out


LIMIT_KEYS = ("raw_gbps", "raw_one_agent_gbps", "raw_two_agents_gbps", "raw_cpu_s_per_gb", "raw_one_agent_cpu_s_per_gb",
              "copyto_gbps", "copyto_two_threads_gbps", "copyto_cpu_s_per_gb")


def main(argv: list[str] | None = None, out_dir: pathlib.Path | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--scale", type=int, default=1, help="divide the layer count (smoke runs)")
    parser.add_argument("--cases", type=int, default=len(CASES))
    parser.add_argument("--requests", type=int, default=0, help="override every case's request count (smoke)")
    args = parser.parse_args(argv)
    question = "the reference workload: asynckv vs SGLang 0.5.10's NIXL connector, same run"
    python = sglang_python()
    if python is None:
        return skipped("sglang_side_by_side", question, out_dir)
    print("The reference workload, asynckv vs SGLang 0.5.10's connector, interleaved rounds:", flush=True)
    rows = []
    for name, requests, pages, inflight, scattered in CASES[:args.cases]:
        requests = args.requests or requests
        runs: dict[str, list[dict[str, float]]] = {"sglang": [], "asynckv": [], "limit": []}
        sides = list(runs)
        for r in range(args.rounds):
            for side in sides[r % 3:] + sides[:r % 3]:  # who goes first rotates
                if side == "limit":
                    run = limit_case(requests, pages, inflight, scattered, args.scale)
                    print(f"  {name:28s} round {r + 1} limit   : raw NIXL {run['raw_one_agent_gbps']:5.2f} GB/s "
                          f"one agent, {run['raw_two_agents_gbps']:5.2f} two, {run['raw_cpu_s_per_gb']:.2f} CPU s/GB; "
                          f"np.copyto {run['copyto_gbps']:5.2f} one thread, {run['copyto_two_threads_gbps']:5.2f} two",
                          flush=True)
                    runs[side].append(run)
                    continue
                run = sglang_case(python, requests, pages, inflight, scattered, args.scale) if side == "sglang" \
                    else bench_seed_workload.measure_case(requests, pages, inflight, scattered, args.scale)
                runs[side].append(run)
                print(f"  {name:28s} round {r + 1} {side:8s}: {run['gbps']:5.2f} GB/s, {run['rps']:7.1f} req/s, "
                      f"p50 {run['p50_ms']:7.1f} ms, CPU s decode {run['cpu_decode_s']:.2f} prefill "
                      f"{run['cpu_prefill_s']:.2f}", flush=True)
        s, a, lim = _summary(runs["sglang"]), _summary(runs["asynckv"]), medians(runs["limit"], LIMIT_KEYS)
        rows.append({"workload": name, "requests": requests, "pages": pages, "inflight": inflight,
                     "scattered": scattered, "sglang": s, "asynckv": a, "gbps_ratio": a["gbps"] / s["gbps"],
                     "rps_ratio": a["rps"] / s["rps"], "p50_fraction": a["p50_ms"] / s["p50_ms"],
                     "cpu_per_gb_fraction": a["cpu_s_per_gb"] / s["cpu_s_per_gb"], "limit": lim,
                     "of_limit": a["gbps"] / lim["raw_gbps"], "twice_sglang_of_limit": 2 * s["gbps"] / lim["raw_gbps"],
                     "fifth_sglang_cpu_of_copyto": s["cpu_s_per_gb"] / 5 / lim["copyto_cpu_s_per_gb"]
                     if lim["copyto_cpu_s_per_gb"] > 0 else None, "runs": runs})
    result = {"question": question, "rounds": args.rounds, "scale": args.scale, "rows": rows}
    write_result("sglang_side_by_side", result, out_dir)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
