"""W6 (MoE) on one GPU: W1 (batch-1 decode, 128-token prompt, 256 tokens) and a W2-shaped
throughput run on Mixtral-8x7B and DeepSeek-V2-Lite shapes (dummy weights, bf16), with the
floor counted on the weights a decode step reads (attention + router + shared experts + the
top-k experts of one token). One device call, a few minutes:

    run(command="python3 -m benchmarks.workloads.moe --out $OUT/moe.json")

``--models`` picks presets (default mixtral-8x7b,deepseek-v2-lite); ``--w2-requests`` the
throughput run's size (default 256 x (1,024 in, 256 out); 0: W1 only); ``--budget-s`` skips
what starts later; ``--quantization fp8`` quantizes the dummy weights online, experts
included. Results: benchmarks/results/W6_moe_h200.json.

``--long-decode B,CTX`` instead (``--kv-cache-dtype fp8`` for the 8-bit latent cache): B
requests of CTX-token prompts decoding together, the decode
step's time (median of the times between consecutive steps where all B decode, the step loop
left to overlap host and device as in serving) and, from torch.profiler over one such step,
the MLA decode kernel's time against the step's and the latent bytes it reads a second:

    run(command="python3 -m benchmarks.workloads.moe --models deepseek-v2-lite "
        "--long-decode 64,8192 --out $OUT/moe_b64_8k.json")
"""

from __future__ import annotations

import argparse
import json
import random
import time

from lightwell import LLM, SamplingParams
from lightwell.bench.results import record

COPY_GB_S = 4221.0  # the H200's device-to-device copy bandwidth (PERFORMANCE.md)
PEAK_TFLOPS = 788.0


def active_params(cfg: dict) -> tuple[float, float]:
    """(parameters a decode token reads, all parameters), from the preset's config."""
    h, layers, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    experts = cfg.get("num_local_experts") or cfg.get("n_routed_experts")
    top_k = cfg.get("num_experts_per_tok")
    inter = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    shared = cfg.get("n_shared_experts") or 0
    dense_layers = cfg.get("first_k_dense_replace", 0)
    if "kv_lora_rank" in cfg:  # MLA
        heads, nope, rope = (
            cfg["num_attention_heads"],
            cfg["qk_nope_head_dim"],
            cfg["qk_rope_head_dim"],
        )
        v, r = cfg["v_head_dim"], cfg["kv_lora_rank"]
        q = (
            h * heads * (nope + rope)
            if not cfg.get("q_lora_rank")
            else (h * cfg["q_lora_rank"] + cfg["q_lora_rank"] * heads * (nope + rope))
        )
        attn = q + h * (r + rope) + r * heads * (nope + v) + heads * v * h
    else:
        d = h // cfg["num_attention_heads"]
        attn = h * d * (cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"]) + h * h
    expert = 3 * h * inter
    dense_mlp = 3 * h * cfg["intermediate_size"]
    moe_layers = layers - dense_layers
    active = (
        layers * attn
        + dense_layers * dense_mlp
        + moe_layers * ((top_k + shared) * expert + h * experts)
        + vocab * h
    )
    total = (
        layers * attn
        + dense_layers * dense_mlp
        + moe_layers * ((experts + shared) * expert + h * experts)
        + 2 * vocab * h
    )
    return float(active), float(total)


def prompts(n: int, length: int, vocab: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(length)]} for _ in range(n)]


def run_model(name: str, args: argparse.Namespace, rows: list[dict]) -> None:
    from lightwell.models.hf_config import PRESETS

    cfg = dict(PRESETS[name])
    active, total = active_params(cfg)
    vocab = cfg["vocab_size"]
    t0 = time.perf_counter()
    quant = args.quantization
    llm = LLM(load_format="dummy", hf_config_json=name, dtype="bfloat16",
              skip_tokenizer_init=True, max_model_len=4096, quantization=quant)  # fmt: skip
    common = dict(model=name, dtype="bfloat16", tp=1, load_s=round(time.perf_counter() - t0, 1))
    if quant != "auto":
        common["quantization"] = quant
    sp = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True, detokenize=False)
    llm.generate(prompts(1, 128, vocab, 99), sp, use_tqdm=False)  # warm-up
    rates, ttfts = [], []
    for seed in (1, 2, 3):
        m = llm.generate(prompts(1, 128, vocab, seed), sp, use_tqdm=False)[0].metrics
        rates.append(255 / (m.last_token_time - m.first_token_time))
        ttfts.append(1e3 * (m.first_token_time - m.arrival_time))
    read = 2 * active  # bf16 weights; online fp8: 1-byte linears, the bf16 LM head
    if quant == "fp8":
        head = cfg["hidden_size"] * vocab
        read = active - head + 2 * head
    floor = COPY_GB_S * 1e9 / read
    rate = sorted(rates)[1]
    rows.append(record("decode_tok_s", rate, workload="W1", floor=round(floor, 1),
                       pct_of_floor=round(100 * rate / floor, 1), runs=rates,
                       active_params=active, total_params=total, **common))  # fmt: skip
    rows.append(record("ttft_ms", sorted(ttfts)[1], workload="W1", prompt_len=128, runs=ttfts,
                       **common))  # fmt: skip
    _save(args, rows)
    n = args.w2_requests
    if n == 0:  # W1 only
        return
    t0 = time.perf_counter()
    outs = llm.generate(prompts(n, 1024, vocab, 7), sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs) + 1024 * n
    mfu = tokens * 2 * active / wall / (PEAK_TFLOPS * 1e12)
    shape = "W2" if n == 1000 else "W2-shaped"  # W2: 1,000 requests of 1,024 in / 256 out
    rows.append(record("total_tok_s", tokens / wall, workload=shape, requests=n,
                       wall_s=round(wall, 2), mfu_active=round(mfu, 4), **common))  # fmt: skip
    _save(args, rows)
    del llm


