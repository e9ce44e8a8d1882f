"""Q3 concurrency: 1,000 rooms in flight on one pair: throughput, request latency p50/p99
and event-loop lag p99 (target at most 5 ms), on asyncio and on uvloop.

Decode runs in a child process per event-loop flavour and keeps 1,000 rooms in flight
(4-page requests of 2 x 32 KiB pages); prefill is another process (the demo worker, on
uvloop) serving them as fast as it can. A ticker task on each side's loop measures how late
1 ms sleeps wake. The first 1,000 rooms start together (a burst); each side's lag is also
reported for the steady state after that burst (past the first 30% of the run).

The baseline, in the same run (before and after the connector's runs, averaged): the bare pair
(``_bare.py``), the same load with nothing but one small message each way and one NIXL write per
room, NIXL called from the loop thread: what any connector's rooms/s and CPU per room on this
host are measured against.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import subprocess
import sys
from typing import Any

import numpy as np

from asynckv.demo import DemoSpec, LagProbe

from ._common import write_result
from ._pairs import decode_against_prefill_process, receive_plan


async def _run(rooms: int, inflight: int) -> dict[str, float]:
    spec = DemoSpec(layers=1, kv_heads=8, head_dim=128, page_size=16, requests=rooms, min_pages=4, max_pages=4,
                    chunk_pages=4, inflight=inflight, fill=False, seed=7, report_loop_lag=True)
    printed: list[str] = []
    async with decode_against_prefill_process(spec, printed) as (d, spec, pool):
        probe = LagProbe()  # (the prefill process runs the same probe: both sides measured alike)
        latencies, elapsed = await receive_plan(d, spec, lambda k: np.arange(4) + 4 * k)
        decode_lag = probe.stop()
    prefill_lag = next(ev for ev in (json.loads(line) for line in printed if line.startswith("{"))
                       if ev.get("event") == "loop_lag")
    lat = np.asarray(latencies) * 1e3
    return {"rooms": rooms, "inflight": inflight, "rooms_per_s": rooms / elapsed,
            "gbps": rooms * 4 * pool.page_bytes / elapsed / 1e9, "latency_p50_ms": float(np.percentile(lat, 50)),
            "latency_p99_ms": float(np.percentile(lat, 99)),
            "loop_lag_p99_ms": decode_lag["p99_ms"], "loop_lag_max_ms": decode_lag["max_ms"],
            "steady_loop_lag_p99_ms": decode_lag["steady_p99_ms"],
            "prefill_loop_lag_p99_ms": prefill_lag["p99_ms"], "prefill_loop_lag_max_ms": prefill_lag["max_ms"],
            "prefill_steady_loop_lag_p99_ms": prefill_lag["steady_p99_ms"],
            # CPU per room: the loop thread's (what caps rooms/s on one loop) and the process's.
            "decode_loop_cpu_ms_per_room": decode_lag["loop_cpu_s"] / rooms * 1e3,
            "decode_process_cpu_ms_per_room": decode_lag["process_cpu_s"] / rooms * 1e3,
            "prefill_loop_cpu_ms_per_room": prefill_lag["loop_cpu_s"] / rooms * 1e3,
            "prefill_process_cpu_ms_per_room": prefill_lag["process_cpu_s"] / rooms * 1e3}


def child(loop: str, rooms: int, inflight: int) -> None:
    if loop in ("uvloop", "bare"):
        import uvloop

        uvloop.install()
    if loop == "bare":
        from ._bare import run_decode

        print("RESULT " + json.dumps(asyncio.run(run_decode(rooms, inflight))), flush=True)
        return
    print("RESULT " + json.dumps(asyncio.run(_run(rooms, inflight))), flush=True)


def _child_run(loop: str, rooms: int, inflight: int, transport: str = "stream") -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "benchmarks.bench_concurrency", "--child", loop, "--rooms",
                          str(rooms), "--inflight", str(inflight)], capture_output=True, text=True,
                         cwd=pathlib.Path(__file__).parent.parent, timeout=600,
                         env={**os.environ, "ASYNCKV_CONTROL_TRANSPORT": transport})
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{loop} run failed:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(line[7:])
    return result


def main(argv: list[str] | None = None, out_dir: pathlib.Path | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rooms", type=int, default=5000)
    parser.add_argument("--inflight", type=int, default=1000)
    parser.add_argument("--child", choices=["asyncio", "uvloop", "bare"])
    parser.add_argument("--transports", nargs="*", default=["stream", "zmq"], choices=["stream", "zmq"],
                        help="control transports, each run with both loops (the children read it from "
                             "ASYNCKV_CONTROL_TRANSPORT)")
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, args.rooms, args.inflight)
        return {}
    print(f"Q3 {args.inflight} rooms in flight ({args.rooms} rooms, decode and prefill in separate processes):")
    bare_runs = []

    def bare() -> None:  # before and after the connector's runs: the VM's speed drifts within minutes
        b = _child_run("bare", args.rooms, args.inflight)
        bare_runs.append(b)
        print(f"  bare pair (one message each way and one NIXL write per room, no connector): "
              f"{b['rooms_per_s']:7.0f} rooms/s; CPU per room: process {b['decode_process_cpu_ms_per_room']:.3f} / "
              f"{b['prefill_process_cpu_ms_per_room']:.3f} ms", flush=True)

    bare()
    rows = []
    for transport, loop in ((t, lp) for t in args.transports for lp in ("asyncio", "uvloop")):
        row = {"loop": loop, "control_transport": transport, **_child_run(loop, args.rooms, args.inflight, transport)}
        rows.append(row)
        print(f"  {transport:6s} {loop:8s}: {row['rooms_per_s']:7.0f} rooms/s, latency p50 "
              f"{row['latency_p50_ms']:7.1f} ms p99 {row['latency_p99_ms']:7.1f} ms, decode loop lag p99 "
              f"{row['loop_lag_p99_ms']:.2f} ms "
              f"(steady state {row['steady_loop_lag_p99_ms']:.2f}, max {row['loop_lag_max_ms']:.1f}), prefill "
              f"(uvloop) p99 {row['prefill_loop_lag_p99_ms']:.2f} ms (steady state "
              f"{row['prefill_steady_loop_lag_p99_ms']:.2f}); CPU per room: loop "
              f"{row['decode_loop_cpu_ms_per_room']:.3f} ms decode, {row['prefill_loop_cpu_ms_per_room']:.3f} ms "
              f"prefill; process "
              f"{row['decode_process_cpu_ms_per_room']:.3f} / {row['prefill_process_cpu_ms_per_room']:.3f} ms",
              flush=True)
    bare()
    keys = ("rooms_per_s", "decode_process_cpu_ms_per_room", "prefill_process_cpu_ms_per_room")
    baseline = {k: float(np.mean([float(b[k]) for b in bare_runs])) for k in keys}
    base_cpu = baseline["decode_process_cpu_ms_per_room"] + baseline["prefill_process_cpu_ms_per_room"]
    for row in rows:
        row["of_bare_rooms_per_s"] = float(row["rooms_per_s"]) / baseline["rooms_per_s"]
        row["cpu_per_room_x_bare"] = (float(row["decode_process_cpu_ms_per_room"])
                                      + float(row["prefill_process_cpu_ms_per_room"])) / base_cpu
        print(f"  {row['control_transport']:6s} {row['loop']:8s}: {row['of_bare_rooms_per_s']:.2f}x the bare pair's "
              f"rooms/s, {row['cpu_per_room_x_bare']:.1f}x its CPU per room")
    result: dict[str, object] = {"question": __doc__.strip().splitlines()[0], "rows": rows,
                                 "bare_pair": {**baseline, "runs": bare_runs}}
    write_result("concurrency", result, out_dir)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
