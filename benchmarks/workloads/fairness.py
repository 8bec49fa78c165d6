"""Head-of-line blocking under a long prompt: the TTFT of a short request that arrives while an
8,192-token prompt is being prefilled, under three schedules:

- ``chunked``: chunked prefill with ``--long-prefill-fraction 0.75`` (the default): the long
  prefill takes at most 3/4 of a step's token budget while requests wait;
- ``chunked-whole-budget``: chunked prefill, fraction 1.0 (running prefills take the budget);
- ``unchunked``: ``--no-enable-chunked-prefill`` (the prompt's prefill is one step).

The engine is driven step by step: the long request is added, then at once the short one (20
tokens, 1 output token) behind it in the queue, the worst moment to arrive; steps run until
both have their token. Dummy weights, greedy. On the H200 (llama-3-8b shapes, bf16, the
server's 2,048-token budget):

    run(command="python3 -m benchmarks.workloads.fairness --out $OUT/fairness.json")

On CPU (SmolLM2-135M shapes, fp32, the CPU default budget of 512 tokens; ``--threads``):

    python3 -m benchmarks.workloads.fairness --device cpu --shape smollm2-135m --threads 4 \\
        --repeats 1 --out benchmarks/results/fairness_cpu.json

Reference results: benchmarks/results/fairness_h200.json, fairness_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import time

from benchmarks.workloads.engine import rand_prompts
from lightwell.bench.results import record, write_json

SHAPES = {
    "llama-3-8b": {"preset": "llama-3-8b"},
    "smollm2-135m": {
        "preset": "llama-3-8b", "hidden_size": 576, "intermediate_size": 1536,
        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
        "vocab_size": 49152, "max_position_embeddings": 8192, "rope_theta": 100000.0,
        "tie_word_embeddings": True,
    },
}  # fmt: skip
SCHEDULES = {
    "chunked": {"long_prefill_fraction": 0.75},
    "chunked-whole-budget": {"long_prefill_fraction": 1.0},
    "unchunked": {"enable_chunked_prefill": False},
}


def _llm(args: argparse.Namespace, schedule: dict):
    from lightwell import LLM

    return LLM(
        load_format="dummy",
        hf_config_json=json.dumps({**SHAPES[args.shape], "max_position_embeddings": 16384}),
        device=args.device,
        dtype="bfloat16" if args.device == "cuda" else "float32",
        max_num_batched_tokens=args.budget,
        max_model_len=args.long_len + 64,
        **schedule,
    )


def _one(llm, args: argparse.Namespace, seed: int, long_len: int | None = None) -> dict:
    """Times (s) of one arrival: the short request's TTFT, the long request's TTFT."""
    from lightwell import SamplingParams

    engine = llm.engine
    vocab = engine.model_info.vocab_size
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
    t_long = time.perf_counter()
    engine.add_request("long", rand_prompts(1, long_len or args.long_len, vocab, seed)[0], one)
    done: dict[str, float] = {}

    def step() -> None:
        for out in engine.step():
            if out.outputs and out.outputs[0].token_ids and out.request_id not in done:
                done[out.request_id] = time.perf_counter()

    t_short = time.perf_counter()
    engine.add_request("short", rand_prompts(1, args.short_len, vocab, seed + 1)[0], one)
    steps = 0
    while engine.has_unfinished_requests():
        step()
        steps += 1
    return {"short_ttft_s": done["short"] - t_short, "long_ttft_s": done["long"] - t_long,
            "steps": steps}  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--shape", default="llama-3-8b", choices=sorted(SHAPES))
    p.add_argument("--budget", type=int, default=None, help="token budget (default by device)")
    p.add_argument("--long-len", type=int, default=8192)
    p.add_argument("--short-len", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--schedules", default=",".join(SCHEDULES))
    p.add_argument("--threads", type=int, default=1, help="CPU threads (--device cpu)")
    args = p.parse_args()
    if args.budget is None:
        args.budget = 2048 if args.device == "cuda" else 512
    if args.device == "cpu":
        import torch

        torch.set_num_threads(args.threads)
    rows = []
    for name in args.schedules.split(","):
        llm = _llm(args, SCHEDULES[name])
        _one(llm, args, seed=0, long_len=min(args.long_len, 1024))  # warm-up
        runs = [_one(llm, args, seed=10 * i + 1) for i in range(args.repeats)]
        del llm
        short = sorted(r["short_ttft_s"] for r in runs)[len(runs) // 2]
        longt = sorted(r["long_ttft_s"] for r in runs)[len(runs) // 2]
        fields = dict(workload="fairness", schedule=name, shape=args.shape, device=args.device,
                      threads=args.threads if args.device == "cpu" else None,
                      budget=args.budget, long_len=args.long_len, short_len=args.short_len,
                      runs=runs)  # fmt: skip
        rows.append(record("short_ttft_ms", 1e3 * short, long_ttft_ms=1e3 * longt, **fields))
        print(f"{name:22s} short TTFT {1e3 * short:9.1f} ms   long TTFT {1e3 * longt:9.1f} ms",
              flush=True)  # fmt: skip
        write_json(args.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
