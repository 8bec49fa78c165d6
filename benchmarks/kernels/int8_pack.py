"""The int8 all-reduce's quantize and sum kernels (lightwell/kernels/int8_pack.py) on one GPU.

    python3 benchmarks/gpu_int8_pack.py --out $OUT/int8_pack.json

For messages of 64-2,048 tokens x 4,096 bf16 in hostmem-copy-int8's layout (int8_layout, 4
rows): ``quantize_pack`` and the 2-rank ``dequant_sum``, µs a launch (a CUDA graph of 20
launches back to back, median of 20 replays / 20), per variant:
- ``align``: the 16-byte alignment hints on (``ALIGN_HINTS``) or off (sizes unspecialised:
  every element its own load / store);
- tiles: groups a program x warps.
Checks first: hints on and off give the same bytes. The floor: a device copy of the input
(read x, write as many bytes again), which moves more bytes than the quantize (1.5 per
element). (Run 8's first two calls also timed a reciprocal quantize, since dropped:
benchmarks/results/tp_run8/int8_pack_*.json.)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from graph_timing import graph_replay_us  # noqa: E402

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

    # checks: the same bytes with and without the hints
    results = []
    for align in (False, True):
        setting(align)
        for r in range(2):
            quant(xs[r], stage[r])
        q = stage.clone()
        dsum()
        results.append((q, out.clone()))
    (q0, s0), (q1, s1) = results
    emit(what="check", tokens=tokens, rows=rows, cols=cols,
         align_same_bytes=bool(torch.equal(q0, q1) and torch.equal(s0, s1)))  # fmt: skip
    copy_src = xs[0]
    copy_dst = torch.empty_like(copy_src)
    floor = timed(lambda: copy_dst.copy_(copy_src))
    emit(what="copy floor", tokens=tokens, us=round(floor, 2),
         tbps=round(2 * n * 2 / floor / 1e6, 2))  # fmt: skip
    for align in (False, True):
        for gpp, warps in ((16, 4), (8, 4), (32, 4), (16, 8), (32, 8), (64, 8)):
            if not align and (gpp, warps) != (16, 4):
                continue
            setting(align, gpp, warps)
            stage.copy_(q0)
            tq, ts = timed(quant), timed(dsum)
            # bytes moved: quantize reads 2 n, writes rows * rb; the sum reads 2 rows * rb,
            # writes 2 n
            emit(
                what="kernels", tokens=tokens, align=align, gpp=gpp,
                warps=warps, quantize_us=round(tq, 2), sum_us=round(ts, 2),
                quantize_tbps=round((2 * n + rows * rb) / tq / 1e6, 2),
                sum_tbps=round((2 * rows * rb + 2 * n) / ts / 1e6, 2),
            )  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from lightwell.bench.results import git_commit
    from lightwell.kernels import int8_pack as i8

    dev = torch.device("cuda", 0)
    torch.manual_seed(0)
    rows_out = []

    def emit(**row):
        row.update(commit=git_commit(), device=torch.cuda.get_device_name(dev))
        rows_out.append(row)
        print(json.dumps(row), flush=True)

    def setting(align: bool, gpp: int = 16, warps: int = 4) -> None:
        i8.ALIGN_HINTS, i8.GROUPS_PER_PROGRAM, i8.TILE_WARPS = align, gpp, warps

    for tokens in TOKENS:
        one_size(tokens, dev, i8, emit, setting)
    setting(True)
    with open(args.out, "w") as f:
        json.dump(rows_out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
