"""Prefill tile shapes of the paged attention kernel at TP=1 and TP=2 head counts, on one GPU.
One device call of a few minutes:

    run(command="python3 -m benchmarks.kernels.attention_tiles --out $OUT/attention_tiles.json")

llama-3-8b heads (head dim 128): 32 query / 8 KV heads on one GPU, 16 / 4 on each of two (the
kernel's programs are (query tiles x KV heads), so TP=2 halves them: a 1,024-token prompt
fills the H200's 132 SMs with one program each). Per case (tokens, cached context) and tile
shape (block_m rows, block_n keys, warps, stages): checked against the torch reference, then
timed as CUDA-graph replays (triton_kernels.Bench.graph_us); records of µs with TFLOP/s.
Reference result: benchmarks/results/kernels_attention_tiles_h200.json.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from benchmarks.kernels.triton_kernels import TOL, Bench, make_batch
from lightwell.bench.results import record, write_json
from lightwell.kernels import kv_store, paged_attention

SHAPES = {"tp1": (32, 8, 128), "tp2": (16, 4, 128)}
CASES = [([1024], [0]), ([1024], [1024]), ([2048], [0]), ([512], [0]), ([128], [0]),
         ([4096], [0]), ([512] * 4, [0] * 4)]  # fmt: skip
CONFIGS = [(128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (64, 64, 4, 3), (64, 128, 4, 2),
           (64, 128, 4, 3), (128, 64, 4, 3), (64, 32, 4, 4), (128, 32, 8, 4), (256, 64, 8, 2),
           (64, 64, 4, 4)]  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    b = Bench(args)
    torch.manual_seed(0)
    dtype = torch.bfloat16
    for shape, (hq, hkv, d) in SHAPES.items():
        for qlens, ctxs in CASES:
            q, k, v, cache, meta = make_batch(b, qlens, ctxs, dtype, hq, hkv, d)
            kv_store.kv_store(k, v, cache, meta.slot_mapping)
            scale = d**-0.5
            ref = paged_attention.paged_attention_ref(q, cache, meta, scale)
            flops = 4 * d * hq * sum(c * n + n * (n + 1) // 2 for c, n in zip(ctxs, qlens))
            case = f"{shape}_r{len(qlens)}_t{sum(qlens)}_ctx{ctxs[0]}"
            for cfg_t in CONFIGS:
                cfg = paged_attention.AttentionConfig(*cfg_t)

                def ours(cfg=cfg, q=q, cache=cache, meta=meta, scale=scale):
                    return paged_attention.paged_attention(q, cache, meta, scale, config=cfg)

                fields, us = dict(case=case, config=list(cfg_t)), None
                try:
                    fields["max_err"] = b.check(f"{case} {cfg_t}", ours(), ref, TOL[dtype])
                    us = b.graph_us(ours)
                except Exception as e:  # out of shared memory, etc.
                    fields["failed"] = f"{type(e).__name__}: {str(e)[:120]}"
                else:
                    fields["tflops"] = round(flops / us / 1e6, 1)
                b.rows.append(record("time_us", us, **{**b.meta, "tp": int(shape[2:])}, **fields))
                print(json.dumps({"us": us, **fields}), flush=True)
    write_json(args.out, b.rows)
    if b.failures:
        print(f"{len(b.failures)} correctness failures:\n  " + "\n  ".join(b.failures))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
