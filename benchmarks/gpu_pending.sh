#!/usr/bin/env bash
# What was written without a GPU on 2026-12-01 (all off by default), to be measured on
# nvidia-h200-x2 in two device calls of ~9 minutes (run from the repository root or anywhere):
#   run(kind="nvidia-h200-x2", timeout_s=600,
#       command="LIGHTWELL_COMMIT=<short hash> bash benchmarks/gpu_pending.sh $OUT 1")   # then 2
# Part 1: the Triton kernel tests on CUDA (the split combine with real concurrency, the PDL
#   kernels as they launch); benchmarks/gpu_pdl.py (one GPU: 32 layers of norm + GEMV with PDL
#   off and on: bit-identical outputs, graph replay times); the NVLink all-reduce table with
#   peermem beside hostmem-ll and one-shot, and the model check of nccl / auto / peermem; W1
#   for TP=1 and TP=2 with and without PDL + the in-kernel combine, and with peermem.
# Part 2: W1 for each of PDL and the combine alone (TP=1 and TP=2; the combine engines also
#   profiled, tp1 / tp2-auto also through their TTFT and decode stages). The all-reduce table
#   of part 1 is cut to the rows that matter (TP_TABLE_ONLY) so it ends inside its time box.
# Part solo (one H200, when the two-GPU kinds are withheld): the kernel tests, gpu_pdl, and W1
#   at TP=1 with each of PDL and the combine, alone and together.
# Results land in $1 (logs, JSON); summary.txt has each step's exit status.
set -uo pipefail
out=$(realpath -m "${1:?usage: gpu_pending.sh OUT_DIR PART}")
part=${2:-1}
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
if [ "$part" = 1 ]; then
  step kernel_tests 150 python3 -m pytest -q tests/kernels/test_triton_kernels.py
  step gpu_pdl 120 python3 benchmarks/gpu_pdl.py --out "$out/pdl.json"
  (cd benchmarks && export TP_CHECK_ONLY=auto,peermem \
    TP_TABLE_ONLY=nccl,oneshot-1shot,hostmem-ll,hostmem-ll+norm,peermem,peermem+norm &&
    step tp 300 python3 gpu_tp.py --out "$out/tp" \
    --modes nvlink --stages allreduce,check --allreduce-s 70 --budget-s 280 \
    --engines tp1,tp2-auto,tp2-peermem,tp1-pdl-combine,tp2-auto-pdl-combine,tp2-peermem-pdl-combine)
elif [ "$part" = solo ]; then
  step kernel_tests 150 python3 -m pytest -q tests/kernels/test_triton_kernels.py
  step gpu_pdl 120 python3 benchmarks/gpu_pdl.py --out "$out/pdl.json"
  (cd benchmarks && step tp 290 python3 gpu_tp.py --out "$out/tp" --modes nvlink --stages none \
    --budget-s 280 --engines tp1,tp1-pdl,tp1-combine,tp1-pdl-combine)
else
  (cd benchmarks && step tp 560 python3 gpu_tp.py --out "$out/tp" --modes nvlink --stages none \
    --budget-s 540 --engines tp1,tp1-combine,tp1-pdl,tp2-auto,tp2-auto-combine,tp2-auto-pdl)
fi
