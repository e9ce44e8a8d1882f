"""The cost SGLang's scheduler loop pays for asynckv as its transfer backend: ``poll()`` of every
queued request every iteration, with 1,000 prefill requests queued (waiting for their decode),
against SGLang 0.5.10's own ``NixlKVSender.poll()`` in the same process and run (target: <= 5 us
per request per iteration). Runs in the SGLang venv (``tests/interop/sglang_backend_rank.py``,
role ``poll-bench``); skipped, with the reason, without it.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys

from . import bench_sglang
from ._common import write_result

ROLE = bench_sglang.ROOT / "tests" / "interop" / "sglang_backend_rank.py"


def main(argv: list[str] | None = None, out_dir: pathlib.Path | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--queued", type=int, default=1000)
    parser.add_argument("--iterations", type=int, default=2000)
    args = parser.parse_args(argv)
    question = "SGLang scheduler loop: poll() cost per queued request per iteration (asynckv backend vs SGLang's)"
    python = bench_sglang.sglang_python()
    if python is None:
        return bench_sglang.skipped("sglang_poll", question, out_dir)
    env = {**os.environ, "PYTHONPATH": str(bench_sglang.ROOT), "SGLANG_HOST_IP": "127.0.0.1"}
    run = subprocess.run([str(python), str(ROLE), "poll-bench", str(args.queued), str(args.iterations)],
                         capture_output=True, text=True, env=env, timeout=600)
    if run.returncode != 0:
        raise RuntimeError(run.stderr[-3000:])
    data = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")][-1]
    ours, theirs = data["asynckv"], data["sglang"]
    print(f"  {args.queued} queued: asynckv poll() {ours['median_us']:.3f} us median, {ours['p99_us']:.3f} us p99 "
          f"per request per iteration; SGLang's NixlKVSender {theirs['median_us']:.3f} / {theirs['p99_us']:.3f} us",
          flush=True)
    result = {"question": question, **data, "target_us": 5.0}
    write_result("sglang_poll", result, out_dir)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
