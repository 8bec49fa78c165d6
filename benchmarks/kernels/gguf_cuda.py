"""GGUF block kernels on the GPU (lightwell/kernels/gguf_dequant.py) at llama-3-8b's TP=1 linear
shapes, for Q4_0, Q4_1, Q8_0, Q4_K, Q5_K and Q6_K: the GEMV (1 and 8 rows of x) and the
dequantize-then-cuBLAS path that serves more rows (16 and 2,048), each checked against the torch
reference (``gguf_dequantize_ref`` then a float32 matmul) before it is timed, beside cuBLAS on
the bf16 weight of the same shape. One device call of about a minute:

    run(command="python3 -m benchmarks.kernels.gguf_cuda --out $OUT/gguf_cuda.json")

``--crossover``: instead, both paths at 1-8 rows for every type and shape (the rows where the
GEMV stops paying: ``quant/gguf_cuda.GEMV_MAX_TOKENS``), about a minute too.

Weights: random block bytes with each block's fp16 scales (d, dmin) set to small finite values
(random bytes elsewhere are valid quants). Timing: a CUDA graph cycling through enough weight
copies (>= 200 MB) that no launch finds them in L2, median of 20 replays; µs a call and the
blocks' bytes a second.
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.kernels.timing import graph_replay_us
from lightwell.bench.results import record, write_json
from lightwell.kernels import gguf_dequant as gd
from lightwell.kernels.gguf_dequant import BLOCKS, gguf_dequantize, gguf_dequantize_ref, gguf_gemv

SHAPES = {"qkv": (6144, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
NAMES = {getattr(gd, t): t for t in ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")}
# byte offsets of each block's fp16 scales
SCALES = {gd.Q4_0: (0,), gd.Q4_1: (0, 2), gd.Q8_0: (0,), gd.Q4_K: (0, 2), gd.Q5_K: (0, 2),
          gd.Q6_K: (208,)}  # fmt: skip
MIN_BYTES = 200 << 20


def random_blocks(n: int, k: int, qtype: int, dev: torch.device) -> torch.Tensor:
    values, nbytes = BLOCKS[qtype]
    nb = k // values
    w = torch.randint(0, 256, (n, nb, nbytes), dtype=torch.uint8, device=dev)
    for off in SCALES[qtype]:
        d = (torch.rand(n, nb, device=dev) * 0.01 + 0.001).to(torch.float16)
        w[:, :, off : off + 2] = d.view(torch.uint8).view(n, nb, 2)
    return w.view(n, nb * nbytes)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def dequant_matmul(x: torch.Tensor, w: torch.Tensor, qtype: int) -> torch.Tensor:
    return x @ gguf_dequantize(w, qtype, x.dtype).t()


def weights(name: str, qtype: int, dev: torch.device) -> tuple:
    """(N, K, the blocks' bytes, copies of random blocks filling MIN_BYTES, the first copy
    dequantized by the reference [N, K] fp32) of a shape."""
    n, k = SHAPES[name]
    nbytes = n * k // BLOCKS[qtype][0] * BLOCKS[qtype][1]
    copies = [random_blocks(n, k, qtype, dev) for _ in range(max(2, -(-MIN_BYTES // nbytes)))]
    return n, k, nbytes, copies, gguf_dequantize_ref(copies[0], qtype)


def measure(name: str, qtype: int, dev: torch.device) -> list[dict]:
    n, k, nbytes, copies, ref_w = weights(name, qtype, dev)
    dense = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) / 64 for _ in range(2)]
    rows = []
    for m in (1, 8, 16, 2048):
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        ref = x.float() @ ref_w.t()
        path = "gemv" if m <= 8 else "dequant+cublas"

        def call(w, x=x, m=m):
            return gguf_gemv(x, w, qtype) if m <= 8 else dequant_matmul(x, w, qtype)

        err = rel_err(call(copies[0]), ref)
        if err > 2e-2:
            raise AssertionError(f"{NAMES[qtype]} {name} m={m}: relative error {err:.3g}")
        us = graph_replay_us(lambda call=call: [call(w) for w in copies], calls=len(copies))
        cublas = graph_replay_us(lambda x=x: [x @ w.t() for w in dense], calls=len(dense))
        row = dict(qtype=NAMES[qtype], shape=name, n=n, k=k, m=m, path=path, rel_err=err,
                   gb_s=nbytes / us / 1e3, cublas_bf16_us=cublas)  # fmt: skip
        print(json.dumps({**row, "us": round(us, 2)}), flush=True)
        rows.append(record("gguf_cuda_us", us, **row))
    return rows


def crossover(name: str, qtype: int, dev: torch.device) -> list[dict]:
    """The GEMV and dequantize + cuBLAS at 1-8 rows, each checked, then timed."""
    n, k, _, copies, ref_w = weights(name, qtype, dev)
    rows = []
    for m in range(1, 9):
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        ref = x.float() @ ref_w.t()
        times = {}
        paths = {
            "gemv": lambda w, x=x: gguf_gemv(x, w, qtype),
            "dequant+cublas": lambda w, x=x: dequant_matmul(x, w, qtype),
        }
        for path, call in paths.items():
            err = rel_err(call(copies[0]), ref)
            if err > 2e-2:
                raise AssertionError(f"{NAMES[qtype]} {name} m={m} {path}: error {err:.3g}")
            times[path] = graph_replay_us(lambda call=call: [call(w) for w in copies],
                                          calls=len(copies))  # fmt: skip
            rows.append(record("gguf_cuda_us", times[path], qtype=NAMES[qtype], shape=name, n=n,
                               k=k, m=m, path=path, rel_err=err))  # fmt: skip
        print(f"{NAMES[qtype]} {name} m={m}: gemv {times['gemv']:.1f} us, dequant+cublas "
              f"{times['dequant+cublas']:.1f}", flush=True)  # fmt: skip
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write the rows as a JSON results file")
    ap.add_argument("--types", default="Q4_0,Q4_1,Q8_0,Q4_K,Q5_K,Q6_K")
    ap.add_argument(
        "--crossover", action="store_true", help="GEMV vs dequantize + cuBLAS, 1-8 rows"
    )
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    torch.manual_seed(0)
    dev = torch.device("cuda", 0)
    by_name = {v: q for q, v in NAMES.items()}
    rows = []
    for t in args.types.split(","):
        for name in SHAPES:
            if args.crossover:
                rows += crossover(name, by_name[t], dev)
            else:
                rows += measure(name, by_name[t], dev)
    if args.out:
        write_json(args.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
