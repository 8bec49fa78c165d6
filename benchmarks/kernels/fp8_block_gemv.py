"""Fine-grained FP8 linears (128 x 128 block scales) at decode sizes: the weight-only GEMV
(kernels/fp8_block.py's ``fp8_block_gemv``) against the W8A8 path it replaces at up to
``FP8_BLOCK_GEMV_MAX_ROWS`` rows (activations quantized per 128 inputs, then the block-scaled
GEMM), on DeepSeek-V3's dense shapes, at 1, 2 and 4 rows. Each pair of weights is checked
against the dequantized reference first. Times: a CUDA graph of 8 calls over 8 weight copies
(no weight is read from L2 twice in a row), µs a call. One device call of well under a minute:

    run(command="python3 -m benchmarks.kernels.fp8_block_gemv --out $OUT/fp8_gemv.json")
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.kernels.timing import graph_replay_us
from lightwell.bench.results import make_record, provenance, script_command, write_json
from lightwell.kernels.act_quant import fp8_groups
from lightwell.kernels.fp8_block import fp8_block_gemv, fp8_block_gemv_ref, fp8_block_matmul

BLOCK = (128, 128)
COPIES = 8
# name: (N, K) of DeepSeek-V3's fine-grained FP8 linears at TP=1
SHAPES = {
    "q_a": (1536, 7168),
    "q_b": (24576, 1536),
    "kv_a": (576, 7168),
    "o": (7168, 16384),
    "shared_gate_up": (4096, 7168),
    "shared_down": (7168, 2048),
}


def bench(name: str, rows: int, common: dict) -> dict:
    n, k = SHAPES[name]
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    ws = [
        (torch.randn(n, k, device="cuda", generator=gen) * 50)
        .clamp(-448, 448)
        .to(torch.float8_e4m3fn)
        for _ in range(COPIES)
    ]
    ss = [torch.rand(n // 128 + (n % 128 > 0), k // 128, device="cuda") * 1e-3 for _ in ws]
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    ref = fp8_block_gemv_ref(x, ws[0], ss[0], BLOCK).float()
    got = fp8_block_gemv(x, ws[0], ss[0], BLOCK).float()
    err = ((got - ref).abs().max() / ref.abs().max()).item()

    def gemv():
        for w, s in zip(ws, ss):
            fp8_block_gemv(x, w, s, BLOCK)

    def w8a8():
        for w, s in zip(ws, ss):
            qx, sx = fp8_groups(x, 128)
            fp8_block_matmul(qx.contiguous(), sx, w, s, BLOCK, x.dtype)

    g_us = graph_replay_us(gemv, calls=COPIES)
    w_us = graph_replay_us(w8a8, calls=COPIES)
    row = {"shape": name, "n": n, "k": k, "rows": rows, "gemv_us": round(g_us, 2),
           "w8a8_us": round(w_us, 2), "speedup": round(w_us / g_us, 2),
           "gemv_tb_s": round(n * k / g_us / 1e6, 3), "rel_err": err}  # fmt: skip
    print(row, flush=True)
    return make_record("fp8_block_gemv_us", g_us, common, **row)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    common = {**provenance("cuda"), "command": script_command()}
    rows = [bench(name, m, common) for name in SHAPES for m in (1, 2, 4)]
    write_json(args.out, rows)


if __name__ == "__main__":
    main()
