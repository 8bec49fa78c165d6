"""The fused MoE Triton kernel (lightwell/kernels/fused_moe.py) against the loop over experts
(lightwell/layers/moe.py's ``moe_loop``: per expert with tokens, two cuBLAS matmuls), bf16, at
1, 64 and 2048 tokens, on Mixtral-8x7B's expert shapes (8 experts, top-2, H 4096, I 14336) and
DeepSeek-V2-Lite's (64 experts, top-6, H 2048, I 1408). One device call of a minute or two:

    run(command="python3 -m benchmarks.kernels.fused_moe --out $OUT/fused_moe.json")

Each kernel result is checked against the loop first (largest error relative to the output's
largest value). Times: CUDA events, median of 20 runs after 3 warm-up ones; the kernel both
eagerly (its sort and padding are a few small torch launches) and replayed from a CUDA graph (it
has no host sync); the loop eagerly only (it reads the per-expert counts on the host). Also the
weight bytes the kernel must read (the chosen experts' only) over its graph time.

``--decode``: the few-token GEMV path (lightwell/kernels/moe_gemv.py) against the grouped kernels
at 1, 2, 4 and 8 tokens on the same two shapes, with a tile sweep of both GEMV kernels. One
device call of under 4 minutes:

    run(command="python3 -m benchmarks.kernels.fused_moe --decode --out $OUT/moe_decode.json")

Details in benchmarks/kernels/moe_decode.py's docstring.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.kernels.timing import event_us, graph_replay_us
from lightwell.bench.results import make_record, provenance, script_command, write_json
from lightwell.kernels.fused_moe import GROUP_M, fused_moe
from lightwell.layers.moe import moe_loop

# name: (experts, top_k, hidden, intermediate)
SHAPES = {"mixtral-8x7b": (8, 2, 4096, 14336), "deepseek-v2-lite": (64, 6, 2048, 1408)}
TOKENS = (1, 64, 2048)


def bench(name: str, tokens: int, common: dict) -> list[dict]:
    experts, top_k, hidden, inter = SHAPES[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    dt = torch.bfloat16
    x = torch.randn(tokens, hidden, device="cuda", dtype=dt, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=dt, generator=gen) * 0.02
    w2 = torch.randn(experts, hidden, inter, device="cuda", dtype=dt, generator=gen) * 0.02
    logits = torch.randn(tokens, experts, device="cuda", generator=gen)
    weights, ids = logits.softmax(-1).topk(top_k, dim=-1)
    loop = moe_loop(x, w13, w2, weights, ids).float()
    got = fused_moe(x, w13, w2, weights, ids).float()
    err = ((got - loop).abs().max() / loop.abs().max()).item()
    used = ids.unique().numel()
    weight_bytes = used * 3 * hidden * inter * 2
    graph = graph_replay_us(lambda: fused_moe(x, w13, w2, weights, ids), warm=3)
    row = dict(shape=name, tokens=tokens, experts_used=used, rel_err_vs_loop=round(err, 6),
               fused_eager_us=round(event_us(lambda: fused_moe(x, w13, w2, weights, ids)), 1),
               fused_graph_us=round(graph, 1),
               loop_us=round(event_us(lambda: moe_loop(x, w13, w2, weights, ids)), 1),
               fused_weight_gbps=round(weight_bytes / graph / 1e3, 1))  # fmt: skip
    print(row, flush=True)
    return [make_record("fused_moe_graph_us", graph, common, **row)]


SWEEP_TOKENS = (2048, 8192)
# (block_m, block_n, block_k, warps, stages) of the grouped kernels, --sweep
SWEEP_TILES = [(bm, bn, bk, w, st) for bm in (64, 128) for bn in (64, 128) for bk in (64, 128)
               for w in (4, 8) for st in (3, 4)]  # fmt: skip


def sweep(
    name: str,
    tokens: int,
    common: dict,
    deadline: float,
    out: str | None,
    tiles: list[tuple[int, ...]] = SWEEP_TILES,
    groups: tuple[int, ...] = (GROUP_M,),
) -> list[dict]:
    """The grouped kernels at each tile of ``tiles`` and program grouping of ``groups``
    (checked against the loop; those that fail to compile or exceed shared memory are
    skipped), CUDA-graph µs and TFLOP/s."""
    import time

    experts, top_k, hidden, inter = SHAPES[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    dt = torch.bfloat16
    x = torch.randn(tokens, hidden, device="cuda", dtype=dt, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=dt, generator=gen) * 0.02
    w2 = torch.randn(experts, hidden, inter, device="cuda", dtype=dt, generator=gen) * 0.02
    weights, ids = (
        torch.randn(tokens, experts, device="cuda", generator=gen).softmax(-1).topk(top_k, dim=-1)
    )
    loop = moe_loop(x, w13, w2, weights, ids).float()
    flops = 2 * tokens * top_k * 3 * hidden * inter
    rows = []
    for (bm, bn, bk, warps, stages), group in ((t, g) for t in tiles for g in groups):
        if time.monotonic() > deadline:
            break
        opts = dict(block_m=bm, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages,
                    gemv=False, group_m=group)  # fmt: skip
        try:
            got = fused_moe(x, w13, w2, weights, ids, **opts).float()
            us = graph_replay_us(lambda o=opts: fused_moe(x, w13, w2, weights, ids, **o), warm=3)
        except Exception as e:  # noqa: BLE001 (out of resources: skipped, said)
            print(name, tokens, opts, "skipped:", str(e).splitlines()[0][:120], flush=True)
            continue
        err = ((got - loop).abs().max() / loop.abs().max()).item()
        row = dict(shape=name, tokens=tokens, tile=[bm, bn, bk, warps, stages], group_m=group,
                   rel_err_vs_loop=round(err, 6), tflops=round(flops / us / 1e6, 1))  # fmt: skip
        print(row, round(us, 1), flush=True)
        rows.append(make_record("fused_moe_tile_us", us, common, **row))
        if out:
            write_json(out, rows)  # (each tile as it comes: a later one may crash the process)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the results here (JSON)")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated names")
    parser.add_argument("--decode", action="store_true", help="the GEMV path at 1-8 tokens")
    parser.add_argument("--budget-s", type=float, default=200.0,
                        help="--decode, --sweep: stop sweeping tiles after this long")  # fmt: skip
    parser.add_argument("--sweep", action="store_true",
                        help="the grouped kernels' tiles at 2,048 and 8,192 tokens")  # fmt: skip
    parser.add_argument("--tiles", default=None,
                        help="--sweep: these tiles only, bm:bn:bk:warps:stages,...")  # fmt: skip
    parser.add_argument("--groups", default=str(GROUP_M),
                        help="--sweep: row blocks a program group spans, comma list")  # fmt: skip
    args = parser.parse_args()
    common = {**provenance("cuda"), "command": script_command()}
    tiles = SWEEP_TILES
    if args.tiles:
        tiles = [tuple(int(v) for v in t.split(":")) for t in args.tiles.split(",")]
    groups = tuple(int(g) for g in args.groups.split(","))
    rows = []
    if args.sweep:
        import time

        deadline = time.monotonic() + args.budget_s
        for name in args.shapes.split(","):
            for tokens in SWEEP_TOKENS:
                part = args.out and f"{args.out}.{name}.{tokens}"
                rows += sweep(name, tokens, common, deadline, part, tiles, groups)
    if args.decode:
        from benchmarks.kernels.moe_decode import run_decode

        rows = run_decode(args.shapes.split(","), common, args.budget_s)
    for name in args.shapes.split(",") if not (args.decode or args.sweep) else []:
        for tokens in TOKENS:
            rows += bench(name, tokens, common)
    if args.out:
        write_json(args.out, rows)


if __name__ == "__main__":
    main()
