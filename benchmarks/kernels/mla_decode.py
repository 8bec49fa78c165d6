"""The MLA decode kernel (lightwell/kernels/mla_decode.py) on DeepSeek shapes, bf16: per step
of one layer, µs and the latent cache's bytes read a second against the H200's 4,221 GB/s.
Batches 1, 16 and 64 at 1,024 / 8,192-token contexts, 16 heads (DeepSeek-V2-Lite) and 128 (V3);
split count as the engine picks it, and a sweep of others.
One device call of about a minute:

    run(command="python3 -m benchmarks.kernels.mla_decode --out $OUT/mla_decode.json")

Each configuration is checked against the torch reference first (at batch <= 16). Times: CUDA
events around a CUDA graph of the kernel, median of 20 replays after 3 warm-up ones.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from lightwell.bench.results import make_record, provenance, script_command, write_json
from lightwell.kernels.mla_decode import mla_decode, mla_decode_ref, pick_num_splits

RANK, ROPE, BLOCK = 512, 64, 16
PEAK_GBPS = 4221.0
CASES = [
    (heads, batch, ctx) for heads in (16, 128) for batch in (1, 16, 64) for ctx in (1024, 8192)
]


def _graph_us(fn, reps: int = 20, warm: int = 3) -> float:
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    times = []
    for _ in range(warm + reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(1e3 * start.elapsed_time(end))
    return statistics.median(times[warm:])


def bench(heads: int, batch: int, ctx: int, common: dict) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    blocks_per = ctx // BLOCK
    cache = torch.randn(1, batch * blocks_per, BLOCK, 1, RANK + ROPE, device="cuda",
                        dtype=torch.bfloat16, generator=gen)  # fmt: skip
    table = torch.randperm(batch * blocks_per, device="cuda", generator=gen).to(torch.int32)
    table = table.view(batch, blocks_per)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads, RANK + ROPE, device="cuda", dtype=torch.bfloat16, generator=gen)
    scale = (128 + ROPE) ** -0.5
    auto = pick_num_splits(batch, heads, ctx)
    if batch <= 16:
        want = mla_decode_ref(q, cache, table, lens, scale, RANK).float()
        got = mla_decode(q, cache, table, lens, scale, RANK, auto, ctx).float()
        err = ((got - want).abs().max() / want.abs().max()).item()
    else:
        err = None
    nbytes = batch * ctx * (RANK + ROPE) * 2
    rows = []
    for splits in sorted({1, 2, 4, 8, 16, auto}):
        us = _graph_us(lambda s=splits: mla_decode(q, cache, table, lens, scale, RANK, s, ctx))
        gbps = nbytes / us / 1e3
        row = dict(heads=heads, batch=batch, context=ctx, splits=splits, auto=splits == auto,
                   us=round(us, 1), gbps=round(gbps, 1), of_peak=round(gbps / PEAK_GBPS, 3),
                   rel_err_vs_torch=err)  # fmt: skip
        print(row, flush=True)
        rows.append(make_record("mla_decode_us", us, common, **row))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the results here (JSON)")
    args = parser.parse_args()
    common = {**provenance("cuda"), "command": script_command()}
    rows = []
    for heads, batch, ctx in CASES:
        rows += bench(heads, batch, ctx, common)
    if args.out:
        write_json(args.out, rows)


if __name__ == "__main__":
    main()
