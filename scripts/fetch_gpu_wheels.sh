#!/usr/bin/env bash
# Download the server's wheels for the registry-less GPU machine (Python 3.12, x86-64) into
# .whl/ (git-ignored). Carry it with the device tool (`carry: [".whl"]`);
# benchmarks/workloads/w3.sh installs them there, or by hand:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site:$PYTHONPATH
# The GPU image already has anyio, h11, click, typing-extensions, zipp, aiohttp, prometheus-client.
set -euo pipefail
cd "$(dirname "$0")/.."
PKGS=(fastapi starlette pydantic pydantic-core uvicorn annotated-types typing-inspection
      annotated-doc opentelemetry-api importlib-metadata gguf xgrammar apache-tvm-ffi)
. .venv/bin/activate
for p in "${PKGS[@]}"; do
  v=$(python -c "import importlib.metadata as m; print(m.version('$p'))" 2>/dev/null || true)
  spec=$p${v:+==$v}
  python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "$spec"
done
du -sh .whl
