"""The summary table (markdown, for the READMEs) and one PNG chart per question."""

from __future__ import annotations

import json
import pathlib
from typing import Any


def _load(out: pathlib.Path, name: str) -> dict[str, Any] | None:
    path = out / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def render(out: pathlib.Path, charts: bool = False) -> str:
    lines = ["| question | asynckv | baseline (same run) | ratio | target |", "|---|---|---|---|---|"]
    tp = _load(out, "throughput")
    if tp:
        for r in tp["rows"]:
            if r["bytes"] >= 16 * 2**20:
                lines.append(f"| Q1 bulk {r['bytes'] / 2**20:.0f} MiB {r['layout']}, one request / {r['inflight']} in "
                             f"flight | {r['asynckv_gbps']:.2f} / {r['asynckv_pipelined_gbps']:.2f} GB/s | raw NIXL "
                             f"{r['raw_nixl_gbps']:.2f} / {r['raw_pipelined_gbps']:.2f} GB/s, np.copyto "
                             f"{r['copyto_gbps']:.2f} | {r['ratio_vs_raw']:.2f}x / {r['pipelined_ratio']:.2f}x raw"
                             f"{_from_send(r)}{_cpu_bound(r)} | >= 0.9x |")
    sm = _load(out, "small_requests")
    if sm:
        for r in sm["rows"]:
            zmq = (f"; on ZMQ {r['zmq_p50_ms']:.2f} / {r['zmq_p99_ms']:.2f} ms, "
                   f"{r['zmq_rps']:.0f} req/s" if "zmq_p50_ms" in r else "")
            added = f" (ZMQ +{r['zmq_added_p50_ms']:.2f} ms)" if "zmq_added_p50_ms" in r else ""
            lines.append(f"| Q2 {r['pages']}-page request p50 / p99 | {r['asynckv_p50_ms']:.2f} / "
                         f"{r['asynckv_p99_ms']:.2f} ms, {r['asynckv_rps']:.0f} req/s{zmq} | raw WRITE+notif "
                         f"{r['raw_p50_ms']:.3f} / {r['raw_p99_ms']:.3f} ms | +{r['added_p50_ms']:.2f} ms{added} | "
                         f"<= +1 ms |")
    cc = _load(out, "concurrency")
    if cc:
        for r in cc["rows"]:
            prefill = f", prefill {r['prefill_loop_lag_p99_ms']:.2f} ms" if "prefill_loop_lag_p99_ms" in r else ""
            if "prefill_steady_loop_lag_p99_ms" in r:
                prefill = (f" (steady state {r['steady_loop_lag_p99_ms']:.2f}), prefill "
                           f"{r['prefill_loop_lag_p99_ms']:.2f} ms (steady state "
                           f"{r['prefill_steady_loop_lag_p99_ms']:.2f})")
            cpu = (f"; loop CPU per room: decode {r['decode_loop_cpu_ms_per_room']:.3f} ms, prefill "
                   f"{r['prefill_loop_cpu_ms_per_room']:.3f} ms" if "prefill_loop_cpu_ms_per_room" in r else "")
            bare = (f"{r['of_bare_rooms_per_s']:.2f}x the bare pair's rooms/s, {r['cpu_per_room_x_bare']:.1f}x its "
                    f"CPU per room" if "of_bare_rooms_per_s" in r else "")
            lines.append(f"| Q3 {r['inflight']} rooms in flight, {r['loop']}, {r.get('control_transport', 'zmq')} "
                         f"control | {r['rooms_per_s']:.0f} rooms/s, "
                         f"p50 {r['latency_p50_ms']:.0f} / p99 {r['latency_p99_ms']:.0f} ms{cpu} | loop lag p99: "
                         f"decode {r['loop_lag_p99_ms']:.2f} ms{prefill} | {bare} | lag <= 5 ms, >= 5,000 rooms/s |")
        b = cc.get("bare_pair")
        if b:
            lines.append(f"| Q3 baseline: the bare pair (one message each way and one NIXL write per room, no "
                         f"connector; before and after, averaged) | {b['rooms_per_s']:.0f} rooms/s; process CPU per "
                         f"room {b['decode_process_cpu_ms_per_room']:.3f} decode / "
                         f"{b['prefill_process_cpu_ms_per_room']:.3f} ms prefill | | | |")
    kn = _load(out, "kernels")
    if kn:
        for r in kn["rows"]:
            if r["pages"] >= 16384:
                lines.append(f"| Q4 {r['model']} {r['pages']} pages {r['layout']} | {r['coalesced_ms']:.1f} ms "
                             f"({r['descriptors']} descs); prepped {r['prepped_indices_ms']:.1f} ms | Python "
                             f"{r['python_ms']:.0f} ms ({r['python_descriptors']} descs) | "
                             f"{r['speedup_coalesced']:.0f}x / {r['speedup_prepped']:.0f}x | |")
        most = max((r["rows"] for r in kn.get("inline_vs_offload", [])), default=0)

        def crossover(rows: int | None) -> str:  # (None: building inline stayed under the hop at every size)
            return f"{rows} rows" if rows is not None else f"none up to {most} rows"
        lines.append(f"| Q4 offload crossover | {crossover(kn['offload_crossover_rows_prepped'])} (prepped), "
                     f"{crossover(kn['offload_crossover_rows_descriptors'])} (coalesced) | thread hop "
                     f"{kn['thread_hop_us']:.0f} us | | |")
    idle = _load(out, "idle")
    if idle:
        lines.append(f"| Q5 idle pair CPU | {idle['idle_pair_cpu_pct']:.1f}% of a core; "
                     f"{idle['waiting_rooms_cpu_pct']:.1f}% with {idle['rooms_waiting']} rooms waiting | | | < 5% |")
    fc = _load(out, "first_contact")
    if fc:
        lines.append(f"| Q6 first contact | median {fc['median_ms']:.1f} ms, p90 {fc['p90_ms']:.1f} ms | | | "
                     f"< 100 ms |")
        fr = fc.get("first_room_ms")
        if fr:
            lines.append(f"| Q6 a fresh decode's first 1-page room, init() to Success, after "
                         f"`prefill_instance(connect=True)` | median {fr['preconnected']['median']:.1f} ms | cold: "
                         f"{fr['cold']['median']:.1f} ms; a later room on the pair: {fr['later']['median']:.1f} ms | "
                         f"{fr['preconnected']['median'] / fr['cold']['median']:.2f}x | |")
    sim = _load(out, "simulator")
    if sim:
        lines.append(f"| Q7 simulator: seeded fault schedules over the real cores | {sim['schedules']:,} schedules, "
                     f"{sim['rooms']:,} rooms, {sim['simulated_hours']} simulated hours in {sim['seconds']:.0f} s | "
                     f"invariants I1-I5 after every step | {sim['violations']} violations | 0 |")
    hs = _load(out, "head_slice")
    if hs:
        for r in hs["rows"]:
            lines.append(f"| head-slice kernel {r['pages']} pages | {r['numpy_ms']:.1f} ms | per-token Python "
                         f"{r['python_ms']:.0f} ms | {r['speedup']:.0f}x | |")
    sg = _load(out, "sglang_side_by_side")
    if sg and not sg.get("skipped"):
        for r in sg["rows"]:
            s, a = r["sglang"], r["asynckv"]
            lines.append(f"| reference workload: {r['workload']} | {a['gbps']:.2f} GB/s, {a['rps']:.0f} req/s, decode "
                         f"p50 {a['p50_ms']:.0f} ms, {a['cpu_s_per_gb']:.2f} CPU s/GB | SGLang 0.5.10's connector: "
                         f"{s['gbps']:.2f} GB/s, {s['rps']:.0f} req/s, p50 {s['p50_ms']:.0f} ms, "
                         f"{s['cpu_s_per_gb']:.2f} CPU s/GB | {r['gbps_ratio']:.2f}x GB/s, p50 "
                         f"x{r['p50_fraction']:.2f}, CPU/GB x{r['cpu_per_gb_fraction']:.2f} | >= 2x GB/s |")
            if "limit" in r:
                lim, fifth = r["limit"], r.get("fifth_sglang_cpu_of_copyto")
                fifth_text = "n/a (too short to time)" if fifth is None else f"{fifth:.2f}x"
                lines.append(f"| reference workload: {r['workload']}, against this machine's limit | "
                             f"{a['gbps']:.2f} GB/s | raw NIXL, the same pages: {lim['raw_gbps']:.2f} GB/s "
                             f"(one agent {lim['raw_one_agent_gbps']:.2f}, two on two threads "
                             f"{lim['raw_two_agents_gbps']:.2f}), {lim['raw_cpu_s_per_gb']:.2f} CPU s/GB; np.copyto "
                             f"{lim['copyto_gbps']:.2f} GB/s one thread, {lim['copyto_two_threads_gbps']:.2f} two | "
                             f"{r['of_limit']:.2f}x raw; 2x SGLang would be {r['twice_sglang_of_limit']:.2f}x raw, "
                             f"1/5 of SGLang's CPU/GB {fifth_text} np.copyto's | >= 0.8x |")
    sp = _load(out, "sglang_poll")
    if sp and not sp.get("skipped"):
        a, s = sp["asynckv"], sp["sglang"]
        lines.append(f"| SGLang scheduler loop, {sp['queued']} requests queued: poll() per request per iteration | "
                     f"{a['median_us']:.2f} us median, {a['p99_us']:.2f} us p99 | SGLang's NixlKVSender.poll(): "
                     f"{s['median_us']:.2f} / {s['p99_us']:.2f} us | | <= 5 us |")
    for ht in (_load(out, "hetero_tp"), _load(out, "hetero_tp_mamba"), _load(out, "hetero_tp_mixed")):
        if not ht:
            continue
        equal = ht["rows"][0]
        model = " (mamba hybrid)" if ht.get("mamba") else " (two prefill TPs)" if ht.get("mixed") else ""
        for r in ht["rows"][1:]:
            lines.append(f"| heterogeneous TP{model}: {r['case']} | {r['gbps']:.2f} GB/s ({r['gbps_spread'][0]:.2f}-"
                         f"{r['gbps_spread'][1]:.2f}), {r['cpu_s_per_gb']:.2f} CPU s/GB | {equal['case']}: "
                         f"{equal['gbps']:.2f} GB/s, {equal['cpu_s_per_gb']:.2f} CPU s/GB | "
                         f"{r['ratio_vs_equal_tp']:.2f}x | >= 0.8x |")
            if "staged_ceiling_gbps" in r:
                lines.append(f"| heterogeneous TP{model}: {r['case']}, against this machine's limit for staging | "
                             f"{r['gbps']:.2f} GB/s | equal TP plus a gather (or scatter) of the same slices on two "
                             f"threads ({ht['gather_gbps']:.2f} GB/s): {r['staged_ceiling_gbps']:.2f} GB/s, "
                             f"{r['staged_ceiling_gbps'] / equal['gbps']:.2f}x equal TP | "
                             f"{r['ratio_vs_staged_ceiling']:.2f}x | |")
    ct = _load(out, "control_transport")
    if ct:
        by = {r["transport"]: r for r in ct["rows"]}
        pairs = [("a control message over a bare TCP stream (ping-pong, two processes, uvloop)", "tcp", "zmq",
                  "bare ZMQ PUSH/PULL")]
        if "stream-channel" in by:
            pairs.append(("the same through asynckv's StreamChannel (the default)", "stream-channel", "zmq-channel",
                          "through its ControlChannel (ZMQ)"))
        for what, fast, slow, base in pairs:
            t, z = by[fast], by[slow]
            lines.append(f"| {what} | round trip p50 {t['rtt_p50_us']:.0f} us, CPU per round trip "
                         f"{t['cpu_us_per_round_trip_ping']:.0f} / {t['cpu_us_per_round_trip_pong']:.0f} us | {base}: "
                         f"{z['rtt_p50_us']:.0f} us, {z['cpu_us_per_round_trip_ping']:.0f} / "
                         f"{z['cpu_us_per_round_trip_pong']:.0f} us | {z['rtt_p50_us'] / t['rtt_p50_us']:.1f}x faster, "
                         f"{z['cpu_us_per_round_trip_ping'] / t['cpu_us_per_round_trip_ping']:.1f}x less CPU | |")
    sc = _load(out, "scaling")
    if sc:
        one = {r["case"]: r["gbps"] for r in sc["lanes"] if r["lanes"] == 1}
        for r in sc["lanes"]:
            if r["lanes"] > 1 and r["case"] in one:
                lines.append(f"| scaling: {r['case']}, {r['lanes']} write lanes | {r['gbps']:.2f} GB/s "
                             f"({r['gbps_spread'][0]:.2f}-{r['gbps_spread'][1]:.2f}), {r['rps']:.0f} req/s | 1 lane: "
                             f"{one[r['case']]:.2f} GB/s | {r['gbps'] / one[r['case']]:.2f}x | |")
    if charts:
        _charts(out)
    return "\n".join(lines)


