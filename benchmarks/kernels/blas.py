"""Decode-shaped matmuls under cuBLAS and cuBLASLt (torch.backends.cuda.preferred_blas_library).
One device call of about a minute:

    run(command="python3 -m benchmarks.kernels.blas --out $OUT/blas.json")

llama-3-8b's four weight shapes per GPU at TP=1 and TP=2, bf16, ``x @ W.T`` with 1-128 rows
(``torch.matmul`` into a preallocated output: the GEMM ``F.linear`` runs). Each timing
cycles through enough copies of the weight (>= 200 MB) that no replay finds it in L2: a CUDA
graph of one launch per copy, median of 20 replays / copies. Reports µs a launch and the
weight bytes streamed per second, and each library's largest error against an fp32
reference (recorded, not asserted). Reference result: benchmarks/results/kernels_blas_h200.json.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

from benchmarks.kernels.timing import graph_replay_us
from lightwell.bench.results import record, write_json

SHAPES = {  # name: (N, K) of the weight on one GPU
    "tp2 qkv": (3072, 4096),
    "tp2 o": (4096, 2048),
    "tp2 gate_up": (14336, 4096),
    "tp2 down": (4096, 7168),
    "tp1 qkv": (6144, 4096),
    "tp1 o": (4096, 4096),
    "tp1 gate_up": (28672, 4096),
    "tp1 down": (4096, 14336),
}
ROWS = (1, 8, 16, 32, 64, 128)
REPS = 20
MIN_BYTES = 200 << 20


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev = torch.device("cuda", 0)
    torch.manual_seed(0)
    rows_out = []
    libs = ("cublas", "cublaslt")
    for name, (n, k) in SHAPES.items():
        nbytes = n * k * 2
        copies = max(2, -(-MIN_BYTES // nbytes))
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) / 64 for _ in range(copies)]
        for m in ROWS:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            outs = [torch.empty(m, n, device=dev, dtype=torch.bfloat16) for _ in ws]
            row = dict(shape=name, n=n, k=k, m=m)
            results = {}
            for lib in libs:
                torch.backends.cuda.preferred_blas_library(lib)

                def run(x=x, ws=ws, outs=outs):
                    for w, o in zip(ws, outs):
                        torch.matmul(x, w.t(), out=o)

                us = graph_replay_us(run, calls=copies, reps=REPS)
                results[lib] = outs[0].clone()
                row[f"{lib}_us"] = round(us, 2)
                row[f"{lib}_tbps"] = round(nbytes / us / 1e6, 2)
            ref = F.linear(x.float(), ws[0].float())
            row["max_err"] = {lib: float((results[lib].float() - ref).abs().max()) for lib in libs}
            rows_out.append(record("cublas_us", row["cublas_us"], **row))
            print(json.dumps(row), flush=True)
    torch.backends.cuda.preferred_blas_library("cublas")
    write_json(args.out, rows_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
