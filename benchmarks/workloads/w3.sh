#!/usr/bin/env bash
# W3 on one or two H200s: `lightwell serve` on llama-3-8b shapes (dummy weights, bf16, no
# tokenizer) under `lightwell bench serve`, Poisson arrivals at 32, 8 and 2 req/s, 500 requests
# of 1,024 in / 256 out (token-id prompts, EOS ignored). One device call, about 6 minutes:
#   here:   scripts/fetch_gpu_wheels.sh          (fastapi, uvicorn, pydantic... into .whl/)
#   device: run(command="bash benchmarks/workloads/w3.sh $OUT", carry=[".whl"], timeout_s=600)
# TP=2 (kind nvidia-h200-x2) for two GPUs over NVLink; with MODE=pcie-emulated,
# NCCL_P2P_DISABLE=1 and --no-custom-all-reduce, like a PCIe box without peer access (auto then
# picks the hostmem all-reduce). Override with RATES=... NUM_PROMPTS=... INPUT_LEN=...
# OUTPUT_LEN=... MODEL_JSON=... MODEL_NAME=... (the results' model) VOCAB=... (SKIP_WHEELS=1
# where fastapi is installed).
# SERVE_ARGS="..." adds options to `lightwell serve` (e.g. "--all-reduce hostmem-copy-int8
# --dual-stream") and CONFIG=... names the configuration in the results. Results land in $1:
# w3_gpu.json (the records; reference: benchmarks/results/W3_tp1_h200.json, W3_tp2_*.json),
# w3_gpu.png, bench.log, serve.log and the server's per-step trace steps.jsonl.gz
# (--step-trace; python3 -m benchmarks.tools.step_trace_report OUT/steps.jsonl.gz).
set -uo pipefail
out=${1:?usage: w3.sh OUT_DIR}
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
# the command recorded in every result: this script with the settings it ran under
command="TP=${TP:-1} MODE=${MODE:-} MODEL_NAME=${MODEL_NAME:-llama-3-8b}"
command+=" RATES=${RATES:-32,8,2} NUM_PROMPTS=${NUM_PROMPTS:-500}"
command+=" CONFIG=${CONFIG:-default} SERVE_ARGS='${SERVE_ARGS:-}' bash benchmarks/workloads/w3.sh OUT"
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
  --metadata model="${MODEL_NAME:-llama-3-8b}" dtype=bfloat16 tp="${TP:-1}" mode="${MODE:-$([ "${TP:-1}" = 1 ] && echo single || echo nvlink)}" \
  config="${CONFIG:-default}" command="$command" \
  --result-json "$out/w3_gpu.json" --plot "$out/w3_gpu.png" 2>&1 | tee "$out/bench.log"
rc=$?
kill -TERM $server; wait $server
gzip -f "$out/steps.jsonl"  # the server's per-step trace (--step-trace), a JSON line a step
exit $rc
