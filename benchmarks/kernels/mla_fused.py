"""The fused launches around DeepSeek-V2-Lite's MLA decode attention against the separate
ones, bf16 (16 heads, kv_lora_rank 512, RoPE 64, nope 128, v 128):

- before it, one layer at 1, 4 and 16 requests of a 1,024-token context: ``prepare_decode``
  (latent entry + absorbed query, one launch) vs ``latent_entry`` then ``absorb_query``,
  checked bit for bit (queries and cache rows) first;
- after it, the whole decode chain of 26 layers (each its own weights and cache) at 1, 2, 4 and
  8 requests of a 256-token context, split as a decode graph captured at a 4,096-token limit
  splits it: prepare, ``mla_decode`` (decode + combine kernels), ``absorb_output`` through its
  tile kernel against its few-token kernel (``FEW_TOKENS`` sets which one serves); outputs
  compared first (largest difference over the largest value).

One command, under a minute:

    python3 -m benchmarks.kernels.mla_fused --out $OUT/mla_fused.json

Times: CUDA graphs, median of 20 replays (benchmarks/kernels/timing.py); the chain's per layer.
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.kernels.timing import graph_replay_us
from lightwell.bench.results import record
from lightwell.kernels import mla_output
from lightwell.kernels.mla_decode import mla_decode, pick_num_splits
from lightwell.kernels.mla_prepare import absorb_query, latent_entry, prepare_decode

HEADS, RANK, ROPE, NOPE, VDIM, BLOCK, CTX = 16, 512, 64, 128, 128, 16, 1024
DEVICE, BF16 = "cuda", torch.bfloat16


def _inputs(batch: int) -> dict:
    gen = torch.Generator(device=DEVICE).manual_seed(batch)
    blocks = batch * CTX // BLOCK

    def randn(*shape, dtype=BF16):
        return torch.randn(*shape, device=DEVICE, dtype=dtype, generator=gen)

    table = torch.randperm(blocks, device=DEVICE, generator=gen).to(torch.int32)
    table = table.view(batch, -1)
    fused = randn(batch, HEADS * (NOPE + ROPE) + RANK + ROPE)  # one projection's output
    q, kv = fused.split([HEADS * (NOPE + ROPE), RANK + ROPE], dim=-1)
    angles = torch.rand(4096, ROPE // 2, device=DEVICE, generator=gen) * 6.28
    return dict(
        q=q,
        kv=kv,
        cache=randn(1, blocks, BLOCK, 1, RANK + ROPE),
        table=table,
        lens=torch.full((batch,), CTX, device=DEVICE, dtype=torch.int32),
        positions=torch.full((batch,), CTX - 1, device=DEVICE),
        w=randn(HEADS * (NOPE + VDIM), RANK) / 16,
        norm=randn(RANK).abs() + 0.5,
        cs=torch.cat([angles.cos(), angles.sin()], dim=-1),
        slots=table[:, -1].long() * BLOCK + BLOCK - 1,  # the last key of each request
    )


def _prepare(x: dict, batch: int) -> tuple[float, float, torch.Tensor]:
    dims, cache2 = (NOPE, ROPE, VDIM), x["cache"].clone()
    latent_entry(x["positions"], x["kv"], x["norm"], 1e-6, x["cs"], False, x["cache"], x["slots"])
    want = absorb_query(x["positions"], x["q"], x["w"], dims, x["cs"], False)
    got = prepare_decode(x["positions"], x["q"], x["kv"], (x["norm"], 1e-6), x["w"], dims,
                         (x["cs"], False), cache2, x["slots"])  # fmt: skip
    if not (torch.equal(got, want) and torch.equal(cache2, x["cache"])):
        raise AssertionError(f"batch {batch}: prepare_decode differs from the two launches")

    def separate():
        latent_entry(x["positions"], x["kv"], x["norm"], 1e-6, x["cs"], False, x["cache"],
                     x["slots"])  # fmt: skip
        absorb_query(x["positions"], x["q"], x["w"], dims, x["cs"], False)

    def fused():
        prepare_decode(x["positions"], x["q"], x["kv"], (x["norm"], 1e-6), x["w"], dims,
                       (x["cs"], False), cache2, x["slots"])  # fmt: skip

    return graph_replay_us(separate), graph_replay_us(fused), got


LAYERS, CHAIN_CTX, GRAPH_LIMIT = 26, 256, 4096


def _chain(batch: int) -> dict:
    """The decode chain over LAYERS layers, its output through either kernel."""
    gen = torch.Generator(device=DEVICE).manual_seed(100 + batch)
    per_req = GRAPH_LIMIT // BLOCK

    def randn(*shape):
        return torch.randn(*shape, device=DEVICE, dtype=BF16, generator=gen)

    layers = [
        dict(w=randn(HEADS * (NOPE + VDIM), RANK) / 16, norm=randn(RANK).abs() + 0.5,
             cache=randn(1, batch * per_req, BLOCK, 1, RANK + ROPE))
        for _ in range(LAYERS)
    ]  # fmt: skip
    table = torch.arange(batch * per_req, device=DEVICE, dtype=torch.int32).view(batch, -1)
    lens = torch.full((batch,), CHAIN_CTX, device=DEVICE, dtype=torch.int32)
    positions = torch.full((batch,), CHAIN_CTX - 1, device=DEVICE)
    slots = table[:, 0].long() * BLOCK + CHAIN_CTX - 1
    q, kv = randn(batch, HEADS * (NOPE + ROPE)), randn(batch, RANK + ROPE)
    angles = torch.rand(4096, ROPE // 2, device=DEVICE, generator=gen) * 6.28
    cs = torch.cat([angles.cos(), angles.sin()], dim=-1)
    dims, splits = (NOPE, ROPE, VDIM), pick_num_splits(batch, HEADS, GRAPH_LIMIT)

    def layer(x: dict) -> torch.Tensor:
        qa = prepare_decode(positions, q, kv, (x["norm"], 1e-6), x["w"], dims, (cs, False),
                            x["cache"], slots)  # fmt: skip
        latent = mla_decode(qa, x["cache"], table, lens, 0.1, RANK, splits)
        return mla_output.absorb_output(latent, x["w"], (NOPE, VDIM))

    default, outs, us = mla_output.FEW_TOKENS, {}, {}
    try:
        for few in (False, True):
            mla_output.FEW_TOKENS = batch if few else 0
            outs[few] = layer(layers[0])
            us[few] = graph_replay_us(lambda: [layer(x) for x in layers], calls=LAYERS)
    finally:
        mla_output.FEW_TOKENS = default
    diff = (outs[True].float() - outs[False].float()).abs().max()
    err = (diff / outs[False].float().abs().max()).item()
    if not err < 1e-2:
        raise AssertionError(f"batch {batch}: the few-token output differs by {err:.3g}")
    print(f"batch {batch}, {splits} splits: chain with the tile output kernel {us[False]:.2f}, "
          f"the few-token one {us[True]:.2f} us a layer (rel. difference {err:.2g})")  # fmt: skip
    serving = batch <= default  # the kernel absorb_output takes at this batch
    return record("mla_decode_chain_us", us[serving], tile_output_us=round(us[False], 2),
                  few_token_output_us=round(us[True], 2), batch=batch, context=CHAIN_CTX,
                  splits=splits, layers=LAYERS, heads=HEADS, few_tokens_default=default,
                  max_rel_diff=err)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out")
    args = ap.parse_args()
    rows = []
    for batch in (1, 4, 16):
        x = _inputs(batch)
        sep_prep, fused_prep, _ = _prepare(x, batch)
        print(f"batch {batch}: prepare {sep_prep:.1f} -> {fused_prep:.1f} us")
        common = dict(batch=batch, context=CTX, heads=HEADS)
        rows.append(record("mla_prepare_fused_us", fused_prep, separate_us=round(sep_prep, 1),
                           **common))  # fmt: skip
    for batch in (1, 2, 4, 8):
        rows.append(_chain(batch))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
