#!/usr/bin/env bash
# The README's main command: installs what it needs, then hot-swaps a running vLLM engine's weights.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$(bash scripts/setup.sh | tail -n 1)
exec "$PY" examples/demo.py "$@"
