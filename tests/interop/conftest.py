"""The stock SGLang 0.5.10 peer: its venv (built by ``bash scripts/sglang-venv.sh``; ``.ci/run``
builds it) and the script that runs SGLang's own connector in a process of its own."""

from __future__ import annotations

import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
VENV = pathlib.Path(os.environ.get("ASYNCKV_SGLANG_VENV", ROOT / ".cache" / "sglang-0.5.10"))
PEER = pathlib.Path(__file__).with_name("sglang_peer.py")


@pytest.fixture
def sglang_python() -> pathlib.Path:
    """The SGLang venv's Python; the test is skipped, saying how to build it, when there is none."""
    if not (VENV / ".asynckv-sglang-0.5.10-ready-3").exists():
        pytest.skip(f"no SGLang 0.5.10 venv at {VENV} (bash scripts/sglang-venv.sh builds it)")
    return VENV / "bin" / "python"
