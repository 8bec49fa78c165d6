#!/usr/bin/env bash
# What still waits for nvidia-h200-x2 (written without two GPUs; run from anywhere):
#   run(kind="nvidia-h200-x2", timeout_s=600,
#       command="LIGHTWELL_COMMIT=<short hash> bash benchmarks/gpu_pending.sh $OUT")
# Part x2 (the default, ~9.5 minutes): the Triton kernel tests on CUDA (the all-reduce's PDL
#   signal has not run on a GPU yet), the NVLink all-reduce table with `peermem` beside
#   hostmem-ll and one-shot, the model check of auto / peermem, and W1 at TP=1 and TP=2 with
#   PDL (the default since tp_run12) and without, with the all-reduce kernel signalling the
#   GEMV after it (LIGHTWELL_PDL_ALLREDUCE=1), with peermem, and with the split combine in
#   the attention kernel. gpu_tp.py runs the engines in its ENGINES order and skips what
#   its budget leaves no time for.
# Part solo (one H200; ran as tp_run12 call 1): the Triton kernel tests on CUDA,
#   benchmarks/gpu_pdl.py, and W1 at TP=1 with PDL / the combine.
# Results land in $1 (logs, JSON); summary.txt has each step's exit status.
set -uo pipefail
out=$(realpath -m "${1:?usage: gpu_pending.sh OUT_DIR [x2|solo]}")
part=${2:-x2}
mkdir -p "$out"
cd "$(dirname "$0")/.." || exit 1
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
step() {  # name, seconds, command...
  local name=$1 secs=$2
  shift 2
  local t0=$SECONDS
  timeout "$secs" "$@" > "$out/$name.log" 2>&1
  echo "$name: rc=$? ($((SECONDS - t0)) s)" | tee -a "$out/summary.txt"
}
if [ "$part" = solo ]; then
  step kernel_tests 300 python3 -m pytest -q tests/kernels/test_triton_kernels.py
  step gpu_pdl 120 python3 benchmarks/gpu_pdl.py --out "$out/pdl.json"
  (cd benchmarks && step tp 150 python3 gpu_tp.py --out "$out/tp" --modes nvlink --stages none \
    --budget-s 140 --engines tp1,tp1-nopdl,tp1-combine)
elif [ "$part" = x2 ]; then
  step kernel_tests 180 python3 -m pytest -q tests/kernels/test_triton_kernels.py
  (cd benchmarks && export TP_CHECK_ONLY=auto,peermem \
    TP_TABLE_ONLY=nccl,oneshot-1shot,hostmem-ll,hostmem-ll+norm,peermem,peermem+norm &&
    step tp 390 python3 gpu_tp.py --out "$out/tp" \
    --modes nvlink --stages allreduce,check --allreduce-s 70 --budget-s 380 \
    --engines tp1,tp2-auto,tp2-auto-nopdl,tp2-auto-pdlar,tp2-peermem,tp2-peermem-pdlar,tp2-auto-combine)
else
  echo "unknown part: $part (x2 or solo)" >&2
  exit 2
fi
