"""Skinny GEMM (decode linears) on the GPU: our Triton gemv vs cuBLAS (F.linear), llama-3-8b
weight shapes, bf16, M = 1..16 rows; checked against the fp32 reference, timed as CUDA-graph
replays (triton.testing.do_bench_cudagraph), with a small config sweep.

    python3 benchmarks/gpu_gemv.py --out $OUT/gemv.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton.testing  # noqa: E402

from lightwell.kernels.gemv import gemv, gemv_ref, pick_config  # noqa: E402

SHAPES = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}
COPY_GBPS = 4221.0


def bench(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=50) * 1e3  # us


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", default="1,4,8,16")
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    rows = []
    torch.manual_seed(0)
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        for m in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            err = (gemv(x, w).float() - gemv_ref(x, w).float()).abs().max().item()
            ours = bench(lambda x=x, w=w: gemv(x, w))
            cublas = bench(lambda x=x, w=w: F.linear(x, w))
            best = (ours, pick_config(n, k, x.device))
            if args.sweep and m == 1:
                for bn, bk, sp in itertools.product((16, 32, 64), (128, 256), (1, 2, 4)):
                    cfg = (bn, bk, sp, 4, 4)
                    try:
                        t = bench(lambda cfg=cfg, x=x, w=w: gemv(x, w, config=cfg))
                    except Exception:
                        continue
                    if t < best[0]:
                        best = (t, cfg)
            gb = n * k * 2 / 1e9
            row = dict(
                shape=name,
                n=n,
                k=k,
                m=m,
                max_err=err,
                ours_us=ours,
                cublas_us=cublas,
                ours_gbps=gb / ours * 1e6,
                cublas_gbps=gb / cublas * 1e6,
                best_us=best[0],
                best_config=best[1],
                best_gbps=gb / best[0] * 1e6,
            )
            rows.append(row)
            print(
                f"{name:8} m={m:2d} ours {ours:8.1f}us {row['ours_gbps']:6.0f} GB/s  cublas "
                f"{cublas:8.1f}us {row['cublas_gbps']:6.0f} GB/s  best {best[0]:8.1f}us "
                f"{best[1]} err {err:.3g}",
                flush=True,
            )
            with open(args.out, "w") as f:
                json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
