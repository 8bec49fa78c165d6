"""Text tables and PERFORMANCE.md result records for `bench serve`."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from collections.abc import Sequence
from typing import Any

from lightwell.bench.metrics import BenchmarkMetrics, Distribution, RequestResult
from lightwell.bench.results import make_record, parse_metadata, provenance

LATENCIES = (
    ("ttft", "Time to first token"),
    ("tpot", "Time per output token (excl. 1st)"),
    ("itl", "Inter-token latency"),
    ("e2el", "End-to-end latency"),
)
# Metric-name stems in result files (PERFORMANCE.md): e2el is written e2e.
STEMS = {"ttft": "ttft", "tpot": "tpot", "itl": "itl", "e2el": "e2e"}


def parse_percentiles(spec: str) -> list[float]:
    try:
        values = [float(p) for p in spec.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"bad --percentiles {spec!r}: comma-separated numbers") from None
    if not values or not all(0 <= p <= 100 for p in values):
        raise ValueError(f"--percentiles must be numbers in [0, 100] (got {spec!r})")
    return values


def parse_json_object(text: str | None, flag: str) -> dict[str, Any]:
    if not text:
        return {}
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag} must be a JSON object: {e}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{flag} must be a JSON object")
    return obj


def pct_label(p: float) -> str:
    return f"p{p:g}"


def rate_label(rate: float) -> str:
    return "inf" if rate == float("inf") else f"{rate:g}"


def format_run(rate: float, args: argparse.Namespace, m: BenchmarkMetrics) -> str:
    rows = [
        ("Request rate (req/s)", rate_label(rate)),
        ("Burstiness", f"{args.burstiness:g}"),
        (
            "Max concurrency (limit / observed)",
            f"{args.max_concurrency or '-'} / {m.max_concurrency}",
        ),
        ("Successful requests", m.completed),
        ("Failed requests", m.failed),
        ("Benchmark duration (s)", f"{m.duration_s:.2f}"),
        ("Total input tokens", m.total_input),
        ("Total generated tokens", m.total_output),
        ("Request throughput (req/s)", f"{m.request_throughput:.2f}"),
    ]
    if m.request_goodput is not None:
        rows.append(("Request goodput (req/s)", f"{m.request_goodput:.2f}"))
    rows += [
        ("Output token throughput (tok/s)", f"{m.output_throughput:.2f}"),
        ("Total token throughput (tok/s)", f"{m.total_token_throughput:.2f}"),
    ]
    lines = ["{:=^60}".format(" Serving Benchmark Result ")]
    lines += [f"{k:<44}{v:>16}" for k, v in rows]
    for key, title in LATENCIES:
        d: Distribution = getattr(m, key)
        lines.append("{:-^60}".format(f" {title} "))
        lines.append(f"{'Mean ' + key.upper() + ' (ms)':<44}{d.mean:>16.2f}")
        lines.append(f"{'Median ' + key.upper() + ' (ms)':<44}{d.median:>16.2f}")
        lines.append(f"{'Std ' + key.upper() + ' (ms)':<44}{d.std:>16.2f}")
        for p, v in d.percentiles.items():
            lines.append(f"{pct_label(p).upper() + ' ' + key.upper() + ' (ms)':<44}{v:>16.2f}")
    lines.append("=" * 60)
    return "\n".join(lines)


def format_summary(runs: Sequence[Any]) -> str:
    """One line per rate: throughput and median / P99 latencies (ms)."""
    head = (
        f"{'rate':>6} {'req/s':>7} {'out tok/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'TPOT p50':>9} {'TPOT p99':>9} {'ITL p50':>8} {'ITL p99':>8} {'E2E p50':>9} "
        f"{'E2E p99':>9}"
    )
    lines = [head]
    for run in runs:
        m = run.metrics
        cells = [
            f"{rate_label(run.request_rate):>6}",
            f"{m.request_throughput:7.2f}",
            f"{m.output_throughput:9.1f}",
        ]
        for key, width in (("ttft", 9), ("tpot", 9), ("itl", 8), ("e2el", 9)):
            d = getattr(m, key)
            cells.append(f"{d.median:{width}.1f}")
            cells.append(f"{d.percentiles.get(99.0, float('nan')):{width}.1f}")
        lines.append(" ".join(cells))
    return "\n".join(lines)


def print_errors(results: Sequence[RequestResult], limit: int = 3) -> None:
    errors = Counter(r.error for r in results if not r.success)
    for err, n in errors.most_common(limit):
        print(f"  {n} request(s) failed: {err}")


def _run_fields(args: argparse.Namespace, run: Any) -> dict[str, Any]:
    m = run.metrics
    return {
        "request_rate": rate_label(run.request_rate),
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "max_in_flight": m.max_concurrency,
        "num_prompts": args.num_prompts,
        "completed": m.completed,
        "failed": m.failed,
        "duration_s": round(m.duration_s, 3),
    }


def serve_records(args: argparse.Namespace, runs: Sequence[Any]) -> list[dict]:
    """One record per metric per rate, in PERFORMANCE.md's format."""
    common = {
        "workload": args.workload,
        "model": args.served_model,
        "dtype": None,
        "tp": 1,
        **provenance(),
        "endpoint": args.endpoint,
        "dataset": args.dataset,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "range_ratio": args.range_ratio,
        "prefix_len": args.prefix_len,
        "ignore_eos": args.ignore_eos,
        "goodput_slo_ms": args.goodput,
        "seed": args.seed,
    }
    common.update(parse_metadata(args.metadata))
    rows = []
    for run in runs:
        base = {**common, **_run_fields(args, run)}
        rows.extend(make_record(k, v, base) for k, v in run_values(run.metrics).items())
    return rows


def run_values(m: BenchmarkMetrics) -> dict[str, float]:
    """metric name -> value for one run (latencies in ms, throughputs per second)."""
    out: dict[str, float] = {
        "request_s": m.request_throughput,
        "output_tok_s": m.output_throughput,
        "total_tok_s": m.total_token_throughput,
    }
    if m.request_goodput is not None:
        out["goodput_request_s"] = m.request_goodput
    for key, _ in LATENCIES:
        d: Distribution = getattr(m, key)
        stem = STEMS[key] + "_ms"
        out[f"{stem}_mean"] = d.mean
        out[f"{stem}_std"] = d.std
        out[f"{stem}_p50"] = d.median
        for p, v in d.percentiles.items():
            out[f"{stem}_{pct_label(p)}"] = v
    return out
