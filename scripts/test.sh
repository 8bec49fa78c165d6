#!/usr/bin/env bash
# Install (if needed) and run the CPU test suite: the README's test command and what CI runs.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --test
. .venv/bin/activate
export OMP_WAIT_POLICY=PASSIVE
ruff check .
python -m pytest -q -m "not gpu" "$@"
