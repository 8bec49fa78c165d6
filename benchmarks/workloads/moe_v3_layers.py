"""DeepSeek-V3 layers on one GPU: the time a decoder layer of V3's shapes (MLA with q-LoRA,
256 routed experts of 2,048, top-8 in 4 of 8 groups, one shared expert; bf16 or, ``--fp8``, the
FP8 128 x 128 blocks V3 ships in; dummy weights) adds to a decode step at batch 1 and 64 and to
a 2,048-token prefill. A layer of 256 bf16 experts is 22.5 GB (11.3 GB in FP8), so one H200
holds a few: the model is built with ``--layers`` MoE layers (first_k_dense_replace 0), twice,
and a layer's time is the difference over the difference in layers (the embedding, LM head,
sampling and host work cancel). One device call, ~3 min:

    run(command="python3 -m benchmarks.workloads.moe_v3_layers --out $OUT/v3_layers.json")
    run(command="python3 -m benchmarks.workloads.moe_v3_layers --fp8 --layers 1,10 "
        "--out $OUT/v3_layers_fp8.json")

Reference result: benchmarks/results/W6_v3_layers_h200.json; docs/models.md turns it into an
estimate of the whole model on eight GPUs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from benchmarks.workloads.engine import rand_prompts
from lightwell.bench.results import record, write_json

# DeepSeek-V3's published quantization_config
FP8_BLOCK = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
             "weight_block_size": [128, 128]}  # fmt: skip


def _decode_step_ms(llm, batch: int) -> float:
    """Median ms between tokens of ``batch`` requests decoding together (64 tokens each)."""
    from lightwell import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, detokenize=False)
    outs = llm.generate(rand_prompts(batch, 32, 129280, batch), sp, use_tqdm=False)
    per = [(o.metrics.last_token_time - o.metrics.first_token_time) / 63 for o in outs]
    return 1e3 * statistics.median(per)


def _ttft_ms(llm, length: int) -> float:
    from lightwell import SamplingParams

    one = SamplingParams(max_tokens=1, ignore_eos=True, detokenize=False)
    t = []
    for seed in (1, 2, 3):
        m = llm.generate(rand_prompts(1, length, 129280, seed), one, use_tqdm=False)[0].metrics
        t.append(1e3 * (m.first_token_time - m.arrival_time))
    return statistics.median(t)


def measure(layers: int, override: dict) -> dict:
    from lightwell import LLM

    cfg = {"preset": "deepseek-v3", "num_hidden_layers": layers, "first_k_dense_replace": 0,
           **override}  # fmt: skip
    t0 = time.perf_counter()
    llm = LLM(load_format="dummy", hf_config_json=json.dumps(cfg), dtype="bfloat16",
              skip_tokenizer_init=True, max_model_len=4096, max_num_seqs=64,
              max_num_batched_tokens=2048, kv_cache_memory_gb=4.0)  # fmt: skip
    load_s = time.perf_counter() - t0
    _decode_step_ms(llm, 1)  # warm-up
    res = {"layers": layers, "load_s": round(load_s, 1)}
    res["decode_b1_ms"] = _decode_step_ms(llm, 1)
    res["decode_b64_ms"] = _decode_step_ms(llm, 64)
    res["ttft_2048_ms"] = _ttft_ms(llm, 2048)
    print(res, flush=True)
    llm.engine.shutdown()
    del llm
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", default="1,4", help="two MoE layer counts")
    ap.add_argument("--override", default="{}", help="config fields as JSON (a CPU smoke test)")
    ap.add_argument(
        "--fp8",
        action="store_true",
        help="the checkpoint format V3 ships in: HF fine-grained FP8 (128 x 128 block scales), "
        "experts and attention linears; the embedding and LM head stay bf16",
    )
    args = ap.parse_args()
    lo, hi = (int(x) for x in args.layers.split(","))
    override = json.loads(args.override)
    if args.fp8:
        override["quantization_config"] = FP8_BLOCK
    a = measure(lo, override)
    import gc

    import torch

    gc.collect()
    torch.cuda.empty_cache()
    b = measure(hi, override)
    rows = []
    model = "deepseek-v3 layer (" + ("fp8 128x128 blocks" if args.fp8 else "bf16") + ")"
    for key in ("decode_b1_ms", "decode_b64_ms", "ttft_2048_ms"):
        per_layer = (b[key] - a[key]) / (hi - lo)
        rows.append(record(f"v3_layer_{key}", per_layer, model=model, runs={lo: a, hi: b}))
        print(f"per layer {key}: {per_layer:.3f} ms", flush=True)
    write_json(args.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
