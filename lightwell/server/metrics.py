"""Prometheus metrics (prefix ``lightwell:``, label ``model_name``) with vLLM's meanings, a log
line per finished request, and periodic stats logging.

Engine-state values (running / waiting requests, KV-cache usage, prefix-cache counters) are read
from the engine's last published stats at scrape time; per-request counters and histograms are
updated by ``observe_finished``, which the engine thread calls once per finished request.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from lightwell.engine.llm_engine import EngineStats
from lightwell.server.observability import ERROR_REASONS, TIMEOUT_REASONS
from lightwell.types import RequestOutput

logger = logging.getLogger("lightwell.server")

P = "lightwell:"
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)

STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class _MemoryCollector(Collector):
    """Host memory (/proc/meminfo) and, where the engine runs on CUDA, this process's GPUs'
    used and total memory (families without samples elsewhere, so the names always exist)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        info = _meminfo()
        for name, key, doc in (
            ("host_memory_total_bytes", "MemTotal", "Host memory in all."),
            ("host_memory_available_bytes", "MemAvailable", "Host memory available."),
        ):
            metric = GaugeMetricFamily(P + name, doc, labels=["model_name"])
            if key in info:
                metric.add_metric([self.model_name], float(info[key]))
            yield metric
        used = GaugeMetricFamily(
            P + "gpu_memory_used_bytes", "GPU memory in use (all processes).", labels=LB_GPU
        )
        total = GaugeMetricFamily(P + "gpu_memory_total_bytes", "GPU memory.", labels=LB_GPU)
        for device, (free, size) in _gpu_memory().items():
            used.add_metric([self.model_name, device], float(size - free))
            total.add_metric([self.model_name, device], float(size))
        yield used
        yield total


LB_GPU = ["model_name", "device"]


def _meminfo() -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    out[key] = int(parts[0]) * (1024 if parts[-1] == "kB" else 1)
    except OSError:
        pass
    return out


def _gpu_memory() -> dict[str, tuple[int, int]]:
    """device -> (free, total) bytes of this process's current GPU (none on CPU)."""
    torch = sys.modules.get("torch")  # imported by the worker; never imported here
    if torch is None or not torch.cuda.is_initialized():
        return {}
    device = torch.cuda.current_device()
    return {f"cuda:{device}": torch.cuda.mem_get_info(device)}


