"""The int8 all-reduce's quantize and sum kernels (lightwell/kernels/int8_pack.py) on one GPU,
per tile shape. One device call of about a minute:

    run(command="python3 -m benchmarks.kernels.int8_pack --out $OUT/int8_pack.json")

For messages of 64-2,048 tokens x 4,096 bf16 in hostmem-copy-int8's layout (int8_layout, 4
rows): ``quantize_pack`` and the 2-rank ``dequant_sum``, µs a launch (a CUDA graph of 20
launches back to back, median of 20 replays / 20), per tile (groups a program x warps). The
floor: a device copy of the input (read x, write as many bytes again), which moves more bytes
than the quantize (1.5 per element). Reference result:
benchmarks/results/kernels_int8_pack_h200.json.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from benchmarks.kernels.timing import graph_replay_us
from lightwell.bench.results import record, write_json

LAUNCHES, REPS = 20, 20
TOKENS = (64, 512, 1024, 2048)
HIDDEN = 4096


def timed(fn) -> float:
    """Median µs of one ``fn`` (LAUNCHES of it captured back to back in a graph)."""
    return graph_replay_us(lambda: [fn() for _ in range(LAUNCHES)], calls=LAUNCHES, reps=REPS)


def one_size(tokens, dev, i8, emit, setting) -> None:
    """Checks and timings of one message size."""
    from lightwell.distributed.comm.hostmem_copy import int8_layout

    n = tokens * HIDDEN
    rows, cols = int8_layout(n, 4)
    rb = i8.packed_row_bytes(cols)
    xs = [torch.randn(n, device=dev, dtype=torch.bfloat16) * (r + 1) for r in range(2)]
    stage = torch.zeros((2, rows * rb), dtype=torch.uint8, device=dev)
    out = torch.empty(n, device=dev, dtype=torch.bfloat16)

    def quant(x=xs[0], buf=stage[0]):
        i8.quantize_pack(x, rows, cols, out=buf.view(rows, rb))

    def dsum():
        i8.dequant_sum(stage, cols, rows, out)

    for r in range(2):
        quant(xs[r], stage[r])
    packed = stage.clone()
    copy_src = xs[0]
    copy_dst = torch.empty_like(copy_src)
    floor = timed(lambda: copy_dst.copy_(copy_src))
    emit("copy_us", floor, what="copy floor", tokens=tokens, tbps=round(2 * n * 2 / floor / 1e6, 2))
    for gpp, warps in ((16, 4), (8, 4), (32, 4), (16, 8), (32, 8), (64, 8)):
        setting(gpp, warps)
        stage.copy_(packed)
        tq, ts = timed(quant), timed(dsum)
        # bytes moved: quantize reads 2 n, writes rows * rb; the sum reads 2 rows * rb, writes 2 n
        emit(
            "quantize_us", tq, what="kernels", tokens=tokens, rows=rows, cols=cols, gpp=gpp,
            warps=warps, sum_us=round(ts, 2),
            quantize_tbps=round((2 * n + rows * rb) / tq / 1e6, 2),
            sum_tbps=round((2 * rows * rb + 2 * n) / ts / 1e6, 2),
        )  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from lightwell.kernels import int8_pack as i8

    dev = torch.device("cuda", 0)
    torch.manual_seed(0)
    rows_out = []

    def emit(metric: str, us: float, **fields) -> None:
        rows_out.append(record(metric, us, **fields))
        print(json.dumps({"metric": metric, "us": round(us, 2), **fields}), flush=True)

    saved = i8.GROUPS_PER_PROGRAM, i8.TILE_WARPS

    def setting(gpp: int, warps: int) -> None:
        i8.GROUPS_PER_PROGRAM, i8.TILE_WARPS = gpp, warps

    for tokens in TOKENS:
        one_size(tokens, dev, i8, emit, setting)
    setting(*saved)
    write_json(args.out, rows_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
