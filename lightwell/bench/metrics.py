"""Serving metrics with the definitions of vLLM's `bench serve`, computed from per-request timings.

- TTFT: time from sending the request to the first streamed chunk that carries a choice.
- TPOT: per request, ``(e2e - ttft) / (output_tokens - 1)``; requests of one output token are left
  out of the TPOT distribution (and count as TPOT 0 for goodput).
- ITL: every gap between consecutive chunks of a request, pooled over all requests.
- E2E: time from sending the request to its last chunk.
- Output tokens: the server's ``usage.completion_tokens`` when streamed, else the generated text
  re-tokenized. Input tokens: the dataset's prompt lengths.
- Throughputs divide by the benchmark's wall time; goodput counts the requests that meet every
  given SLO (``value <= limit`` for each of ttft / tpot / e2el, in ms).
- Percentiles are numpy's (linear interpolation); std is the population std (ddof=0).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

GOODPUT_KEYS = ("ttft", "tpot", "e2el")
DEFAULT_PERCENTILES = (50.0, 95.0, 99.0)


@dataclass
class RequestResult:
    """What the client measured for one request (times in seconds, perf_counter clock)."""

    prompt_len: int
    success: bool = False
    output_tokens: int | None = None  # from the server's usage, when it sent one
    generated_text: str = ""
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0  # E2E
    start_time: float = 0.0  # when it was sent, relative to the benchmark's start
    error: str = ""


@dataclass
class Distribution:
    """mean / median / std / percentiles of one latency, in milliseconds."""

    mean: float
    median: float
    std: float
    percentiles: dict[float, float]

    @classmethod
    def of(cls, seconds: Sequence[float], percentiles: Sequence[float]) -> Distribution:
        """Statistics of ``seconds`` in ms; an empty list gives all zeros (as vLLM reports)."""
        a = np.asarray(seconds if len(seconds) else [0.0], dtype=np.float64) * 1000.0
        pct = {float(p): float(np.percentile(a, p)) for p in percentiles}
        return cls(float(a.mean()), float(np.median(a)), float(a.std()), pct)


@dataclass
class BenchmarkMetrics:
    completed: int
    failed: int
    duration_s: float
    total_input: int
    total_output: int
    request_throughput: float  # completed requests / s
    request_goodput: float | None  # requests meeting every SLO / s (None: no SLO given)
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # (input + output) tokens / s
    max_concurrency: int  # most requests in flight at once, as observed
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2el: Distribution
    output_lens: list[int] = field(default_factory=list)  # per request, 0 for failures
    raw: dict[str, list[float]] = field(default_factory=dict)  # per-request seconds, for plots


def parse_goodput(spec: str | None) -> dict[str, float]:
    """``"ttft:500,tpot:50"`` (or space-separated) -> {"ttft": 500.0, "tpot": 50.0}, in ms."""
    if not spec:
        return {}
    slos: dict[str, float] = {}
    for item in spec.replace(",", " ").split():
        key, sep, value = item.partition(":")
        if not sep or key not in GOODPUT_KEYS:
            raise ValueError(
                f"bad --goodput item {item!r}: expected KEY:MS with KEY one of "
                f"{', '.join(GOODPUT_KEYS)}"
            )
        try:
            slos[key] = float(value)
        except ValueError:
            raise ValueError(f"bad --goodput value in {item!r}: not a number") from None
        if slos[key] < 0:
            raise ValueError(f"bad --goodput value in {item!r}: must be >= 0")
    return slos


def output_len_of(r: RequestResult, count_tokens: Callable[[str], int] | None) -> int:
    """Output tokens of a successful request: the server's count, else the re-tokenized text."""
    if r.output_tokens:
        return r.output_tokens
    if count_tokens is None:
        raise ValueError("the server sent no usage and no tokenizer was given to count tokens")
    return count_tokens(r.generated_text)


def compute_metrics(
    results: Sequence[RequestResult],
    duration_s: float,
    *,
    count_tokens: Callable[[str], int] | None = None,
    goodput: dict[str, float] | None = None,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
) -> BenchmarkMetrics:
    """All serving metrics of one run (``duration_s``: the benchmark's wall time)."""
    if duration_s <= 0:
        raise ValueError("duration_s must be > 0")
    ttfts, tpots, all_tpots, itls, e2els, out_lens = [], [], [], [], [], []
    total_input = 0
    for r in results:
        if not r.success:
            out_lens.append(0)
            continue
        n = output_len_of(r, count_tokens)
        out_lens.append(n)
        total_input += r.prompt_len
        tpot = (r.latency - r.ttft) / (n - 1) if n > 1 else 0.0
        if n > 1:
            tpots.append(tpot)
        all_tpots.append(tpot)
        ttfts.append(r.ttft)
        itls.extend(r.itl)
        e2els.append(r.latency)
    completed = len(ttfts)
    total_output = sum(out_lens)
    good = count_good(goodput, {"ttft": ttfts, "tpot": all_tpots, "e2el": e2els})
    return BenchmarkMetrics(
        completed=completed,
        failed=len(results) - completed,
        duration_s=duration_s,
        total_input=total_input,
        total_output=total_output,
        request_throughput=completed / duration_s,
        request_goodput=None if good is None else good / duration_s,
        output_throughput=total_output / duration_s,
        total_token_throughput=(total_input + total_output) / duration_s,
        max_concurrency=max_in_flight(results),
        ttft=Distribution.of(ttfts, percentiles),
        tpot=Distribution.of(tpots, percentiles),
        itl=Distribution.of(itls, percentiles),
        e2el=Distribution.of(e2els, percentiles),
        output_lens=out_lens,
        raw={"ttft": ttfts, "tpot": tpots, "itl": itls, "e2el": e2els},
    )


def count_good(slos: dict[str, float] | None, per_request: dict[str, list[float]]) -> int | None:
    """Requests whose every SLO'd metric is <= its limit (limits in ms, metrics in s)."""
    if not slos:
        return None
    columns = [(per_request[k], limit / 1000.0) for k, limit in slos.items()]
    n = len(per_request["ttft"])
    return sum(all(col[i] <= limit for col, limit in columns) for i in range(n))


def max_in_flight(results: Sequence[RequestResult]) -> int:
    """Most requests in flight at one time (successful and failed alike)."""
    events = []
    for r in results:
        events.append((r.start_time, 1))
        events.append((r.start_time + max(r.latency, 0.0), -1))
    events.sort(key=lambda e: (e[0], e[1]))  # an end before a start at the same instant
    cur = best = 0
    for _, d in events:
        cur += d
        best = max(best, cur)
    return best
