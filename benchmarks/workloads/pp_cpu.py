"""Pipeline parallelism on CPU: each stage's utilisation (busy time / wall time) under a
W2-shaped load (random prompts, all submitted at once, EOS ignored), scaled to SmolLM2-135M on
a few cores: PP=2 (one thread a stage) against PP=1 (one thread), greedy.

    python3 -m benchmarks.workloads.pp_cpu --out benchmarks/results/pp_cpu.json

Busy time is a rank's time in steps less its wait for the previous stage's activations
(``ModelRunner.stage_time``). One batch is in flight at a time (the pipeline has no in-flight
micro-batches yet), so a stage waits for the other's part of every step.
"""

from __future__ import annotations

import argparse
import random
import time

from lightwell.bench.results import record, write_json


def _prompts(n: int, length: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [
        {"prompt_token_ids": [rng.randrange(100, 49000) for _ in range(length)]} for _ in range(n)
    ]


def run(pp: int, args: argparse.Namespace) -> dict:
    from lightwell import LLM, SamplingParams

    llm = LLM(
        pipeline_parallel_size=pp,
        num_threads=1,
        max_num_seqs=args.requests,
        max_num_batched_tokens=args.step_tokens,
    )
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        llm.generate(_prompts(1, 16, seed=99), SamplingParams(max_tokens=2), use_tqdm=False)
        before = _times(llm)
        t0 = time.perf_counter()
        outs = llm.generate(_prompts(args.requests, args.prompt_len), sp, use_tqdm=False)
        wall = time.perf_counter() - t0
        after = _times(llm)
    finally:
        llm.engine.shutdown()
    tokens = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in outs)
    busy = [a["busy_s"] - b["busy_s"] for a, b in zip(after, before)]
    return {"wall_s": wall, "total_tok_s": tokens / wall, "stage_busy_s": busy,
            "stage_utilisation": [b / wall for b in busy]}  # fmt: skip


def _times(llm: object) -> list[dict]:
    executor = llm.engine.executor
    if hasattr(executor, "stage_times"):
        return executor.stage_times()
    return [dict(executor.worker.runner.stage_time)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--step-tokens", type=int, default=512)
    ap.add_argument("--out", default="benchmarks/results/pp_cpu.json")
    args = ap.parse_args()
    shape = {"requests": args.requests, "prompt_len": args.prompt_len,
             "output_len": args.output_len, "step_tokens": args.step_tokens}  # fmt: skip
    rows = []
    for pp in (1, 2):
        r = run(pp, args)
        print(f"PP={pp}: {r}")
        for stage, util in enumerate(r["stage_utilisation"]):
            rows.append(record("stage_utilisation", util, pp=pp, stage=stage,
                               micro_batches=False, **shape))  # fmt: skip
        rows.append(record("total_tok_s", r["total_tok_s"], pp=pp, wall_s=r["wall_s"], **shape))
    write_json(args.out, rows)


if __name__ == "__main__":
    main()
