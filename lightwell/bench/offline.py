"""`lightwell bench throughput` (W2) and `lightwell bench latency` (W1) over the offline API.

Both take every engine option and import nothing from ``lightwell.server`` (no FastAPI needed).
Prompts are random token ids (special tokens excluded) so lengths are exact; every timed batch
gets fresh prompts, so nothing is served from the prefix cache.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

from lightwell.bench.datasets import SampleRequest, random_requests
from lightwell.bench.results import make_record, parse_metadata, provenance, write_json

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def make_llm(args: argparse.Namespace) -> Any:
    from lightwell.cli_args import engine_config_from_args
    from lightwell.engine.llm import LLM

    flat = engine_config_from_args(args).flat()
    name = flat["model"] or "SmolLM2-135M-Instruct (the default model)"
    print(f"lightwell bench: loading {name} ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    llm = LLM(flat.pop("model"), **flat)
    print(f"lightwell bench: loaded in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return llm


def _prompts(reqs: list[SampleRequest]) -> list[dict]:
    return [{"prompt_token_ids": r.prompt} for r in reqs]


def _params(reqs: list[SampleRequest], temperature: float) -> list[Any]:
    from lightwell.types import SamplingParams

    return [
        SamplingParams(temperature=temperature, max_tokens=r.output_len, ignore_eos=True)
        for r in reqs
    ]


def _requests(llm: Any, args: argparse.Namespace, n: int, seed: int) -> list[SampleRequest]:
    return random_requests(
        llm.get_tokenizer(),
        n,
        args.input_len,
        args.output_len,
        range_ratio=getattr(args, "range_ratio", 0.0),
        seed=seed,
        as_token_ids=True,
    )


def _common(llm: Any, args: argparse.Namespace, workload: str) -> dict[str, Any]:
    info = llm.engine.model_info
    cfg = llm.engine.config
    out = {
        "workload": workload,
        "model": info.name,
        "dtype": info.dtype,
        "tp": cfg.parallel.tensor_parallel_size,
        **provenance(info.device),
        "input_len": args.input_len,
        "output_len": args.output_len,
        "max_num_seqs": cfg.scheduler.max_num_seqs,
        "max_num_batched_tokens": cfg.scheduler.max_num_batched_tokens,
    }
    out.update(parse_metadata(args.metadata))
    return out


def _finish(rows: list[dict], args: argparse.Namespace) -> None:
    if args.result_json:
        write_json(args.result_json, rows)


# ---- throughput (W2) -------------------------------------------------------------------------
def cmd_throughput(args: argparse.Namespace) -> int:
    llm = make_llm(args)
    if args.num_warmups:
        warm = _requests(llm, args, args.num_warmups, args.seed + 10_000)
        for r in warm:
            r.output_len = min(r.output_len, 4)
        llm.generate(_prompts(warm), _params(warm, args.temperature), use_tqdm=False)
    reqs = _requests(llm, args, args.num_prompts, args.seed)
    t0 = time.perf_counter()
    outs = llm.generate(
        _prompts(reqs), _params(reqs, args.temperature), use_tqdm=not args.no_progress
    )
    wall = time.perf_counter() - t0
    n_in = sum(len(o.prompt_token_ids) for o in outs)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    params = llm.engine.model_info.num_params
    mfu = (n_in + n_out) * 2 * params / wall / (args.peak_tflops * 1e12)
    values = {
        "output_tok_s": n_out / wall,
        "total_tok_s": (n_in + n_out) / wall,
        "request_s": len(outs) / wall,
        "mfu": mfu,
    }
    print(f"{len(outs)} requests, {n_in} prompt + {n_out} output tokens in {wall:.2f} s")
    print(
        f"  requests/s {values['request_s']:.2f}   output tok/s {values['output_tok_s']:.1f}   "
        f"total tok/s {values['total_tok_s']:.1f}"
    )
    print(
        f"  MFU {mfu * 100:.2f} % ({params / 1e9:.3f} B params, peak {args.peak_tflops:g} TFLOP/s)"
    )
    common = {
        **_common(llm, args, args.workload or "W2"),
        "num_prompts": args.num_prompts,
        "wall_s": round(wall, 3),
        "num_params": params,
        "peak_tflops": args.peak_tflops,
    }
    _finish([make_record(k, v, common) for k, v in values.items()], args)
    return 0


# ---- latency (W1) ----------------------------------------------------------------------------
@dataclass
class BatchTiming:
    ttft_s: float  # mean over the batch's requests
    tpot_s: float  # mean over the batch: (last token - first token) / (output tokens - 1)
    e2e_s: float  # the whole batch, wall time


def time_batch(llm: Any, reqs: list[SampleRequest], temperature: float) -> BatchTiming:
    t0 = time.perf_counter()
    outs = llm.generate(_prompts(reqs), _params(reqs, temperature), use_tqdm=False)
    e2e = time.perf_counter() - t0
    ttfts, tpots = [], []
    for o in outs:
        m = o.metrics
        n = len(o.outputs[0].token_ids)
        ttfts.append(m.first_token_time - m.arrival_time)
        if n > 1:
            tpots.append((m.last_token_time - m.first_token_time) / (n - 1))
    tpot = statistics.fmean(tpots) if tpots else float("nan")
    return BatchTiming(statistics.fmean(ttfts), tpot, e2e)


def streamed_weight_bytes(llm: Any) -> int:
    """Bytes of weights read per decode step: all parameters but an untied embedding table."""
    info = llm.engine.model_info
    params = info.num_params
    if not info.tie_word_embeddings:
        params -= info.vocab_size * info.hidden_size
    return params * DTYPE_BYTES.get(info.dtype, 4)


def cmd_latency(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    llm = make_llm(args)
    seed = args.seed
    total = args.num_iters_warmup + args.num_iters
    bar = tqdm(total=total, desc="latency (warm-up first)", unit="batch", disable=args.no_progress)
    for i in range(args.num_iters_warmup):
        time_batch(llm, _requests(llm, args, args.batch_size, seed + 10_000 + i), args.temperature)
        bar.update(1)
    timings = []
    for i in range(args.num_iters):
        reqs = _requests(llm, args, args.batch_size, seed + i)
        timings.append(time_batch(llm, reqs, args.temperature))
        bar.update(1)
    bar.close()
    ttft = statistics.median(t.ttft_s for t in timings)
    tpot = statistics.median(t.tpot_s for t in timings)
    e2e = statistics.median(t.e2e_s for t in timings)
    weight_bytes = streamed_weight_bytes(llm)
    floor_s = weight_bytes / (args.peak_bandwidth_gbs * 1e9)
    values = {
        "ttft_ms": ttft * 1e3,
        "tpot_ms": tpot * 1e3,
        "decode_tok_s": 1.0 / tpot,
        "output_tok_s": args.batch_size / tpot,
        "e2e_ms": e2e * 1e3,
        "bandwidth_floor_pct": floor_s / tpot * 100.0,
    }
    print(
        f"batch {args.batch_size}, {args.input_len} in / {args.output_len} out, median of "
        f"{args.num_iters} iteration(s):"
    )
    print(
        f"  TTFT {values['ttft_ms']:.2f} ms   time per output token {values['tpot_ms']:.3f} ms"
        f"   {values['decode_tok_s']:.1f} tok/s per sequence, {values['output_tok_s']:.1f} "
        "tok/s in all"
    )
    print(
        f"  bandwidth floor {floor_s * 1e3:.3f} ms/step ({weight_bytes / 1e9:.3f} GB at "
        f"{args.peak_bandwidth_gbs:g} GB/s): {values['bandwidth_floor_pct']:.1f} % of it"
    )
    common = {
        **_common(llm, args, args.workload or "W1"),
        "batch_size": args.batch_size,
        "num_iters": args.num_iters,
        "weight_bytes": weight_bytes,
        "peak_bandwidth_gbs": args.peak_bandwidth_gbs,
    }
    floor = {"decode_tok_s": 1.0 / floor_s, "tpot_ms": floor_s * 1e3}  # the floor, same unit
    rows = [
        make_record(k, v, common, **({"floor": round(floor[k], 4)} if k in floor else {}))
        for k, v in values.items()
    ]
    _finish(rows, args)
    return 0
