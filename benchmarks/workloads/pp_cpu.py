"""Pipeline parallelism on CPU: each stage's utilisation (busy time / wall time) under a
W2-shaped load (random prompts, all submitted at once, EOS ignored), scaled to SmolLM2-135M on
a few cores: PP=2 (one thread a stage) against PP=1 (one thread), greedy.

    python3 -m benchmarks.workloads.pp_cpu --out benchmarks/results/pp_cpu.json

Busy time is a rank's time in steps less its wait for the previous stage's activations
(``PipelineStage.times``); PP=1 has one stage, busy throughout, and is the throughput
reference. PP=2 runs twice: one batch in flight (``--pipeline-in-flight 1``: a stage waits for
the other's part of every step) and two (the default: the stages work on different batches).
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


def run(pp: int, in_flight: int | None, args: argparse.Namespace) -> dict:
    from lightwell import LLM, SamplingParams

    llm = LLM(
        pipeline_parallel_size=pp,
        pipeline_in_flight=in_flight,
        num_threads=1,
        max_num_seqs=args.requests,
        max_num_batched_tokens=args.step_tokens,
    )
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        llm.generate(_prompts(1, 16, seed=99), SamplingParams(max_tokens=2), use_tqdm=False)
        before = stage_times(llm)
        t0 = time.perf_counter()
        outs = llm.generate(_prompts(args.requests, args.prompt_len), sp, use_tqdm=False)
        wall = time.perf_counter() - t0
        after = stage_times(llm)
    finally:
        llm.engine.shutdown()
    tokens = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in outs)
    busy = stage_busy(before, after) or [wall]
    return {"wall_s": wall, "total_tok_s": tokens / wall, "stage_busy_s": busy,
            "stage_utilisation": [b / wall for b in busy]}  # fmt: skip


def stage_busy(before: list[dict], after: list[dict], key: str = "busy_s") -> list[float]:
    """Each stage's ``key`` counter between two ``stage_times`` readings (stages without it,
    e.g. ``gpu_busy_s`` on a CPU, left out)."""
    return [a[key] - b[key] for a, b in zip(after, before) if key in a]


def stage_times(llm: object) -> list[dict]:
    """Each pipeline stage's ``PipelineStage.times`` (none without stages); also used by
    workloads/tp.py's W2 stage."""
    executor = llm.engine.executor
    if hasattr(executor, "stage_times"):
        return [t for t in executor.stage_times() if t is not None]
    return []


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
    for pp, in_flight in ((1, None), (2, 1), (2, 2)):
        r = run(pp, in_flight, args)
        print(f"PP={pp}, in flight {in_flight}: {r}", flush=True)
        batches = {"pp": pp, "in_flight": in_flight or 1, **shape}
        for stage, util in enumerate(r["stage_utilisation"]):
            rows.append(record("stage_utilisation", util, stage=stage, **batches))
        rows.append(record("total_tok_s", r["total_tok_s"], wall_s=r["wall_s"], **batches))
    write_json(args.out, rows)


if __name__ == "__main__":
    main()
