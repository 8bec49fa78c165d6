#!/usr/bin/env bash
# W3 (PERFORMANCE.md) on one H200: `lightwell serve` on llama-3-8b shapes (dummy weights, bf16,
# no tokenizer) under `lightwell bench serve`, Poisson arrivals at 2, 8 and 32 req/s, 500
# requests of 1,024 in / 256 out (token-id prompts, EOS ignored). One device call (~6 min):
#   here:   scripts/fetch_gpu_wheels.sh          (fastapi, uvicorn, pydantic... into .whl/)
#   device: run(command="bash benchmarks/gpu_w3.sh $OUT", carry=[".whl"], timeout_s=600)
# Override with RATES=... NUM_PROMPTS=... TP=... INPUT_LEN=... OUTPUT_LEN=... MODEL_JSON=...
# VOCAB=... (SKIP_WHEELS=1 where fastapi is installed); results land in $1 (JSON, PNG, logs).
# MODE=pcie-emulated (with TP=2): NCCL_P2P_DISABLE=1 and --no-custom-all-reduce, like a PCIe
# box without peer access (auto then picks the hostmem all-reduce). SERVE_ARGS="..." adds
# options to `lightwell serve` (e.g. "--all-reduce hostmem-copy-int8 --dual-stream
# --cuda-graph-prefill-tokens 2048") and CONFIG=... names the configuration in the results.
# The server writes its per-step trace to steps.jsonl.gz (--step-trace).
set -uo pipefail
out=${1:?usage: gpu_w3.sh OUT_DIR}
mkdir -p "$out"
PY=${PYTHON:-python3}
if [ -z "${SKIP_WHEELS:-}" ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
port=8123
extra=()
if [ "${MODE:-}" = pcie-emulated ]; then
  export NCCL_P2P_DISABLE=1
  extra=(--no-custom-all-reduce)
fi
set -f  # SERVE_ARGS: split into words, never glob-expanded
$PY -m lightwell.cli serve --port "$port" --load-format dummy --hf-config-json "${MODEL_JSON:-llama-3-8b}" \
  --dtype "${DTYPE:-bfloat16}" --skip-tokenizer-init --tensor-parallel-size "${TP:-1}" \
  --log-level WARNING --step-trace "$out/steps.jsonl" "${extra[@]}" ${SERVE_ARGS:-} \
  > "$out/serve.log" 2>&1 &
server=$!
set +f
for _ in $(seq 240); do
  curl -sf "http://127.0.0.1:$port/health" > /dev/null && break
  kill -0 $server 2>/dev/null || { tail -30 "$out/serve.log"; exit 1; }
  sleep 1
done
$PY -m lightwell.cli bench serve --base-url "http://127.0.0.1:$port" --token-ids \
  --vocab-size "${VOCAB:-128256}" --input-len "${INPUT_LEN:-1024}" \
  --output-len "${OUTPUT_LEN:-256}" --ignore-eos \
  --num-prompts "${NUM_PROMPTS:-500}" --request-rate "${RATES:-32,8,2}" --no-progress \
  --metadata model=llama-3-8b dtype=bfloat16 tp="${TP:-1}" mode="${MODE:-$([ "${TP:-1}" = 1 ] && echo single || echo nvlink)}" \
  config="${CONFIG:-default}" \
  --result-json "$out/w3_gpu.json" --plot "$out/w3_gpu.png" 2>&1 | tee "$out/bench.log"
rc=$?
kill -TERM $server; wait $server
gzip -f "$out/steps.jsonl"  # the server's per-step trace (--step-trace), a JSON line a step
exit $rc