class _EngineCollector(Collector):
    """Gauges and engine-owned counters, read from the last stats snapshot at scrape time."""

    def __init__(self, model_name: str, stats: Callable[[], EngineStats]) -> None:
        self.model_name = model_name
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        labels = [self.model_name]
        for name, doc, value, family in (
            (
                "num_requests_running",
                "Requests in the running batch.",
                s.num_running,
                GaugeMetricFamily,
            ),
            (
                "num_requests_waiting",
                "Requests waiting to be scheduled.",
                s.num_waiting,
                GaugeMetricFamily,
            ),
            (
                "kv_cache_usage_perc",
                "Fraction of KV-cache blocks in use (1 = full).",
                s.kv_cache_usage,
                GaugeMetricFamily,
            ),
            (
                "prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache.",
                s.prefix_cache_queries,
                CounterMetricFamily,
            ),
            (
                "prefix_cache_hits",
                "Prompt tokens found in the prefix cache.",
                s.prefix_cache_hits,
                CounterMetricFamily,
            ),
            (
                "num_preemptions",
                "Requests preempted to free KV-cache blocks.",
                s.num_preemptions,
                CounterMetricFamily,
            ),
            (
                "grammar_compiles",
                "Structured-output grammars compiled (cache misses).",
                s.grammar_compiles,
                CounterMetricFamily,
            ),
            (
                "grammar_compile_seconds",
                "Seconds spent compiling structured-output grammars.",
                s.grammar_compile_seconds,
                CounterMetricFamily,
            ),
            (
                "grammar_cache_queries",
                "Structured-output grammar lookups (one per constrained sequence, plus one "
                "per request at validation).",
                s.grammar_cache_queries,
                CounterMetricFamily,
            ),
            (
                "grammar_cache_hits",
                "Structured-output grammar lookups served by the compiled-grammar cache.",
                s.grammar_cache_hits,
                CounterMetricFamily,
            ),
        ):
            metric = family(P + name, doc, labels=["model_name"])
            metric.add_metric(labels, float(value))
            yield metric


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        r, lb = self.registry, ["model_name"]
        self.prompt_tokens = Counter(
            P + "prompt_tokens", "Prefill tokens processed.", lb, registry=r
        ).labels(model_name)
        self.generation_tokens = Counter(
            P + "generation_tokens", "Generated tokens.", lb, registry=r
        ).labels(model_name)
        self.request_success = Counter(
            P + "request_success",
            "Finished sequences by reason.",
            lb + ["finished_reason"],
            registry=r,
        )
        self.ttft = self._hist("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = self._hist("inter_token_latency_seconds", "Time between tokens.", ITL_BUCKETS)
        self.e2e = self._hist("e2e_request_latency_seconds", "Arrival to finish.", REQUEST_BUCKETS)
        self.queue = self._hist(
            "request_queue_time_seconds", "Arrival to first scheduled.", REQUEST_BUCKETS
        )
        self.request_errors = Counter(
            P + "request_errors", "Error responses by reason.", lb + ["reason"], registry=r
        )
        self.request_timeouts = Counter(
            P + "request_timeouts",
            "Requests given up before they finished, by reason (client_disconnect: the client "
            "closed the connection, e.g. on its own timeout).",
            lb + ["reason"],
            registry=r,
        )
        for reason in ERROR_REASONS.values():
            self.request_errors.labels(model_name, reason)
        for reason in TIMEOUT_REASONS:
            self.request_timeouts.labels(model_name, reason)
        self.step_time = self._hist("engine_step_seconds", "One engine step.", STEP_BUCKETS)
        ProcessCollector(registry=r)
        r.register(_MemoryCollector(model_name))
        self._lock = threading.Lock()
        self._totals = [0, 0]  # prompt, generation tokens (for the stats log)
        self._stats: Callable[[], EngineStats] | None = None

    def _hist(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(
            P + name, doc, ["model_name"], buckets=buckets, registry=self.registry
        ).labels(self.model_name)

    def attach(self, stats: Callable[[], EngineStats]) -> None:
        """Start exporting the engine's own state (read through ``stats`` at scrape time)."""
        self._stats = stats
        self.registry.register(_EngineCollector(self.model_name, stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def observe_finished(self, out: RequestOutput) -> None:
        """Account one finished (or aborted) request; runs on the engine thread."""
        # prompt tokens count once scheduled: one aborted while waiting was never prefilled
        scheduled = out.metrics is None or out.metrics.first_scheduled_time is not None
        num_prompt = len(out.prompt_token_ids) if scheduled else 0
        num_gen = sum(len(c.token_ids) for c in out.outputs)
        self.prompt_tokens.inc(num_prompt)
        self.generation_tokens.inc(num_gen)
        with self._lock:
            self._totals[0] += num_prompt
            self._totals[1] += num_gen
        for c in out.outputs:
            self.request_success.labels(self.model_name, str(c.finish_reason)).inc()
        m = out.metrics
        if m is None:
            return
        ttft = m.first_token_time - m.arrival_time if m.first_token_time else None
        if ttft is not None:
            self.ttft.observe(ttft)
        for a, b in itertools.pairwise(m.token_times):  # in order; n > 1 siblings share times
            if b > a:
                self.itl.observe(b - a)
        e2e = (m.finished_time or time.time()) - m.arrival_time
        self.e2e.observe(e2e)
        if m.first_scheduled_time is not None:
            self.queue.observe(max(0.0, m.first_scheduled_time - m.arrival_time))
        logger.info(
            "finished %s: prompt %d tokens (cached %d), output %d tokens, %s, TTFT %s, e2e %.3fs",
            out.request_id,
            num_prompt,
            out.num_cached_tokens,
            num_gen,
            ",".join(str(c.finish_reason) for c in out.outputs),
            "-" if ttft is None else f"{ttft:.3f}s",
            e2e,
            extra={"request_id": out.request_id},
        )

    def observe_error(self, reason: str) -> None:
        self.request_errors.labels(self.model_name, reason).inc()

    def observe_timeout(self, reason: str) -> None:
        self.request_timeouts.labels(self.model_name, reason).inc()

    def observe_step(self, seconds: float) -> None:
        """One engine step's duration; runs on the engine thread."""
        self.step_time.observe(seconds)

    def totals(self) -> tuple[int, int]:
        with self._lock:
            return self._totals[0], self._totals[1]

    async def log_periodically(self, interval: float) -> None:
        """Log throughput and engine state every ``interval`` s while there is activity."""
        last_t, last = time.monotonic(), self.totals()
        while True:
            await asyncio.sleep(interval)
            now, totals = time.monotonic(), self.totals()
            s = self._stats() if self._stats else None
            busy = s is not None and (s.num_running or s.num_waiting)
            if totals != last or busy:
                dt = now - last_t
                hit = (
                    s.prefix_cache_hits / s.prefix_cache_queries
                    if s and s.prefix_cache_queries
                    else 0
                )
                logger.info(
                    "prompt throughput %.1f tok/s, generation throughput %.1f tok/s, running %d, "
                    "waiting %d, KV cache usage %.1f%%, prefix cache hit rate %.1f%%",
                    (totals[0] - last[0]) / dt,
                    (totals[1] - last[1]) / dt,
                    s.num_running if s else 0,
                    s.num_waiting if s else 0,
                    100 * (s.kv_cache_usage if s else 0.0),
                    100 * hit,
                )
            last_t, last = now, totals
