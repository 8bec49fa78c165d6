"""Host work of one engine step, phase by phase, on the CPU.

A tiny 2-layer random Llama keeps the forward small, so what is left is the control plane and
input preparation: scheduling, InputBatch.prepare, logits + sampling, Scheduler.update and
output processing, each timed by wrapping it. 256 running decode requests by default. On the
CPU, about a minute:

    python3 -m benchmarks.tools.host_overhead --out benchmarks/results/host_overhead_cpu.json

``--requests 256 --steps 40 --async-scheduling`` change the load and the loop.
"""

from __future__ import annotations

import argparse
import tempfile
import time

from lightwell.bench.results import record, write_json


def _timed(fn, acc: dict[str, float], key: str):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[key] += time.perf_counter() - t0

    return wrapper


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--async-scheduling", action="store_true")
    ap.add_argument("--out", help="write the per-phase ms per step as JSON here")
    args = ap.parse_args()

    from lightwell import LLM, SamplingParams
    from tests.models.tiny import hf_tiny_model, save_hf, tiny_config

    cfg = tiny_config(
        "base",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    folder = save_hf(hf_tiny_model(cfg, seed=1), tempfile.mkdtemp())
    llm = LLM(
        folder,
        skip_tokenizer_init=True,
        max_num_seqs=args.requests,
        max_num_batched_tokens=8192,
        num_kv_blocks=8192,
        num_threads=1,
        async_scheduling=args.async_scheduling,
    )
    engine = llm.engine
    sp = SamplingParams(
        temperature=0.0, max_tokens=args.steps + 20, ignore_eos=True, detokenize=False
    )
    for i in range(args.requests):
        prompt = [(i * 7 + j) % 100 + 1 for j in range(64)]
        engine.add_request(None, {"prompt_token_ids": prompt}, sp)
    for _ in range(5):  # prefill, then steady decode
        engine.step()
    acc = dict.fromkeys(("forward", "prepare", "sample", "schedule", "update", "process"), 0.0)
    runner = engine.executor.worker.runner
    runner.forward = _timed(runner.forward, acc, "forward")
    runner.batch.prepare = _timed(runner.batch.prepare, acc, "prepare")
    runner._sample = _timed(runner._sample, acc, "sample")
    engine.scheduler.schedule = _timed(engine.scheduler.schedule, acc, "schedule")
    engine.scheduler.update = _timed(engine.scheduler.update, acc, "update")
    engine.output_processor.process = _timed(engine.output_processor.process, acc, "process")
    t0 = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    per_step = (time.perf_counter() - t0) / args.steps
    phases = ", ".join(f"{k} {1e3 * v / args.steps:.2f}" for k, v in acc.items())
    print(f"{args.requests} decodes: step {1e3 * per_step:.2f} ms; {phases} (ms per step)")
    if args.out:
        common = dict(
            requests=args.requests, steps=args.steps, async_scheduling=args.async_scheduling
        )
        rows = [record("step_ms", 1e3 * per_step, **common)]
        rows += [record(f"{k}_ms", 1e3 * v / args.steps, **common) for k, v in acc.items()]
        write_json(args.out, rows)


if __name__ == "__main__":
    main()
