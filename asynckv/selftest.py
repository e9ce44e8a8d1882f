"""``asynckv selftest``: move real bytes between two local agents and report the transport.

A child process runs a prefill and a decode manager and moves 64 MiB with
``UCX_PROTO_INFO=y``; the parent reads which UCX transport carried the bulk writes and
warns loudly when it is a slow fallback (TCP instead of CMA, shared memory, RDMA or CUDA
IPC: a cliff of 10-100x that users otherwise only find in their latency graphs).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from typing import Any, TextIO

__all__ = ["run_probe", "run_selftest"]

FAST = ("cma", "sysv", "posix", "xpmem", "knem", "rc", "dc", "ud", "cuda_ipc", "gdr_copy", "cuda_copy")


async def _probe() -> dict[str, Any]:
    import numpy as np

    from .config import Config
    from .proto.states import KVPoll
    from .service.manager import KVManager, Mode
    from .testing.workload import KVPool, fill_pages, verify_pages

    pages, item = 64, 1 << 20  # 64 pages of 1 MiB in one entry pair
    src, dst = KVPool(2, pages // 2, item // 2), KVPool(2, pages // 2, item // 2)
    fill_pages(src, 1, np.arange(pages // 2))
    cfg = Config(host="127.0.0.1")
    async with KVManager(Mode.PREFILL, src.kv_args(), bootstrap_addr="127.0.0.1:0", config=cfg) as p, \
            KVManager(Mode.DECODE, dst.kv_args(), config=cfg) as d:
        addr = p.bootstrap_addr or ""
        t0 = time.perf_counter()
        receiver = d.receiver(addr, 1)
        await receiver.init(np.arange(pages // 2)[::-1].copy())
        sender = p.sender(1)
        await sender.wait_ready(10)
        sender.init(pages // 2)
        await sender.send(np.arange(pages // 2))
        ok = await receiver.wait(30) == KVPoll.Success and await sender.wait(30) == KVPoll.Success
        elapsed = time.perf_counter() - t0
        verified = ok and verify_pages(dst, 1, np.arange(pages // 2)[::-1]) == 0
    return {"ok": bool(verified), "bytes": src.page_bytes * (pages // 2), "seconds": elapsed,
            "backend": cfg.nixl_backend}


def run_probe() -> int:
    print("SELFTEST " + json.dumps(asyncio.run(_probe())), flush=True)
    return 0


def _transports(log: str) -> tuple[list[str], list[str]]:
    """(bulk write transports, active-message transports) from UCX_PROTO_INFO tables."""
    bulk: list[str] = []
    am: list[str] = []
    current: list[str] | None = None
    for line in log.splitlines():
        if "remote memory write by ucp_put" in line:
            current = bulk
        elif "active message by ucp_am_send" in line:
            current = am
        elif current is not None and line.rstrip().endswith("|"):
            cells = [c.strip() for c in line.split("|") if c.strip()]
            for transport in re.findall(r"\b[a-z_]+/[\w.:-]+", cells[-1] if cells else ""):
                if transport not in current:
                    current.append(transport)
    return bulk, am


def run_selftest(out: TextIO | None = None) -> int:
    out = out or sys.stdout
    env = {**os.environ, "UCX_PROTO_INFO": "y"}
    try:
        proc = subprocess.run([sys.executable, "-m", "asynckv", "_selftest-probe"], capture_output=True, text=True,
                              env=env, timeout=120)
    except subprocess.TimeoutExpired:
        print("selftest FAILED: the transfer did not finish within 120 s", file=out)
        return 1
    log = proc.stdout + proc.stderr
    result = next((json.loads(line[9:]) for line in proc.stdout.splitlines() if line.startswith("SELFTEST ")), None)
    if proc.returncode != 0 or result is None:
        print(f"selftest FAILED (exit {proc.returncode}):\n{log[-2000:]}", file=out)
        return 1
    bulk, am = _transports(log)
    gbps = result["bytes"] / result["seconds"] / 1e9
    print(f"NIXL backend: {result['backend']}", file=out)
    print(f"bulk writes (ucp_put) via: {', '.join(bulk) or 'unknown'}", file=out)
    print(f"control/notifications (active messages) via: {', '.join(am) or 'unknown'}", file=out)
    print(f"moved {result['bytes'] / 2**20:.0f} MiB between two local agents in {result['seconds'] * 1e3:.1f} ms "
          f"({gbps:.2f} GB/s, including connection set-up); bytes verified: {result['ok']}", file=out)
    if bulk and not any(t.split("/")[0] in FAST for t in bulk):
        print("WARNING: SLOW FALLBACK. Bulk KV writes go over "
              f"{', '.join(bulk)}; expect 10-100x less bandwidth than a memory transport "
              "(check ptrace/CMA permissions, UCX_TLS, UCX_NET_DEVICES).", file=out)
    if not result["ok"]:
        print("selftest FAILED: the bytes did not arrive intact", file=out)
        return 1
    print("selftest OK", file=out)
    return 0
