"""MLA prefill on the kernel path at DeepSeek-V2-Lite shapes (16 heads, kv_lora_rank 512, rope
64, nope 128, v 128, bf16, YaRN mscale, 16-token blocks): one layer's attention from its
queries and latent entries to the heads' values, the absorbed torch path (``attend_latent`` per
request, fp32 einsums, then ``W_UV``) against the expanded prefill
(``lightwell/attention/mla_prefill.py``: one ``kv_b_proj`` GEMM, the paged attention kernel).
Cases: 8 requests x 1,024 fresh tokens; a 512-token chunk after 1,536 cached tokens; a mixed
step of 32 decodes at 2,048 tokens of context and a 1,024-token chunk after 1,024 cached, in
either order (the scheduler's running order can put a chunk first).
Under a minute:

    run(command="python3 -m benchmarks.kernels.mla_prefill --out $OUT/mla_prefill.json")

``--sweep`` also times the expanded prefill alone (no store, no decodes) over the paged
attention kernel's tiles (BLOCK_M, BLOCK_N, warps, stages) on the first two cases, and records
the default tile and the five fastest; a few minutes more.

Each case is checked first: the new path's output against the old path's (relative max error,
bf16 both) and the entries each stored. Times: CUDA events around one eager call (as a prefill
step runs), median of 20 after 3 warm-up calls. The new path plans a step once (on the host,
shared by every layer of the step): ``first_call_us`` is the wall time of a call that plans.
``tflops``: the expanded form's attention FLOPs (causal pairs x heads x 2 x (192 + 128)) over
the time.
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import torch

from benchmarks.kernels.timing import event_us
from lightwell.attention.metadata import AttentionMetadata, forward_context
from lightwell.attention.mla_prefill import expanded_prefill, split_step
from lightwell.bench.results import make_record, provenance, script_command, write_json
from lightwell.layers.mla import LatentAttention, mla_softmax_scale

HEADS, RANK, ROPE, NOPE, VDIM, BLOCK = 16, 512, 64, 128, 128, 16
DIMS = (NOPE, ROPE, VDIM)
DEVICE = "cuda"
YARN = {"rope_type": "yarn", "factor": 40.0, "mscale": 0.707, "mscale_all_dim": 0.707}
# name: [(query_len, seq_len)] in batch order
CASES = {
    "fresh_8x1024": [(1024, 1024)] * 8,
    "chunk_512_after_1536": [(512, 2048)],
    "mixed_32_decodes_chunk_1024": [(1, 2048)] * 32 + [(1024, 2048)],
    "mixed_chunk_1024_then_32_decodes": [(1024, 2048)] + [(1, 2048)] * 32,
}


def make_step(reqs: list[tuple[int, int]], device: str, dtype: torch.dtype, seed: int = 0):
    """Metadata (scattered blocks), the latent cache with every cached prefix filled, the
    step's queries and entries, and a kv_b_proj weight."""
    gen = torch.Generator(device=device).manual_seed(seed)
    nblocks = [-(-s // BLOCK) for _, s in reqs]
    perm = torch.randperm(sum(nblocks), device=device, generator=gen)
    width, starts = max(nblocks), [0]
    table = torch.zeros(len(reqs), width, dtype=torch.int32, device=device)
    for i, n in enumerate(nblocks):
        table[i, :n] = perm[starts[-1] : starts[-1] + n]
        starts.append(starts[-1] + n)
    qsl = [0]
    for q, _ in reqs:
        qsl.append(qsl[-1] + q)
    pos = torch.cat([torch.arange(s - q, s, device=device) for q, s in reqs])
    req = torch.cat([torch.full((q,), i, device=device) for i, (q, _) in enumerate(reqs)])
    slots = table[req, pos // BLOCK].long() * BLOCK + pos % BLOCK
    rnd = lambda *shape: torch.randn(*shape, device=device, generator=gen).to(dtype)  # noqa: E731
    cache = rnd(1, sum(nblocks), BLOCK, 1, RANK + ROPE)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor([s for _, s in reqs], dtype=torch.int32, device=device),
        block_table=table, slot_mapping=slots, max_query_len=max(q for q, _ in reqs),
        max_seq_len=max(s for _, s in reqs), query_start_loc_cpu=qsl,
        seq_lens_cpu=[s for _, s in reqs], num_decodes=sum(q == 1 for q, _ in reqs),
    )  # fmt: skip
    tokens = qsl[-1]
    inputs = (rnd(tokens, HEADS, NOPE), rnd(tokens, HEADS, ROPE), rnd(tokens, RANK + ROPE))
    w = rnd(HEADS * (NOPE + VDIM), RANK) / RANK**0.5
    return meta, cache, inputs, w


def make_layer(cache: torch.Tensor) -> LatentAttention:
    """A latent attention layer on the kernel path over ``cache``, YaRN's softmax scale."""
    config = SimpleNamespace(rope_scaling=YARN)
    layer = LatentAttention(HEADS, RANK, ROPE, mla_softmax_scale(config, NOPE + ROPE))
    layer.decode_kernel, layer.kv_cache = True, cache
    return layer


def paths(layer: LatentAttention, inputs: tuple, w: torch.Tensor):
    """(old, new): the heads' values [T, H * v] of one layer, either way."""
    q_nope, q_pe, entry = inputs
    w_uk, w_uv = w.view(HEADS, NOPE + VDIM, RANK).split([NOPE, VDIM], dim=1)

    def old() -> torch.Tensor:
        q = torch.cat([torch.einsum("thn,hnr->thr", q_nope, w_uk), q_pe], dim=-1)
        out = layer(q, entry)  # (the kernel path: leading decodes on the decode kernel)
        return torch.einsum("thr,hvr->thv", out, w_uv).reshape(q.shape[0], HEADS * VDIM)

    def new() -> torch.Tensor:
        out = layer.forward_expanded(q_nope, q_pe, entry, w, DIMS)
        return out.reshape(out.shape[0], HEADS * VDIM)

    return old, new


def check(name: str, device: str = "cuda", dtype: torch.dtype = torch.bfloat16) -> dict:
    """The new path's output and stored entries against the old path's."""
    meta, cache, inputs, w = make_step(CASES[name], device, dtype)
    layer = make_layer(cache.clone())
    old, new = paths(layer, inputs, w)
    with forward_context(meta):
        want = old().float()
        stored = layer.kv_cache.clone()
        layer.kv_cache = cache.clone()
        got = new().float()
    err = ((got - want).abs().max() / want.abs().max()).item()
    return {"rel_err_vs_old": err, "entries_equal": bool(torch.equal(layer.kv_cache, stored))}


def bench(name: str, common: dict) -> list[dict]:
    reqs = CASES[name]
    checked = check(name, DEVICE)
    print(name, checked, flush=True)
    meta, cache, inputs, w = make_step(reqs, DEVICE, torch.bfloat16)
    layer = make_layer(cache)
    old, new = paths(layer, inputs, w)
    pairs = sum(q * (s - q) + q * (q + 1) // 2 for q, s in reqs)
    flops = 2 * pairs * HEADS * (NOPE + ROPE + VDIM)
    rows = []
    with forward_context(meta):
        for label, fn in (("old", old), ("new", new)):
            us = event_us(fn)
            row = dict(case=name, path=label, tokens=meta.num_tokens, requests=len(reqs),
                       us=round(us, 1), tflops=round(flops / us / 1e6, 1), **checked)  # fmt: skip
            if label == "new":
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                meta.backend_cache.clear()
                new()
                torch.cuda.synchronize()
                row["first_call_us"] = round(1e6 * (time.perf_counter() - t0), 1)
            print(row, flush=True)
            rows.append(make_record("mla_prefill_layer_us", us, common, **row))
    return rows


def sweep(name: str, common: dict) -> list[dict]:
    """The expanded prefill alone per kernel tile: the default (None) and the five fastest
    that compile and match the default's output."""
    from lightwell.kernels.attention_tiles import AttentionConfig

    meta, cache, (q_nope, q_pe, entry), w = make_step(CASES[name], DEVICE, torch.bfloat16)
    layer = make_layer(cache)
    found = []
    with forward_context(meta):
        layer.forward_expanded(q_nope, q_pe, entry, w, DIMS)  # (stores the entries)
        split = split_step(meta)
        q = torch.cat([q_nope[split.prefill_rows], q_pe[split.prefill_rows]], dim=-1)
        pre = split.prefill
        run = lambda c: expanded_prefill(q, cache, pre, w, DIMS, layer.scale, config=c)  # noqa: E731
        want = run(None).float()
        tiles = [AttentionConfig(m, b, nw, st) for m in (32, 64, 128) for b in (32, 64)
                 for nw in (4, 8) for st in (1, 2, 3)]  # fmt: skip
        for cfg in [None, *tiles]:
            try:
                got = run(cfg).float()
                torch.cuda.synchronize()
            except Exception:  # noqa: BLE001 (out of shared memory or registers)
                continue
            if (got - want).abs().max() > 2e-2 * want.abs().max():
                print("mismatch", cfg, flush=True)
                continue
            found.append((event_us(lambda c=cfg: run(c)), cfg))
    default = [f for f in found if f[1] is None]
    best = sorted((f for f in found if f[1] is not None), key=lambda f: f[0])[:5]
    rows = []
    for us, cfg in default + best:
        tile = "default" if cfg is None else [cfg.block_m, cfg.block_n, cfg.num_warps,
                                              cfg.num_stages]  # fmt: skip
        row = dict(case=name, path="new_attention_only", tile=tile, us=round(us, 1))
        print(row, flush=True)
        rows.append(make_record("mla_prefill_tile_us", us, common, **row))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the results here (JSON)")
    parser.add_argument("--sweep", action="store_true", help="also time the kernel's tiles")
    args = parser.parse_args()
    common = {**provenance("cuda"), "command": script_command()}
    rows = []
    for name in CASES:
        rows += bench(name, common)
    if args.sweep:
        for name in list(CASES)[:2]:
            rows += sweep(name, common)
    if args.out:
        write_json(args.out, rows)


if __name__ == "__main__":
    main()
