"""The stock SGLang peers: their venvs (built by ``bash scripts/sglang-venv.sh [VERSION]``; ``.ci/run``
builds both) and the script that runs SGLang's own connector in a process of its own. 0.5.10 is the
wire and backend interface asynckv pairs with; 0.5.23, the newest release, is tested as a backend host."""

from __future__ import annotations

import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
VENV = pathlib.Path(os.environ.get("ASYNCKV_SGLANG_VENV", ROOT / ".cache" / "sglang-0.5.10"))
VENVS = {"0.5.10": VENV,
         "0.5.23": pathlib.Path(os.environ.get("ASYNCKV_SGLANG_023_VENV", ROOT / ".cache" / "sglang-0.5.23"))}
PEER = pathlib.Path(__file__).with_name("sglang_peer.py")


def venv_python(version: str) -> pathlib.Path:
    """That SGLang venv's Python; the test is skipped, saying how to build it, when there is none."""
    venv = VENVS[version]
    if not (venv / f".asynckv-sglang-{version}-ready-3").exists():
        pytest.skip(f"no SGLang {version} venv at {venv} (bash scripts/sglang-venv.sh {version} builds it)")
    return venv / "bin" / "python"


@pytest.fixture
def sglang_python() -> pathlib.Path:
    """SGLang 0.5.10's Python (its wire and connector)."""
    return venv_python("0.5.10")


@pytest.fixture(params=["0.5.10", "0.5.23"])
def sglang_backend_python(request: pytest.FixtureRequest) -> pathlib.Path:
    """Each SGLang version asynckv's backend adapter supports."""
    return venv_python(str(request.param))
