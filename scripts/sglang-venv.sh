#!/usr/bin/env bash
# Build (once) a venv with stock SGLang 0.5.10 and a CPU torch: the real peer the interop tests
# talk to. Idempotent: a finished venv has a stamp file and is reused (about 2.5 min and 2.5 GB
# to build; triton is 1 GB of it, needed only because SGLang imports it at module level).
#   bash scripts/sglang-venv.sh [VENV]     (default: .cache/sglang-0.5.10, or $ASYNCKV_SGLANG_VENV)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-${ASYNCKV_SGLANG_VENV:-.cache/sglang-0.5.10}}"
STAMP="$VENV/.asynckv-sglang-0.5.10-ready-3"
if [ -f "$STAMP" ]; then
    echo "sglang venv ready: $VENV"
    exit 0
fi
rm -rf "$VENV"  # (an older stamp means an older package list: rebuilt)
mkdir -p "$(dirname "$VENV")"
t0=$(date +%s)
python3 -m venv "$VENV"
PIP=("$VENV/bin/pip" install --quiet --disable-pip-version-check)
echo "sglang venv: torch (CPU)"
"${PIP[@]}" torch==2.13.0
echo "sglang venv: sglang 0.5.10 and nixl 1.5.1 without their dependencies"
"${PIP[@]}" --no-deps sglang==0.5.10 nixl==1.5.1
echo "sglang venv: the packages SGLang's import chain needs (pinned; never torchvision, never nixl-cu13)"
CONSTRAINTS="$(mktemp)"
echo "torch==2.13.0+cpu" > "$CONSTRAINTS"
"${PIP[@]}" -c "$CONSTRAINTS" nixl-cu12==1.5.1 numpy==2.4.6 pyzmq==27.3.0 requests==2.34.2 aiohttp==3.14.5 \
    psutil==7.2.2 pybase64==1.5.1 orjson==3.13.0 packaging==26.4 pillow==13.0.0 starlette==1.10.0 \
    pydantic==2.14.4 tqdm==4.70.1 ipython==9.18.1 dill==0.4.1 sentencepiece==0.2.3 safetensors==0.8.0 \
    partial-json-parser==0.2.1.1.post7 openai==2.6.1 transformers==5.3.0 huggingface_hub==1.33.0 triton==3.9.0 \
    prometheus-client==0.26.0 einops==0.8.2 gguf==0.19.0 msgspec==0.23.0 loguru==0.7.3
# prometheus-client: asynckv's own dependency (the backend tests import asynckv from the checkout);
# einops, gguf, msgspec, compressed-tensors: on the import path of SGLang's scheduler modules
# (compressed-tensors declares transformers<5, which SGLang 0.5.10 does not use: without its deps).
"${PIP[@]}" --no-deps compressed-tensors==0.14.0.1
rm -f "$CONSTRAINTS"
"$VENV/bin/python" -c "import sglang, nixl._api, torch; assert sglang.__version__ == '0.5.10', sglang.__version__; assert not torch.cuda.is_available()"
touch "$STAMP"
echo "sglang venv ready: $VENV ($(( $(date +%s) - t0 )) s)"
