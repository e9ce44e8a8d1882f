#!/usr/bin/env bash
# Create .venv and install asynckv with its test tools. Idempotent; ~1 minute on a fresh machine.
#
# nixl is installed with --no-deps: its nixl-cu12/nixl-cu13 wheels declare a dependency
# on torch, which pip would resolve to a multi-GB CUDA build, yet nixl's Python API never
# imports torch. The wheels carry UCX and run on CPU-only machines (DRAM transfers).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip --disable-pip-version-check)
"${PIP[@]}" install -q --no-deps 'nixl==1.5.1' 'nixl-cu12==1.5.1' 'nixl-cu13==1.5.1'
"${PIP[@]}" install -q -e '.[test,fast,bench]' 2>&1 | grep -v -e "dependency resolver" -e "requires torch" || true
.venv/bin/python -c "import nixl._api, asynckv" || { echo "install failed: nixl or asynckv does not import" >&2; exit 1; }
