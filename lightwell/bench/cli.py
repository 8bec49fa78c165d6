"""`lightwell bench serve | throughput | latency`: argument parsing; the work is elsewhere."""

from __future__ import annotations

import argparse
from typing import Any

from lightwell.bench.client import CHAT_ENDPOINT, COMPLETIONS_ENDPOINT
from lightwell.cli_args import DefaultsHelpFormatter

H200_PEAK_TFLOPS = 788.0  # bf16 matmul 8192^3, measured (PERFORMANCE.md)
H200_PEAK_BANDWIDTH_GBS = 4221.0  # device-to-device copy, measured (PERFORMANCE.md)


def register(commands: dict[str, tuple[str, Any]]) -> None:
    """Add `bench` to the `lightwell` CLI (called by ``lightwell.cli``)."""
    commands["bench"] = ("Benchmarks: serve (load generator), throughput, latency.", add_bench)


def add_bench(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench_command", metavar="BENCHMARK", required=True)
    fmt = DefaultsHelpFormatter
    serve = sub.add_parser(
        "serve", formatter_class=fmt, help="Load-test an OpenAI-compatible server (W3)."
    )
    add_serve_args(serve)
    tput = sub.add_parser(
        "throughput", formatter_class=fmt, help="Offline throughput over the Python API (W2)."
    )
    add_throughput_args(tput)
    lat = sub.add_parser(
        "latency",
        formatter_class=fmt,
        help="Offline latency of one batch over the Python API (W1).",
    )
    add_latency_args(lat)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--result-json", default=None, help="Write results here (PERFORMANCE.md).")
    p.add_argument("--workload", default=None, help="Workload name in the results (W1 ...).")
    p.add_argument(
        "--metadata",
        nargs="*",
        action="extend",
        default=None,
        metavar="KEY=VALUE",
        help="Extra fields for every result record, e.g. dtype=bfloat16 mode=nvlink "
        "(repeatable; later values win).",
    )
    p.add_argument("--no-progress", action="store_true", help="No progress bar.")
    p.add_argument(
        "--log-level",
        default="WARNING",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="Logging level.",
    )


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="The server's URL.")
    p.add_argument(
        "--endpoint",
        default=COMPLETIONS_ENDPOINT,
        choices=[COMPLETIONS_ENDPOINT, CHAT_ENDPOINT],
        help="API route to load.",
    )
    p.add_argument(
        "--model",
        default=None,
        help="Model name in requests (default: the first "
        "model the server lists). A local path also picks the tokenizer.",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="Tokenizer folder or .gguf for building "
        "prompts and counting tokens (default: the model's if a path, else SmolLM2).",
    )
    p.add_argument("--api-key", default=None, help="Sent as 'Authorization: Bearer KEY'.")
    d = p.add_argument_group("dataset")
    d.add_argument("--dataset", default="random", choices=["random", "jsonl"])
    d.add_argument(
        "--dataset-path",
        default=None,
        help='JSONL: {"prompt": ..., "output_len"?: '
        "...} per line (output_len defaults to --output-len).",
    )
    d.add_argument(
        "--input-len", type=int, default=1024, help="Random prompt tokens after the shared prefix."
    )
    d.add_argument("--output-len", type=int, default=256, help="Output tokens per request.")
    d.add_argument(
        "--range-ratio",
        type=float,
        default=0.0,
        help="Lengths drawn uniformly in [len * (1 - r), len * (1 + r)].",
    )
    d.add_argument("--prefix-len", type=int, default=0, help="Shared prefix tokens per prompt.")
    d.add_argument(
        "--token-ids",
        action="store_true",
        help="Send prompts as token ids (completions only; exact lengths without re-tokenizing).",
    )
    d.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="With --token-ids: draw ids below this and load no tokenizer (servers started "
        "with --skip-tokenizer-init, e.g. dummy weights on a machine without the model).",
    )
    d.add_argument("--num-prompts", type=int, default=500, help="Requests per request rate.")
    d.add_argument("--seed", type=int, default=0, help="Seed of prompts and arrival times.")
    t = p.add_argument_group("traffic")
    t.add_argument(
        "--request-rate",
        default="inf",
        help="Requests/s; comma-separated for one run per rate; inf = all at once.",
    )
    t.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="Gamma shape of inter-arrival times: 1 = Poisson, < 1 burstier, > 1 more regular.",
    )
    t.add_argument("--max-concurrency", type=int, default=None, help="Most requests in flight.")
    t.add_argument("--num-warmups", type=int, default=1, help="Untimed test requests first.")
    r = p.add_argument_group("requests and report")
    r.add_argument(
        "--ignore-eos",
        action="store_true",
        help="Send ignore_eos: true so every "
        "request generates exactly its output length (vLLM/Lightwell extension).",
    )
    r.add_argument("--temperature", type=float, default=0.0, help="Sampling temperature.")
    r.add_argument("--extra-body", default=None, help="JSON object merged into every request.")
    r.add_argument(
        "--goodput",
        default=None,
        help="SLOs in ms, e.g. 'ttft:500,tpot:50' "
        "(keys ttft, tpot, e2el): goodput counts requests meeting all of them.",
    )
    r.add_argument("--percentiles", default="50,95,99", help="Latency percentiles to report.")
    r.add_argument(
        "--plot",
        default=None,
        help="Write a PNG of the latency distributions (and latency vs rate with several rates).",
    )
    _common(p)
    p.set_defaults(handler=_run_serve)