def _from_send(r: dict[str, Any]) -> str:
    """Q1's one-request ratio timed from prefill's send() (absent from older results)."""
    return f" (one request from send(): {r['from_send_ratio_vs_raw']:.2f}x)" if "from_send_ratio_vs_raw" in r else ""


def _cpu_bound(r: dict[str, Any]) -> str:
    """Q1's pipelined CPU accounting (absent from older results)."""
    if "cpu_bound_ratio" not in r:
        return ""
    return (f"; {r['inflight']} in flight kept {r['asynckv_pipelined_cores_busy']:.0%} of {r['cores']} cores busy, "
            f"{r['asynckv_pipelined_cpu_s_per_gb']:.3f} CPU s/GB (raw {r['raw_two_agents_cpu_s_per_gb']:.3f}): "
            f"CPU-bound at {r['cpu_bound_ratio']:.2f}x raw")


def render_scaling(out: pathlib.Path) -> str:
    """The scaling sweeps as three markdown tables (empty when there is no result)."""
    sc = _load(out, "scaling")
    if not sc:
        return ""
    lines = ["| case | write lanes | GB/s (min-max) | req/s | decode p50 ms | prefill CPU s while serving |",
             "|---|---|---|---|---|---|"]
    for r in sc["lanes"]:
        lines.append(f"| {r['case']} | {r['lanes']} | {r['gbps']:.2f} ({r['gbps_spread'][0]:.2f}-"
                     f"{r['gbps_spread'][1]:.2f}) | {r['rps']:.0f} | {r['p50_ms']:.0f} | {r['cpu_prefill_s']:.2f} |")
    lines += ["", "| pages per request | indices per request | GB/s | req/s | decode p50 ms | prefill CPU s/GB | "
              "prefill CPU ms/request |",
              "|---|---|---|---|---|---|---|"]
    for r in sc["pages"]:
        lines.append(f"| {r['pages']} | {r['descriptors_per_request']} | {r['gbps']:.2f} | {r['rps']:.0f} | "
                     f"{r['p50_ms']:.1f} | {r['cpu_s_per_gb']:.2f} | {r['cpu_ms_per_request']:.2f} |")
    lines += ["", "| 1-page rooms in flight | rooms/s (min-max) | decode p50 / p99 ms |", "|---|---|---|"]
    for r in sc["inflight"]:
        lines.append(f"| {r['inflight']} | {r['rps']:.0f} ({r['rps_spread'][0]:.0f}-{r['rps_spread'][1]:.0f}) | "
                     f"{r['p50_ms']:.1f} / {r['p99_ms']:.1f} |")
    return "\n".join(lines)


