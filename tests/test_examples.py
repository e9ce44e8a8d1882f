"""Every example runs on this machine."""

from __future__ import annotations

import pathlib
import signal
import subprocess
import sys

import pytest

EXAMPLES = sorted((pathlib.Path(__file__).parent.parent / "examples").glob("*.py"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_runs(path: pathlib.Path) -> None:
    out = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_readme_state_diagram_is_generated_from_the_transition_table() -> None:
    from asynckv.proto.states import mermaid_diagram

    readme = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    assert mermaid_diagram() in readme, "regenerate the README diagram with asynckv.proto.states.mermaid_diagram()"


def test_cli_help() -> None:
    for args in ([], ["demo"], ["bootstrap-server"], ["selftest"], ["bench"]):
        out = subprocess.run([sys.executable, "-m", "asynckv", *args, "--help"], capture_output=True, text=True)
        assert out.returncode == 0 and "usage: asynckv" in out.stdout


@pytest.mark.parametrize("wire", ["asynckv", "sglang-0.5.10"])
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_the_bootstrap_server_stops_cleanly_on_sigint_or_sigterm_even_with_sigint_ignored(sig: int, wire: str) -> None:
    """Started as a script's background job is (SIGINT ignored), it once ran on when sent SIGINT;
    SIGTERM killed it without closing its server."""
    proc = subprocess.Popen(["sh", "-c", 'trap "" INT; exec "$0" "$@"', sys.executable, "-m", "asynckv",
                             "bootstrap-server", "--port", "0", "--wire", wire],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None and b"bootstrap server" in proc.stdout.readline()
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=10)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0 and b"bootstrap server stopped" in out, (proc.returncode, out, err)


def test_gen_token_prints_a_fresh_secret_each_time() -> None:
    tokens = [subprocess.run([sys.executable, "-m", "asynckv", "gen-token"], capture_output=True, text=True,
                             check=True).stdout.strip() for _ in range(2)]
    assert tokens[0] != tokens[1] and all(len(t) >= 40 and t.isascii() and " " not in t for t in tokens)


def test_selftest_reports_the_transport_and_warns_on_a_tcp_fallback() -> None:
    import os

    out = subprocess.run([sys.executable, "-m", "asynckv", "selftest"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "bulk writes (ucp_put) via: cma/memory" in out.stdout and "selftest OK" in out.stdout
    assert "WARNING" not in out.stdout
    slow = subprocess.run([sys.executable, "-m", "asynckv", "selftest"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "UCX_TLS": "tcp"})
    assert slow.returncode == 0 and "WARNING: SLOW FALLBACK" in slow.stdout and "tcp/" in slow.stdout
