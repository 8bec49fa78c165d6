"""The MoE down projection for a few tokens (lightwell/kernels/moe_gemv.py): the loop over a
token's pairs (``_moe_gemv_down``, its ``pick_config`` tile), the pairs as a dimension of one
program's tile (``_moe_gemv_down_pairs``, ``PAIRS_TILE_CONFIG``) and a program per pair with
the partials added by the last (``_moe_gemv_down_split``: its ``split_config`` tile and a sweep
of tiles), bf16, at 1, 2 and 4 tokens, on DeepSeek-V2-Lite's shapes (6 routed + 2 shared
experts a token, H 2,048, I 1,408), Mixtral-8x7B's (2 a token, H 4,096, I 14,336),
Qwen2-MoE-A2.7B's (4 of 60, I 1,408) and Qwen3-MoE-30B-A3B's (8 of 128, I 768). Its rows
check the rule ``use_split`` and the tiles of ``split_config`` (``kernels_moe_down_h200.json``
holds the loop and one-tile rows; the split kernel's rows are not in it yet). One device
call, about two minutes:

    run(command="python3 -m benchmarks.kernels.moe_down --out $OUT/moe_down.json")

Each tile is checked against the loop's output (largest error over the largest value < 1e-2)
before it is timed. Timing: CUDA graphs over 8 calls, each with other experts (and V2-Lite with
two copies of the stack), so no call finds its weights in L2; median of 20 replays. TB/s: the
chosen experts' bytes over the time.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import itertools
import multiprocessing

import torch

from benchmarks.kernels.timing import graph_replay_us
from lightwell.bench.results import record, write_json
from lightwell.kernels import moe_gemv as mg

# name: (experts in the stack, routed k, shared S, H, I)
SHAPES = {
    "deepseek-v2-lite": (66, 6, 2, 2048, 1408),
    "mixtral-8x7b": (8, 2, 0, 4096, 14336),
    "qwen2-moe-a2.7b": (60, 4, 0, 2048, 1408),  # its shared expert is a separate MLP
    "qwen3-moe-30b-a3b": (128, 8, 0, 2048, 768),
}
TOKENS = (1, 2, 4)
TILES = list(itertools.product((4, 16, 32, 64), (128, 256, 512), (1, 2), (1, 3)))


def _compile(tiles: list[mg.Config]) -> int:
    dev, done = torch.device("cuda"), 0
    for experts, k, shared, _, inter in SHAPES.values():
        w2 = torch.randn(experts, 256, inter, device=dev, dtype=torch.bfloat16)
        for tokens in (1, 2):
            act = torch.randn(tokens * (k + shared), inter, device=dev, dtype=torch.bfloat16)
            ids = torch.randint(0, experts - shared, (tokens, k), device=dev)
            weights = torch.rand(tokens, k, device=dev)
            for tile in tiles:
                try:
                    mg.moe_gemv_down(act, w2, weights, ids, tile, shared, kernel="split")
                    done += 1
                except Exception as e:  # skipped when timed too
                    print(f"compile {tile}: {type(e).__name__}: {str(e)[:150]}", flush=True)
    torch.cuda.synchronize()
    return done


def measure(name: str, dev: torch.device) -> list[dict]:
    experts, k, shared, hidden, inter = SHAPES[name]
    copies = 2 if experts * hidden * inter * 2 < 1e9 else 1
    stacks = [
        torch.randn(experts, hidden, inter, device=dev, dtype=torch.bfloat16) / 32
        for _ in range(copies)
    ]
    rows = []
    for tokens in TOKENS:
        gen = torch.Generator().manual_seed(tokens)
        calls = []
        for c in range(8):
            routed = experts - shared
            ids = torch.randperm(routed, generator=gen)[: tokens * k] if routed >= tokens * k else (
                torch.randint(0, routed, (tokens * k,), generator=gen)
            )  # fmt: skip
            act = torch.randn(tokens * (k + shared), inter, generator=gen).to(torch.bfloat16)
            calls.append(
                (stacks[c % copies], ids.view(tokens, k).to(dev), torch.rand(tokens, k).to(dev),
                 act.to(dev))
            )  # fmt: skip
        gb = (min(experts - shared, tokens * k) + shared) * hidden * inter * 2 / 1e9

        def timed(tile, kernel, calls=calls):
            return graph_replay_us(
                lambda: [
                    mg.moe_gemv_down(a, w, wt, ids, tile, shared, kernel=kernel)
                    for w, ids, wt, a in calls
                ],
                calls=len(calls),
            )

        w, ids, wt, a = calls[0]
        ref = mg.moe_gemv_down(a, w, wt, ids, None, shared, kernel="loop").float()
        loop_tile = mg.pick_config(inter, 1, tokens)
        base = dict(shape=name, tokens=tokens, pairs_a_token=k + shared, gb=gb)
        us = timed(loop_tile, "loop")
        rows.append(
            record(
                "moe_down_us", us, kernel="loop", tile=list(loop_tile), tb_s=gb / us * 1e3, **base
            )
        )
        best = None
        for tile in TILES:
            try:
                got = mg.moe_gemv_down(a, w, wt, ids, tile, shared, kernel="split").float()
            except Exception:
                continue
            err = ((got - ref).abs().max() / ref.abs().max()).item()
            if not err < 1e-2:
                print(f"{name} T={tokens} {tile}: error {err:.3g}: not timed", flush=True)
                continue
            us_t = timed(tile, "split")
            if best is None or us_t < best[0]:
                best = (us_t, tile, err)
        if best is not None:
            us_t, tile, err = best
            rows.append(record("moe_down_us", us_t, kernel="split_best", tile=list(tile),
                               tb_s=gb / us_t * 1e3, rel_err=err, **base))  # fmt: skip
        pairs = timed(mg.PAIRS_TILE_CONFIG, "pairs")
        rows.append(record("moe_down_us", pairs, kernel="pairs", tile=list(mg.PAIRS_TILE_CONFIG),
                           tb_s=gb / pairs * 1e3, **base))  # fmt: skip
        split_tile = mg.split_config(tokens)
        split = timed(split_tile, "split")
        rows.append(record("moe_down_us", split, kernel="split_default", tile=list(split_tile),
                           tb_s=gb / split * 1e3, **base))  # fmt: skip
        print(f"{name} T={tokens}: loop {us:.2f} us, pairs tile {pairs:.2f}, split "
              f"{split_tile} {split:.2f}, best {best[1] if best else None} "
              f"{best[0] if best else 0:.2f}", flush=True)  # fmt: skip
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    workers = 15
    with cf.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        done = sum(pool.map(_compile, [TILES[i::workers] for i in range(workers)]))
    print(f"compiled {done} tile launches", flush=True)
    dev = torch.device("cuda")
    rows = [r for name in SHAPES for r in measure(name, dev)]
    if args.out:
        write_json(args.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
