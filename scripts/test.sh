#!/usr/bin/env bash
# The README's test command: installs what it needs, then runs every test tier but `gpu`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$(bash scripts/setup.sh | tail -n 1)
exec "$PY" -m pytest -m "not gpu" "$@"
