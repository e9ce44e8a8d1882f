#!/usr/bin/env bash
# Build (once) a venv with a stock SGLang and a CPU torch: the real SGLang the interop tests talk to
# (0.5.10, its wire and its backend interface) and the newest release the backend adapter supports
# (0.5.23). Idempotent: a finished venv has a stamp file and is reused (about 2.5 min and 2.5 GB
# each to build; triton is 1 GB of it, needed only because SGLang imports it at module level).
#   bash scripts/sglang-venv.sh [VERSION [VENV]]
#   (default 0.5.10 into .cache/sglang-0.5.10, or $ASYNCKV_SGLANG_VENV; 0.5.23 into .cache/sglang-0.5.23)
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION="${1:-0.5.10}"
case "$VERSION" in
    0.5.10)
        VENV="${2:-${ASYNCKV_SGLANG_VENV:-.cache/sglang-0.5.10}}"
        # sglang 0.5.10 pins transformers 5.3.0 and openai 2.6.1
        PINS=(transformers==5.3.0 openai==2.6.1 sentencepiece==0.2.3)
        NO_DEPS=(compressed-tensors==0.14.0.1)  # (declares transformers<5, which SGLang 0.5.10 does not use)
        ;;
    0.5.23)
        VENV="${2:-${ASYNCKV_SGLANG_023_VENV:-.cache/sglang-0.5.23}}"
        PINS=(transformers==5.19.0 openai==2.8.0 sentencepiece==0.2.1 apache-tvm-ffi==0.1.11)
        NO_DEPS=(compressed-tensors==0.20.1)
        ;;
    *)
        echo "sglang-venv.sh: SGLang $VERSION is not one the tests use (0.5.10, 0.5.23)" >&2
        exit 2
        ;;
esac
STAMP="$VENV/.asynckv-sglang-$VERSION-ready-3"
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
echo "sglang venv: sglang $VERSION and nixl 1.5.1 without their dependencies"
"${PIP[@]}" --no-deps "sglang==$VERSION" nixl==1.5.1
echo "sglang venv: the packages SGLang's import chain needs (pinned; never torchvision, never nixl-cu13)"
CONSTRAINTS="$(mktemp)"
printf 'torch==2.13.0+cpu\n%s\n' "${PINS[0]}" > "$CONSTRAINTS"
"${PIP[@]}" -c "$CONSTRAINTS" nixl-cu12==1.5.1 numpy==2.4.6 pyzmq==27.3.0 requests==2.34.2 aiohttp==3.14.5 \
    psutil==7.2.2 pybase64==1.5.1 orjson==3.13.0 packaging==26.4 pillow==13.0.0 starlette==1.10.0 \
    pydantic==2.14.4 tqdm==4.70.1 ipython==9.18.1 dill==0.4.1 safetensors==0.8.0 \
    partial-json-parser==0.2.1.1.post7 huggingface_hub==1.33.0 triton==3.9.0 "${PINS[@]}" \
    prometheus-client==0.26.0 einops==0.8.2 gguf==0.19.0 msgspec==0.23.0 loguru==0.7.3
# prometheus-client: asynckv's own dependency (the backend tests import asynckv from the checkout);
# einops, gguf, msgspec, compressed-tensors, tvm-ffi: on the import path of SGLang's scheduler modules.
"${PIP[@]}" --no-deps "${NO_DEPS[@]}"
# asynckv itself, for its "sglang.srt.plugins" entry point (SGLang 0.5.23 discovers plugins through
# installed distributions); the tests import asynckv's code from the checkout (PYTHONPATH first).
"${PIP[@]}" --no-deps .
rm -f "$CONSTRAINTS"
"$VENV/bin/python" -c "import sglang, nixl._api, torch; assert sglang.__version__ == '$VERSION', sglang.__version__; assert not torch.cuda.is_available()"
touch "$STAMP"
echo "sglang venv ready: $VENV ($(( $(date +%s) - t0 )) s)"
