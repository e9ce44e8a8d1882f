"""A manager its user never closed, as its event loop ends: real NIXL, real sockets, in a child
process (its engine threads and agents must not outlive the test in this one)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.integration

CHILD = textwrap.dedent("""
    import asyncio, json, threading, time
    import numpy as np
    from asynckv import KVArgs, KVManager, KVPoll, Mode

    async def main():
        kv = np.random.default_rng(0).integers(0, 255, (8, 16, 4096), dtype=np.uint8)
        out = np.zeros_like(kv)
        prefill = KVManager(Mode.PREFILL, KVArgs.from_arrays(kv, page_size=16), bootstrap_addr="127.0.0.1:0")
        decode = KVManager(Mode.DECODE, KVArgs.from_arrays(out, page_size=16))
        await prefill.start()
        await decode.start()
        receiver = decode.receiver(prefill.bootstrap_addr, 1)
        await receiver.init([3, 1])
        sender = prefill.sender(1)
        await sender.wait_ready(5)
        sender.init(2)
        await sender.send([0, 1])
        assert await receiver.wait(5) == KVPoll.Success and np.array_equal(out[:, [3, 1]], kv[:, [0, 1]])
        await decode.receiver(prefill.bootstrap_addr, 2).init([5])  # a room left mid-way too
        return sum(t.name.startswith("asynckv-nixl") for t in threading.enumerate()), prefill

    engines, prefill = asyncio.run(main())  # returns without closing either manager
    deadline = time.monotonic() + 5
    while any(t.name.startswith("asynckv-nixl") for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.01)
    left = [t.name for t in threading.enumerate() if t.name.startswith("asynckv-nixl")]
    try:
        asyncio.run(prefill.close())  # too late, and from another loop
        late = "closed"
    except Exception as exc:
        late = f"{type(exc).__name__}: {exc}"
    print(json.dumps({"engines": engines, "left": left, "late_close": late}))
""")


def test_managers_left_open_as_asyncio_run_ends_stop_their_engine_threads_quietly() -> None:
    """Before: each engine thread that still had a settle to hand over died of the closed loop (two
    tracebacks each), and the others polled for ever, holding the registered memory."""
    child = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "PYTHONWARNINGS": "ignore::ResourceWarning"})
    assert child.returncode == 0, child.stderr[-3000:]
    report = json.loads(child.stdout.strip().splitlines()[-1])
    assert report["engines"] == 3 and report["left"] == [], report  # (prefill's two write lanes, decode's engine)
    assert "Traceback" not in child.stderr and "engine thread died" not in child.stderr, child.stderr[-3000:]
    assert child.stderr.count("event loop closed, the plane open") == 3, child.stderr[-3000:]
    # closing it later, from another loop, says why it cannot (it raised a ValueError deep inside, after
    # logging a traceback, having failed its rooms halfway)
    assert report["late_close"].startswith("LocalProtocolError: ") and "a closed event loop" in \
        report["late_close"], report
