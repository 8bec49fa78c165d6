"""W4A16 matmul (lightwell/kernels/w4a16.py) at llama-3-8b's shapes per GPU, TP=1 and TP=2, group
size 128, bf16 activations: checked against the torch reference, then timed beside cuBLAS on
the bf16 weight of the same shape.

    run(command="python3 -m benchmarks.kernels.w4a16 --out $OUT/w4a16.json")  # ~1 min
    [--rows 1 16] [--act-order]

Timing: a CUDA graph cycling through enough copies of the weights (>= 200 MB) that no launch
finds them in L2; median of 20 replays; µs a call and the 4-bit weights' bytes (with scales and
zeros) a second.
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.kernels.timing import graph_replay_us
from lightwell.bench.results import record, write_json
from lightwell.kernels.w4a16 import w4a16_matmul, w4a16_matmul_ref

SHAPES = {  # name: (N, K) of the weight on one GPU
    "tp1 qkv": (6144, 4096),
    "tp1 o": (4096, 4096),
    "tp1 gate_up": (28672, 4096),
    "tp1 down": (4096, 14336),
    "tp2 qkv": (3072, 4096),
    "tp2 o": (4096, 2048),
    "tp2 gate_up": (14336, 4096),
    "tp2 down": (4096, 7168),
}
GROUP = 128
MIN_BYTES = 200 << 20


def random_w4(n: int, k: int, act_order: bool, dev: torch.device) -> tuple[torch.Tensor, ...]:
    """(qweight [K/8, N], scales [G, N], zeros [G, N], g_idx [K]) of random 4-bit weights."""
    qweight = torch.randint(-(2**31), 2**31 - 1, (k // 8, n), dtype=torch.int32, device=dev)
    scales = torch.rand(k // GROUP, n, device=dev, dtype=torch.bfloat16) * 0.01 + 0.001
    zeros = torch.full((k // GROUP, n), 8.0, device=dev, dtype=torch.bfloat16)
    g_idx = torch.arange(k, device=dev, dtype=torch.int32) // GROUP
    if act_order:
        g_idx = g_idx[torch.randperm(k, device=dev)]
    return qweight, scales, zeros, g_idx


def measure(name: str, rows: list[int], act_order: bool, dev: torch.device) -> list[dict]:
    n, k = SHAPES[name]
    w4_bytes = n * k // 2 + 2 * (k // GROUP) * n * 2
    copies = max(2, -(-MIN_BYTES // w4_bytes))
    weights = [random_w4(n, k, act_order, dev) for _ in range(copies)]
    dense_copies = max(2, -(-MIN_BYTES // (n * k * 2)))
    dense = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) / 64 for _ in range(dense_copies)]
    gs = 0 if act_order else GROUP
    out = []
    for m in rows:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        got = w4a16_matmul(x, *weights[0], group_size=gs).float()
        ref = w4a16_matmul_ref(x.float(), *weights[0]).float()
        err = ((got - ref).abs().max() / ref.abs().max()).item()
        if err > 2e-2:
            raise AssertionError(f"{name} m={m}: relative error {err:.3g} against the reference")
        us = graph_replay_us(
            lambda x=x: [w4a16_matmul(x, *w, group_size=gs) for w in weights], calls=copies
        )
        blas_us = graph_replay_us(lambda x=x: [x @ w.t() for w in dense], calls=dense_copies)
        row = dict(shape=name, n=n, k=k, m=m, act_order=act_order, group=GROUP, rel_err=err)
        row.update(gb_s=w4_bytes / us / 1e3, cublas_bf16_us=blas_us)
        print(json.dumps({**row, "us": us}), flush=True)
        out.append(record("w4a16_us", us, **row))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write the rows as a JSON results file")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--act-order", action="store_true", help="g_idx gathered (act-order)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    torch.manual_seed(0)
    dev = torch.device("cuda", 0)
    rows = [r for name in SHAPES for r in measure(name, args.rows, args.act_order, dev)]
    if args.out:
        write_json(args.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