def _add_offline(p: argparse.ArgumentParser, input_len: int, output_len: int) -> None:
    from lightwell.cli_args import add_engine_args

    b = p.add_argument_group("benchmark")
    b.add_argument("--input-len", type=int, default=input_len, help="Prompt tokens per request.")
    b.add_argument(
        "--output-len", type=int, default=output_len, help="Output tokens (EOS ignored)."
    )
    b.add_argument("--temperature", type=float, default=1.0, help="Sampling temperature.")
    _common(p)
    add_engine_args(p)


def add_throughput_args(p: argparse.ArgumentParser) -> None:
    _add_offline(p, 1024, 256)
    p.add_argument("--num-prompts", type=int, default=1000, help="Requests, all submitted at once.")
    p.add_argument(
        "--range-ratio",
        type=float,
        default=0.0,
        help="Lengths drawn uniformly in [len * (1 - r), len * (1 + r)].",
    )
    p.add_argument("--num-warmups", type=int, default=2, help="Untimed short requests first.")
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=H200_PEAK_TFLOPS,
        help="Peak FLOP/s for MFU, in TFLOP/s (default: H200 bf16, measured).",
    )
    p.set_defaults(handler=_run_throughput)


def add_latency_args(p: argparse.ArgumentParser) -> None:
    _add_offline(p, 128, 256)
    p.add_argument("--batch-size", type=int, default=1, help="Requests in the batch.")
    p.add_argument("--num-iters-warmup", type=int, default=1, help="Untimed batches first.")
    p.add_argument("--num-iters", type=int, default=3, help="Timed batches (median reported).")
    p.add_argument(
        "--peak-bandwidth-gbs",
        type=float,
        default=H200_PEAK_BANDWIDTH_GBS,
        help="Memory bandwidth for the floor, GB/s (default: H200 copy, measured).",
    )
    p.set_defaults(handler=_run_latency)


def _check_positive(args: argparse.Namespace, *names: str) -> None:
    for name in names:
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1 (got {value})")


def _run_serve(args: argparse.Namespace) -> int:
    from lightwell.bench.serve import cmd_bench_serve

    _check_positive(args, "input_len", "output_len", "num_prompts", "max_concurrency")
    if args.token_ids and args.endpoint == CHAT_ENDPOINT:
        raise ValueError("--token-ids works with /v1/completions only (chat takes text)")
    if args.vocab_size and not args.token_ids:
        raise ValueError("--vocab-size needs --token-ids (prompts are then random ids)")
    args.workload = args.workload or "W3"
    return cmd_bench_serve(args)


def _run_throughput(args: argparse.Namespace) -> int:
    from lightwell.bench.offline import cmd_throughput

    _check_positive(args, "input_len", "output_len", "num_prompts")
    return cmd_throughput(args)


def _run_latency(args: argparse.Namespace) -> int:
    from lightwell.bench.offline import cmd_latency

    _check_positive(args, "input_len", "output_len", "batch_size", "num_iters")
    return cmd_latency(args)
