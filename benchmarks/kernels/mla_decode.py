"""The MLA decode kernel (lightwell/kernels/mla_decode.py) on DeepSeek shapes, bf16 queries
over a bf16 latent cache (``--kv-cache-dtype fp8|int8``: an 8-bit one, checked against the
reference on its dequantized copy): per step of one layer, µs and the latent cache's bytes read
a second against the H200's 4,221 GB/s.
Batches 1, 16 and 64 at 1,024 / 8,192-token contexts, 16 heads (DeepSeek-V2-Lite) and 128 (V3);
split count and tile as the engine picks them, other split counts, and with ``--sweep`` the
three fastest tiles (BLOCK_H, BLOCK_S, warps, stages) of a sweep at the picked split count.
One device call of about a minute:

    run(command="python3 -m benchmarks.kernels.mla_decode --out $OUT/mla_decode.json")

Each configuration is checked against the torch reference first (at batch <= 16). Times: CUDA
events around a CUDA graph of the kernel, median of 20 replays after 3 warm-up ones.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.kernels.timing import graph_replay_us
from lightwell.bench.results import make_record, provenance, script_command, write_json
from lightwell.kernels.mla_decode import mla_decode, mla_decode_ref, pick_config, pick_num_splits
from lightwell.quant.kv_cache import dequantize_blocks, quantize_blocks

RANK, ROPE, BLOCK = 512, 64, 16
KV = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}
PEAK_GBPS = 4221.0
CASES = [
    (heads, batch, ctx) for heads in (16, 128) for batch in (1, 16, 64) for ctx in (1024, 8192)
]


def _sweep(run, want: torch.Tensor, heads: int) -> list[tuple[float, tuple]]:
    """(µs, config) of every (BLOCK_H, BLOCK_S, warps, stages) that compiles and matches."""
    found = []
    for bh in [h for h in (16, 32, 64) if h <= max(16, heads)]:
        for bs in (16, 32, 64):
            for warps in (4, 8):
                for stages in (1, 2, 3):
                    cfg = (bh, bs, warps, stages)
                    try:
                        got = run(cfg)
                        torch.cuda.synchronize()
                    except Exception:  # noqa: BLE001 (out of shared memory or registers)
                        continue
                    if (got.float() - want).abs().max() > 2e-2 * want.abs().max():
                        print("mismatch", cfg, flush=True)
                        continue
                    found.append((graph_replay_us(lambda c=cfg: run(c), warm=3), cfg))
    return sorted(found)


def bench(heads: int, batch: int, ctx: int, common: dict, sweep: bool, kv: str) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    blocks_per = ctx // BLOCK
    cache = torch.randn(1, batch * blocks_per, BLOCK, 1, RANK + ROPE, device="cuda",
                        dtype=torch.bfloat16, generator=gen)  # fmt: skip
    if kv != "bf16":
        cache = quantize_blocks(cache, KV[kv])
    table = torch.randperm(batch * blocks_per, device="cuda", generator=gen).to(torch.int32)
    table = table.view(batch, blocks_per)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads, RANK + ROPE, device="cuda", dtype=torch.bfloat16, generator=gen)
    scale = (128 + ROPE) ** -0.5
    auto = pick_num_splits(batch, heads, ctx)
    got = mla_decode(q, cache, table, lens, scale, RANK, auto).float()
    if batch <= 16:
        plain = dequantize_blocks(cache, torch.bfloat16)
        want = mla_decode_ref(q, plain, table, lens, scale, RANK).float()
        err = ((got - want).abs().max() / want.abs().max()).item()
    else:
        want, err = got, None
    nbytes = batch * ctx * cache.shape[-1] * cache.element_size()
    rows = []

    def row_of(us: float, splits: int, cfg: tuple | None) -> dict:
        gbps = nbytes / us / 1e3
        row = dict(heads=heads, batch=batch, context=ctx, kv_cache_dtype=kv, splits=splits,
                   auto=splits == auto and cfg is None, config=cfg or pick_config(heads),
                   us=round(us, 1), gbps=round(gbps, 1), of_peak=round(gbps / PEAK_GBPS, 3),
                   rel_err_vs_torch=err)  # fmt: skip
        print(row, flush=True)
        return make_record("mla_decode_us", us, common, **row)

    for splits in sorted({1, 4, 16, auto}):
        us = graph_replay_us(
            lambda s=splits: mla_decode(q, cache, table, lens, scale, RANK, s), warm=3
        )
        rows.append(row_of(us, splits, None))
    if sweep:
        run = lambda cfg: mla_decode(q, cache, table, lens, scale, RANK, auto, config=cfg)  # noqa: E731
        best = _sweep(run, want, heads)
        for us, cfg in best[:3]:
            rows.append(row_of(us, auto, cfg))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the results here (JSON)")
    parser.add_argument("--sweep", action="store_true", help="also time every kernel config")
    parser.add_argument("--kv-cache-dtype", default="bf16", choices=["bf16", *KV])
    args = parser.parse_args()
    common = {**provenance("cuda"), "command": script_command()}
    rows = []
    for heads, batch, ctx in CASES:
        rows += bench(heads, batch, ctx, common, args.sweep, args.kv_cache_dtype)
    if args.out:
        write_json(args.out, rows)


if __name__ == "__main__":
    main()
