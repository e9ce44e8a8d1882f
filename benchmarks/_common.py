"""Shared helpers: machine facts and result files (benchmarks/results/<name>.json)."""

from __future__ import annotations

import json
import os
import pathlib
import platform
import statistics
import sys
import time
from collections.abc import Callable
from importlib import metadata
from typing import Any

RESULTS = pathlib.Path(__file__).parent / "results"


def machine_facts() -> dict[str, Any]:
    cpu = "unknown"
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    versions: dict[str, str | None] = {}
    for pkg in ("asynckv", "nixl", "numpy", "pyzmq", "aiohttp", "uvloop"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(mem_gib, 1), "python": sys.version.split()[0],
            "platform": platform.platform(), "versions": versions,
            "date": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}


def best_of(fn: Callable[[], Any], repeat: int = 3) -> float:
    """Smallest wall time of ``repeat`` calls, in seconds."""
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def medians(runs: list[dict[str, float]], keys: tuple[str, ...]) -> dict[str, Any]:
    """Per key: the median over ``runs`` and ``<key>_spread`` = [min, max]."""
    out: dict[str, Any] = {}
    for key in keys:
        values = [r[key] for r in runs]
        out[key] = statistics.median(values)
        out[f"{key}_spread"] = [min(values), max(values)]
    return out


def write_result(name: str, data: dict[str, Any], out_dir: pathlib.Path | None = None) -> pathlib.Path:
    path = (out_dir or RESULTS) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"benchmark": name, "machine": machine_facts(), **data}, indent=2) + "\n")
    return path