def _charts(out: pathlib.Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    tp = _load(out, "throughput")
    if tp:
        rows = [r for r in tp["rows"] if r["layout"] == "scattered"]
        labels = [f"{r['bytes'] / 2**20:g} MiB" for r in rows]
        x = range(len(rows))
        fig, ax = plt.subplots(figsize=(8, 4))
        for k, (key, name) in enumerate((("asynckv_pipelined_gbps", "asynckv, 4 in flight"),
                                         ("raw_pipelined_gbps", "raw NIXL, back to back"),
                                         ("copyto_gbps", "np.copyto"))):
            ax.bar([i + 0.27 * (k - 1) for i in x], [r[key] for r in rows], 0.27, label=name)
        ax.set_xticks(list(x), labels)
        ax.set_ylabel("GB/s")
        ax.set_title("Q1 bulk throughput, scattered pages (higher is better)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "throughput.png", dpi=100)
        plt.close(fig)
    sm = _load(out, "small_requests")
    if sm:
        rows = sm["rows"]
        x = range(len(rows))
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.bar([i - 0.2 for i in x], [r["asynckv_p50_ms"] for r in rows], 0.4, label="asynckv room p50")
        ax.bar([i + 0.2 for i in x], [r["raw_p50_ms"] for r in rows], 0.4, label="raw WRITE+notif p50")
        ax.set_xticks(list(x), [f"{r['pages']} pages" for r in rows])
        ax.set_ylabel("ms")
        ax.set_title("Q2 small-request latency (lower is better)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "small_requests.png", dpi=100)
        plt.close(fig)
    sg = _load(out, "sglang_side_by_side")
    if sg and not sg.get("skipped"):
        rows = sg["rows"]
        x = range(len(rows))
        fig, ax = plt.subplots(figsize=(9, 4.5))
        bars = [("asynckv", "gbps", "asynckv"), ("sglang", "gbps", "SGLang 0.5.10's NIXL connector")]
        if all("limit" in r for r in rows):
            bars.append(("limit", "raw_gbps", "raw NIXL, fastest configuration (the machine's limit)"))
        width = 0.8 / len(bars)
        for n, (side, key, label) in enumerate(bars):
            medians = [r[side][key] for r in rows]
            spread = [[m - r[side][f"{key}_spread"][0] for m, r in zip(medians, rows, strict=True)],
                      [r[side][f"{key}_spread"][1] - m for m, r in zip(medians, rows, strict=True)]]
            ax.bar([i + (n - (len(bars) - 1) / 2) * width for i in x], medians, width, yerr=spread, capsize=3,
                   label=label)
        ax.set_xticks(list(x), [r["workload"].replace(", ", "\n") for r in rows], fontsize=8)
        ax.set_ylabel("GB/s (median, min-max)")
        ax.set_title("The reference workload, same run (higher is better)")
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=len(bars))
        fig.tight_layout()
        fig.savefig(out / "sglang_side_by_side.png", dpi=100)
        plt.close(fig)
