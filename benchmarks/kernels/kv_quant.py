"""8-bit KV caches (``--kv-cache-dtype fp8|int8``) in the Triton kernels at llama-3-8b shapes
(32 query heads, 8 KV heads, head_dim 128, 16-token blocks, bf16 queries): checked, then timed
against the bf16 cache. One device call of a few minutes:

    run(command="python3 -m benchmarks.kernels.kv_quant --out $OUT/kv_quant.json")

Checks (the script exits non-zero when one fails):

- ``kv_store`` (and the RoPE-fused store) into fp8 / int8 caches writes the bytes of
  ``write_rows`` (quant/kv_cache.py: ``quantize_kv`` in the block layout) on CUDA, for 4,096
  tokens of bf16 keys/values;
- paged attention over the 8-bit cache vs ``paged_attention_ref`` in fp32 on the dequantized
  cache, for decode batches of 1 and 64 at contexts 1k-8k (split-KV where the engine splits)
  and for a 512-token prompt chunk after a cached prefix (the prefill tiles); the error is
  ``max |out - ref| / max |ref|``, bounded by ``CHECK_BOUND`` (bf16 output rounding and the
  bf16 probabilities), with the bf16 cache's own error beside it.

Times: decode attention (one layer's launch, ``paged_attention`` with the engine's automatic
split-KV), µs per call, median of 20 CUDA-graph replays, for the bf16, fp8 and int8 caches at
batch 1 and 64 and contexts 1k, 4k, 8k, batch 8 at 8k, batch 128 at 4k and batch 256 at 1,152
(W2's decode steps); ``speedup`` = bf16 time / 8-bit
time; then the fp8 cache with the other decode tiles of ``SWEEP`` (``kv_cache_dtype`` "fp8
(block_m, block_n, warps, stages)"); then 8 prompt chunks of 512 tokens after 3,584 cached
(``prefill_attention_us``, eager calls: over an 8-bit cache they read a bf16 copy of their
blocks, kernels/kv_dequant.py, which CUDA-graph capture skips). The 8-bit cache reads
``(D + 4) / 2D`` = 0.52x the bytes of bf16 per key.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.kernels.timing import event_us, graph_replay_us
from lightwell.attention.metadata import AttentionMetadata
from lightwell.bench.results import make_record, provenance, script_command, write_json
from lightwell.kernels.attention_tiles import AttentionConfig
from lightwell.kernels.kv_store import kv_store
from lightwell.kernels.paged_attention import paged_attention, paged_attention_ref
from lightwell.kernels.rotary import rotary_embedding
from lightwell.quant.kv_cache import dequantize_blocks, quantize_blocks, write_rows

HQ, HKV, D, BLOCK = 32, 8, 128, 16
KV = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}
CONTEXTS = (1024, 4096, 8192)
BATCHES = (1, 64)
CHECK_BOUND = 2e-2  # relative to max |ref|
# decode tiles (block_m, block_n, warps, stages) also timed on the fp8 cache (the default for
# 8-bit caches: attention_tiles.default_config)
SWEEP = (
    (16, 64, 4, 3),
    (16, 64, 2, 3),
    (16, 64, 2, 4),
    (16, 128, 4, 2),
    (16, 128, 4, 3),
    (16, 128, 8, 2),
    (16, 128, 2, 2),
    (16, 128, 2, 3),
    (16, 32, 2, 4),
)
BATCHES_TIMED = ((1, CONTEXTS), (8, (8192,)), (64, CONTEXTS), (128, (4096,)), (256, (1152,)))


def _meta(qlens: list[int], ctxs: list[int], gen: torch.Generator) -> AttentionMetadata:
    """Requests on scattered blocks of one shared cache (block ids permuted)."""
    seq = [c + n for c, n in zip(ctxs, qlens)]
    nblocks = [-(-s // BLOCK) for s in seq]
    perm = torch.randperm(sum(nblocks), generator=gen, device="cuda").to(torch.int32)
    table = torch.zeros(len(qlens), max(nblocks), dtype=torch.int32, device="cuda")
    used = 0
    for i, nb in enumerate(nblocks):
        table[i, :nb] = perm[used : used + nb]
        used += nb
    qsl = [0]
    for n in qlens:
        qsl.append(qsl[-1] + n)
    return AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor(seq, dtype=torch.int32, device="cuda"),
        block_table=table,
        slot_mapping=torch.full((qsl[-1],), -1, dtype=torch.int64, device="cuda"),
        max_query_len=max(qlens),
        max_seq_len=max(seq),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq,
        num_decodes=sum(n == 1 for n in qlens),
    )


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def check_store(kv: str, common: dict) -> tuple[dict, bool]:
    """kv_store and the RoPE-fused store vs write_rows, byte for byte (4,096 tokens)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    tokens, nblocks = 4096, 4096 // BLOCK
    k = torch.randn(tokens, HKV, D, device="cuda", generator=gen, dtype=torch.bfloat16)
    v = torch.randn(tokens, HKV, D, device="cuda", generator=gen, dtype=torch.bfloat16) * 3
    slots = torch.randperm(tokens, device="cuda", generator=gen)
    cache = torch.zeros(2, nblocks, BLOCK, HKV, D + 4, dtype=KV[kv], device="cuda")
    kv_store(k, v, cache, slots)
    want_k = torch.zeros_like(cache[0])
    write_rows(want_k, k, slots)
    mismatched = int((_bytes(cache[0]) != _bytes(want_k)).sum())
    # the fused store: rotate k (here with an identity table: cos 1, sin 0), store k and v
    q = torch.zeros(tokens, HQ * D, dtype=torch.bfloat16, device="cuda")
    cos_sin = torch.cat([torch.ones(64, D // 2), torch.zeros(64, D // 2)], 1).cuda()
    pos = torch.zeros(tokens, dtype=torch.int64, device="cuda")
    fused = torch.zeros_like(cache)
    kk = k.reshape(tokens, -1).clone()
    rotary_embedding(pos, q, kk, cos_sin, D, v=v.reshape(tokens, -1).contiguous(),
                     kv_cache=fused, slot_mapping=slots)  # fmt: skip
    mismatched_fused = int((_bytes(fused) != _bytes(cache)).sum())
    ok = mismatched == 0 and mismatched_fused == 0
    row = dict(kv_cache_dtype=kv, tokens=tokens, ok=ok, mismatched_fused_bytes=mismatched_fused)
    print("store", row, "mismatched bytes", mismatched, flush=True)
    return make_record("kv_store_mismatched_bytes", mismatched, common, **row), ok


def _caches(meta: AttentionMetadata, gen: torch.Generator) -> dict[str, torch.Tensor]:
    blocks = int(meta.block_table.max()) + 1
    bf16 = torch.randn(2, blocks, BLOCK, HKV, D, device="cuda", generator=gen)
    bf16 = (bf16 * torch.rand(2, blocks, BLOCK, 1, 1, device="cuda", generator=gen) * 4).bfloat16()
    out = {"bf16": bf16}
    for name, dtype in KV.items():
        out[name] = quantize_blocks(bf16, dtype)
    return out


def check_attention(label: str, qlens: list[int], ctxs: list[int], common: dict) -> tuple:
    gen = torch.Generator(device="cuda").manual_seed(len(qlens) + ctxs[0])
    meta = _meta(qlens, ctxs, gen)
    caches = _caches(meta, gen)
    q = torch.randn(sum(qlens), HQ, D, device="cuda", generator=gen).bfloat16()
    rows, ok = [], True
    for name, cache in caches.items():
        out = paged_attention(q, cache, meta, D**-0.5)
        ref = paged_attention_ref(q.float(), dequantize_blocks(cache, torch.float32), meta, D**-0.5)
        err = float((out.float() - ref).abs().max() / ref.abs().max())
        ok = ok and err <= CHECK_BOUND
        row = dict(
            case=label,
            kv_cache_dtype=name,
            batch=len(qlens),
            context=meta.max_seq_len,
            bound=CHECK_BOUND,
        )
        print("check", row, f"rel err {err:.2e}", flush=True)
        rows.append(make_record("attention_rel_err", err, common, **row))
    return rows, ok


def time_decode(batch: int, ctx: int, common: dict) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(batch * ctx)
    meta = _meta([1] * batch, [ctx - 1] * batch, gen)
    caches = _caches(meta, gen)
    q = torch.randn(batch, HQ, D, device="cuda", generator=gen).bfloat16()
    out = torch.empty_like(q)
    times = {}
    for name, cache in caches.items():
        times[name] = graph_replay_us(lambda c=cache: paged_attention(q, c, meta, D**-0.5, out))
    for tile in SWEEP:
        cfg = AttentionConfig(*tile)
        times[f"fp8 {tile}"] = graph_replay_us(
            lambda c=cfg: paged_attention(q, caches["fp8"], meta, D**-0.5, out, config=c)
        )
    rows = []
    for name, us in times.items():
        row = dict(
            kv_cache_dtype=name, batch=batch, context=ctx, speedup=round(times["bf16"] / us, 3)
        )
        print("time", row, f"{us:.1f} us", flush=True)
        rows.append(make_record("decode_attention_us", us, common, **row))
    return rows


def time_prefill(reqs: int, chunk: int, cached: int, common: dict) -> list[dict]:
    """Prompt chunks after cached prefixes (the prefill tiles), per cache dtype."""
    gen = torch.Generator(device="cuda").manual_seed(reqs * chunk)
    meta = _meta([chunk] * reqs, [cached] * reqs, gen)
    caches = _caches(meta, gen)
    q = torch.randn(reqs * chunk, HQ, D, device="cuda", generator=gen).bfloat16()
    out = torch.empty_like(q)
    # eager, as the engine runs prompt chunks this long (8-bit caches: over their copy)
    times = {
        name: event_us(lambda c=cache: paged_attention(q, c, meta, D**-0.5, out))
        for name, cache in caches.items()
    }
    rows = []
    for name, us in times.items():
        row = dict(kv_cache_dtype=name, requests=reqs, chunk=chunk, cached=cached,
                   speedup=round(times["bf16"] / us, 3))  # fmt: skip
        print("time prefill", row, f"{us:.1f} us", flush=True)
        rows.append(make_record("prefill_attention_us", us, common, **row))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the results here (JSON)")
    args = parser.parse_args()
    common = {**provenance("cuda"), "command": script_command(), "model": "llama-3-8b",
              "heads": HQ, "kv_heads": HKV, "head_dim": D, "block_size": BLOCK}  # fmt: skip
    rows, ok = [], True
    for kv in KV:
        row, good = check_store(kv, common)
        rows.append(row)
        ok = ok and good
    cases = [(f"decode b{b} ctx{c}", [1] * b, [c - 1] * b) for b in BATCHES for c in CONTEXTS]
    cases.append(("prefill 512 after 1536 cached", [512], [1536]))
    cases.append(("mixed 8 decodes + 300-token chunk", [1] * 8 + [300], [3000] * 8 + [700]))
    for label, qlens, ctxs in cases:
        found, good = check_attention(label, qlens, ctxs, common)
        rows += found
        ok = ok and good
    for batch, contexts in BATCHES_TIMED:
        for ctx in contexts:
            rows += time_decode(batch, ctx, common)
    rows += time_prefill(8, 512, 3584, common)
    if args.out:
        write_json(args.out, rows)
    if not ok:
        raise SystemExit("a check failed (see the records with ok false / err over bound)")


if __name__ == "__main__":
    main()
