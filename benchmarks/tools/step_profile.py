"""Where a step's GPU time goes, kernel by kernel (llama-3-8b shapes, bf16, dummy weights, one
H200): torch.profiler over single engine steps run eagerly (CUDA-graph replays hide their
kernels from the profiler; the kernels and their times are the same). About 2 minutes:

    run(command="python3 -m benchmarks.tools.step_profile --out $OUT/profile")

Steps profiled: a batch-1 decode at a 200-token context (W1), a decode-only step of
--batch requests at ~1,100 tokens of context, and a W2-like mixed step (those decodes plus
1,024-token prompts up to the 8,192-token budget). Each writes a kernel table (by CUDA time)
to --out/<step>.txt and a summary row (step wall, CUDA total, top kernels) to
--out/profile.json. ``--stages gaps`` adds a chrome trace of the async loop's decode steps and
the GPU's idle gaps. Profiles are not kept in benchmarks/results. The profiler helpers here
(``cuda_kernels``, ``idle_gaps``, ``profiled_step``, ``scheduled_steps``) serve
workloads/engine.py and workloads/tp.py too.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
import time
from collections.abc import Iterator

import torch

from lightwell import LLM, SamplingParams
from lightwell.bench.results import record


def prompt(n: int, seed: int) -> dict:
    rng = random.Random(seed)
    return {"prompt_token_ids": [rng.randrange(32000) for _ in range(n)]}


def cuda_kernels(prof) -> list[dict]:
    """The CUDA kernels a torch.profiler run recorded, by start: name, stream, ts, dur (us)."""
    kernels = [
        {
            "name": e.name[:80],
            "stream": e.device_resource_id,
            "ts": e.time_range.start,
            "dur": e.time_range.end - e.time_range.start,
        }
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    ]
    return sorted(kernels, key=lambda k: k["ts"])


def idle_gaps(kernels: list[dict]) -> list[float]:
    """The gaps (us) in which no kernel of ``kernels`` (``cuda_kernels``' rows, by start) ran."""
    gaps, end = [], None
    for k in kernels:
        if end is not None and k["ts"] > end:
            gaps.append(k["ts"] - end)
        stop = k["ts"] + k["dur"]
        end = stop if end is None else max(end, stop)
    return gaps


def profiled_step(engine) -> tuple:
    """(torch.profiler result, wall seconds) of one ``engine.step()``, the GPU drained."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    return prof, wall


@contextlib.contextmanager
def scheduled_steps(engine) -> Iterator[list[tuple[float, int, int, int]]]:
    """Records (time, tokens, requests, single-token rows) of every step the engine schedules
    inside the block."""
    steps, plain = [], engine.schedule

    def traced(**kwargs):
        s = plain(**kwargs)
        ones = sum(1 for k in s.num_scheduled_tokens.values() if k == 1)
        n = s.total_num_scheduled_tokens
        steps.append((time.perf_counter(), n, len(s.num_scheduled_tokens), ones))
        return s

    engine.schedule = traced
    try:
        yield steps
    finally:
        engine.schedule = plain


def profile_step(args, engine, label: str, rows: list) -> None:
    with scheduled_steps(engine) as steps:
        prof, wall = profiled_step(engine)
    sched_tokens = [(tokens, reqs) for _, tokens, reqs, _ in steps]
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    events.sort(key=lambda e: -e.self_device_time_total)
    total = sum(e.self_device_time_total for e in events)
    with open(os.path.join(args.out, f"{label}.txt"), "w") as f:
        f.write(f"step wall {wall * 1e3:.2f} ms, CUDA total {total / 1e3:.2f} ms, "
                f"(tokens, requests) {sched_tokens}\n")  # fmt: skip
        for e in events:
            f.write(f"{e.self_device_time_total / 1e3:10.3f} ms {e.count:6d}x  {e.key[:150]}\n")
    top = [(e.key[:90], round(e.self_device_time_total / 1e3, 3), e.count) for e in events[:12]]
    rows.append(record("step_cuda_ms", total / 1e3, workload=label, wall_ms=wall * 1e3,
                       scheduled=sched_tokens, top_kernels=top, model=args.hf_config_json,
                       dtype="bfloat16"))  # fmt: skip
    with open(os.path.join(args.out, "profile.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print(f"{label}: wall {wall * 1e3:.2f} ms, CUDA {total / 1e3:.2f} ms {sched_tokens}")
    for name, ms, n in top:
        print(f"   {ms:9.3f} ms {n:5d}x {name}")


def gpu_gaps(args, batch: int, steps: int = 8) -> None:
    """The async loop in steady state (CUDA graphs on): a chrome trace of ``steps`` engine steps
    of ``batch`` decodes at ~1,100 tokens of context, and the GPU's idle time between kernels."""
    from torch.profiler import ProfilerActivity, profile

    llm = LLM(load_format="dummy", hf_config_json="llama-3-8b", dtype="bfloat16",
              async_scheduling=True, max_num_seqs=256, max_num_batched_tokens=8192)  # fmt: skip
    engine = llm.engine
    sp = SamplingParams(temperature=0.0, max_tokens=4096, ignore_eos=True, detokenize=False)
    for i in range(batch):
        engine.add_request(f"d{i}", prompt(1024, 100 + i), sp)
    for _ in range(200):
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = time.perf_counter() - t0
    prof.export_chrome_trace(os.path.join(args.out, "async_decode_trace.json"))
    kernels = cuda_kernels(prof)
    idle = sorted(idle_gaps(kernels), reverse=True)
    summary = dict(
        steps=steps,
        wall_ms=wall * 1e3,
        gpu_idle_ms=sum(idle) / 1e3,
        largest_gaps_us=[round(x, 1) for x in idle[:12]],
        kernels=len(kernels),
    )
    with open(os.path.join(args.out, "async_decode_gaps.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print("async decode steps:", summary)
    llm.engine.shutdown()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=224)
    ap.add_argument(
        "--stages",
        default="kernels",
        help="kernels (eager kernel tables), gaps, b1 (the batch-1 decode table only)",
    )
    ap.add_argument("--hf-config-json", default="llama-3-8b", help="model preset or config.json")
    ap.add_argument("--engine-args", default="{}", help="more LLM(...) arguments, as JSON")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if "gaps" in args.stages:
        gpu_gaps(args, args.batch)
    if "kernels" not in args.stages and "b1" not in args.stages:
        return 0
    llm = LLM(load_format="dummy", hf_config_json=args.hf_config_json, dtype="bfloat16",
              enforce_eager=True, async_scheduling=False, max_num_seqs=256,
              max_num_batched_tokens=8192, **json.loads(args.engine_args))  # fmt: skip
    engine, rows = llm.engine, []
    long = SamplingParams(temperature=0.0, max_tokens=4096, ignore_eos=True, detokenize=False)
    # W1: one request, 128-token prompt, decoding at ~200 tokens of context
    engine.add_request("w1", prompt(128, 1), long)
    for _ in range(72):
        engine.step()
    profile_step(args, engine, "decode_b1_ctx200", rows)
    if "kernels" not in args.stages:
        return 0
    engine.abort_request("w1")
    engine.step()
    # W2-like: a batch of decodes at ~1,100 tokens of context, then 1,024-token prompts arrive
    for i in range(args.batch):
        engine.add_request(f"d{i}", prompt(1024, 100 + i), long)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) or (
        engine.scheduler.waiting
    ):
        engine.step()
    for _ in range(64):
        engine.step()
    profile_step(args, engine, f"decode_b{args.batch}_ctx1100", rows)
    for i in range(9):
        engine.add_request(f"p{i}", prompt(1024, 900 + i), long)
    profile_step(args, engine, f"mixed_{args.batch}dec_plus_prefill", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
