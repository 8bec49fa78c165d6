"""`lightwell bench serve`: an open-loop load generator against an OpenAI-compatible server.

Requests are sent at gamma-distributed intervals (``burstiness`` 1.0 = Poisson) at each
``--request-rate`` in turn (``inf``: all at once), optionally capped at ``--max-concurrency``
requests in flight; every request is streamed and timed per chunk (see ``client.py``).
Each rate gets its own random prompts (seed + run index, same shared prefix), so one rate's
run does not hit the prefix cache that the previous rate's run filled.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import numpy as np
from tqdm.auto import tqdm

from lightwell.bench import datasets, report
from lightwell.bench.client import RequestConfig, ServerUnreachable, fetch_models, send_request
from lightwell.bench.datasets import SampleRequest
from lightwell.bench.metrics import BenchmarkMetrics, RequestResult, compute_metrics

SESSION_TIMEOUT_S = 6 * 3600


@dataclass
class RunResult:
    request_rate: float
    metrics: BenchmarkMetrics
    results: list[RequestResult]


def parse_rates(spec: str) -> list[float]:
    """``"2,8,inf"`` -> [2.0, 8.0, inf]; each rate must be > 0."""
    rates = []
    for item in spec.split(","):
        try:
            r = float(item)
        except ValueError:
            raise ValueError(f"bad --request-rate {item!r}: a number or inf") from None
        if not r > 0:
            raise ValueError(f"--request-rate must be > 0 (got {item!r})")
        rates.append(r)
    return rates


def arrival_offsets(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """Send times (s from the start): first at 0, then gaps ~ Gamma(k=burstiness, mean=1/rate)."""
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0 (got {burstiness})")
    if math.isinf(rate) or n <= 1:
        return np.zeros(n)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


async def run_once(
    cfg: RequestConfig,
    requests: Sequence[SampleRequest],
    offsets: np.ndarray,
    max_concurrency: int | None,
    desc: str = "",
    progress: bool = True,
) -> tuple[list[RequestResult], float]:
    """Send ``requests`` at ``offsets``; returns the results (in input order) and the wall time."""
    limit = max_concurrency or 0  # 0: no connection cap (aiohttp's default 100 would throttle)
    connector = aiohttp.TCPConnector(limit=limit, force_close=False)
    timeout = aiohttp.ClientTimeout(total=SESSION_TIMEOUT_S)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(requests), desc=desc, unit="req", disable=not progress)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        t0 = time.perf_counter()

        async def one(req: SampleRequest, at: float) -> RequestResult:
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if sem is None:
                r = await send_request(session, cfg, req, t0)
            else:
                async with sem:
                    r = await send_request(session, cfg, req, t0)
            bar.update(1)
            return r

        results = await asyncio.gather(*(one(r, float(t)) for r, t in zip(requests, offsets)))
        duration = time.perf_counter() - t0
    bar.close()
    return list(results), duration


class IdsOnly:
    """No tokenizer (--token-ids --vocab-size N): random ids in [0, N), counts from usage."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.all_special_ids: list[int] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise ValueError("no tokenizer (--vocab-size): the server must report usage")

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""


@functools.lru_cache(maxsize=4)
def load_tokenizer(tokenizer: str | None, model: str | None) -> Any:
    """--tokenizer, else --model when it is a local path, else the default model's tokenizer.

    Cached: loading a GGUF tokenizer takes seconds, and a process may run several benchmarks.
    """
    import os

    from lightwell.engine.tokenizer import Tokenizer
    from lightwell.model_files import ModelFiles, resolve_model

    path = tokenizer or (model if model and os.path.exists(os.path.expanduser(model)) else None)
    if path is None:
        return Tokenizer.load(resolve_model(None))
    return Tokenizer.load(ModelFiles("hf", path, os.path.basename(path)), tokenizer_path=path)


def make_requests(args: argparse.Namespace, tok: Any, seed: int, n: int) -> list[SampleRequest]:
    if args.dataset == "jsonl":
        if not args.dataset_path:
            raise ValueError("--dataset jsonl needs --dataset-path FILE")
        return datasets.jsonl_requests(args.dataset_path, tok, n, args.output_len)
    return datasets.random_requests(
        tok,
        n,
        args.input_len,
        args.output_len,
        range_ratio=args.range_ratio,
        prefix_len=args.prefix_len,
        seed=seed,
        as_token_ids=args.token_ids,
        prefix_seed=args.seed,
    )


async def resolve_model_name(args: argparse.Namespace) -> str:
    """Check that the server answers; the model is --model, else the first one it serves."""
    async with aiohttp.ClientSession() as session:
        models = await fetch_models(session, args.base_url, args.api_key)
    if args.model:
        return args.model
    if not models:
        raise ServerUnreachable("the server lists no models: pass --model")
    return models[0]


async def check_server(cfg: RequestConfig, req: SampleRequest) -> None:
    """One test request before timing: fails fast with the server's error message."""
    results, _ = await run_once(cfg, [req], np.zeros(1), None, progress=False)
    if not results[0].success:
        raise ServerUnreachable(f"the test request to {cfg.url} failed: {results[0].error}")


async def bench_serve(args: argparse.Namespace) -> list[RunResult]:
    rates = parse_rates(args.request_rate)
    model = args.served_model = await resolve_model_name(args)
    tok = (
        IdsOnly(args.vocab_size) if args.vocab_size else load_tokenizer(args.tokenizer, args.model)
    )
    cfg = RequestConfig(
        args.base_url,
        args.endpoint,
        model,
        args.api_key,
        args.ignore_eos,
        args.temperature,
        report.parse_json_object(args.extra_body, "--extra-body"),
    )
    if args.num_warmups:
        warm = make_requests(args, tok, args.seed + 10_000, args.num_warmups)
        print(f"checking the server with {len(warm)} warm-up request(s) ...")
        for req in warm:
            await check_server(cfg, req)

    def count_tokens(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False))

    runs = []
    for i, rate in enumerate(rates):
        requests = make_requests(args, tok, args.seed + i, args.num_prompts)
        offsets = arrival_offsets(
            len(requests), rate, args.burstiness, np.random.default_rng(args.seed + i)
        )
        results, duration = await run_once(
            cfg,
            requests,
            offsets,
            args.max_concurrency,
            desc=f"rate {rate:g}",
            progress=not args.no_progress,
        )
        m = compute_metrics(
            results,
            duration,
            count_tokens=count_tokens,
            goodput=args.goodput_slos,
            percentiles=args.percentile_list,
        )
        runs.append(RunResult(rate, m, results))
        print(report.format_run(rate, args, m))
        report.print_errors(results)
    return runs


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from lightwell.bench.metrics import parse_goodput

    args.goodput_slos = parse_goodput(args.goodput)
    args.percentile_list = report.parse_percentiles(args.percentiles)
    try:
        runs = asyncio.run(bench_serve(args))
    except ServerUnreachable as e:
        print(f"lightwell bench serve: error: {e}")
        return 1
    if len(runs) > 1:
        print(report.format_summary(runs))
    if args.result_json:
        from lightwell.bench.results import write_json

        write_json(args.result_json, report.serve_records(args, runs))
    if args.plot:
        from lightwell.bench.plot import plot_serve

        plot_serve(runs, args.plot, title=f"{args.served_model} {args.endpoint}")
        print(f"wrote plot to {args.plot}")
    return 0 if all(r.metrics.completed for r in runs) else 1