def run_long_decode(name: str, args: argparse.Namespace, rows: list[dict]) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from lightwell.models.hf_config import PRESETS

    cfg = dict(PRESETS[name])
    b, ctx = (int(v) for v in args.long_decode.split(","))
    llm = LLM(load_format="dummy", hf_config_json=name, dtype="bfloat16", skip_tokenizer_init=True,
              max_model_len=ctx + 128, max_num_seqs=max(b, 64),
              kv_cache_dtype=args.kv_cache_dtype)  # fmt: skip
    engine = llm.engine
    sp = SamplingParams(temperature=0.0, max_tokens=b + 48, ignore_eos=True, detokenize=False)
    for i, p in enumerate(prompts(b, ctx, cfg["vocab_size"], 5)):
        engine.add_request(f"r{i}", p, sp)
    steps, prof, last = [], None, None
    while engine.has_unfinished_requests():
        if prof is None and len(steps) >= 16:  # one all-decode step profiled, then go on
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                engine.step()
                torch.cuda.synchronize()
            last = None
            continue
        n = len(engine.step())  # no synchronize: the step loop overlaps as it does in serving
        now = time.perf_counter()
        if n == b and last is not None and engine.has_unfinished_requests():
            steps.append(1e3 * (now - last))
        last = now if n == b else None
    step_ms = sorted(steps)[len(steps) // 2]
    common = dict(model=name, batch=b, context=ctx, dtype="bfloat16", tp=1,
                  kv_cache_dtype=args.kv_cache_dtype, workload=f"decode_b{b}_ctx{ctx}")  # fmt: skip
    rows.append(record("decode_step_ms", step_ms, steps=len(steps), runs=steps, **common))
    try:
        times = {e.key: e.self_device_time_total for e in prof.key_averages()
                 if e.self_device_time_total > 0}  # fmt: skip
    except Exception as e:  # noqa: BLE001 - the step time stands without the split
        print(f"profile unreadable: {type(e).__name__}: {e}", flush=True)
        _save(args, rows)
        return
    # With PDL a kernel's recorded time includes its wait under the kernel ahead of it (the
    # split-KV combine's spans most of the decode kernel's), so kernel times overlap: the
    # decode kernel alone (its wait under the short prepare kernel included) is set against
    # the step's wall time and the cache it reads.
    decode_us = sum(v for k, v in times.items() if "_mla_decode_kernel" in k)
    mla_all = {k: v for k, v in times.items() if "mla" in k.lower() or "_combine_kernel" in k}
    entry = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]  # values; bytes as stored:
    entry = entry * 2 if args.kv_cache_dtype == "auto" else entry + 4
    latent = b * ctx * entry * cfg["num_hidden_layers"]
    rows.append(record("mla_decode_share_of_step", decode_us / 1e3 / step_ms,
                       decode_us=decode_us, step_ms=step_ms, decode_gb_s=latent / decode_us / 1e3,
                       copy_gb_s=COPY_GB_S, mla_kernels_us=mla_all,
                       top_kernels_us=dict(sorted(times.items(), key=lambda kv: -kv[1])[:12]),
                       **common))  # fmt: skip
    _save(args, rows)
    del llm


def _save(args: argparse.Namespace, rows: list[dict]) -> None:
    for r in rows[-2:]:
        print(f"  {r['model']} {r['metric']} = {r['value']}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out")
    ap.add_argument("--models", default="mixtral-8x7b,deepseek-v2-lite")
    ap.add_argument("--w2-requests", type=int, default=256)
    ap.add_argument("--budget-s", type=float, default=1e9)
    ap.add_argument(
        "--quantization",
        default="auto",
        choices=("auto", "fp8"),
        help="the engine's --quantization (fp8: online, experts included; the floor then "
        "counts 1-byte linears and the bf16 LM head)",
    )
    ap.add_argument(
        "--long-decode", default=None, help="B,CTX: decode step at batch B, CTX context"
    )
    ap.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=("auto", "fp8", "int8"),
        help="the engine's --kv-cache-dtype (--long-decode runs)",
    )
    args = ap.parse_args()
    rows: list[dict] = []
    start = time.perf_counter()
    for name in args.models.split(","):
        if time.perf_counter() - start > args.budget_s:
            print(f"== skipping {name}: past --budget-s", flush=True)
            continue
        print(f"== {name}", flush=True)
        try:
            (run_long_decode if args.long_decode else run_model)(name, args, rows)
        except Exception as e:  # noqa: BLE001 - keep what the other model measured
            print(f"== {name} failed: {type(e).__name__}: {e}", flush=True)
        import gc

        import torch

        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
