"""``--step-trace FILE``: one JSON line per engine step, for finding where latency goes (which
steps were long, what they held, and whether they replayed a CUDA graph or ran eagerly)."""

from __future__ import annotations

import json
import time
from typing import Any

from lightwell.scheduler.output import ModelRunnerOutput, SchedulerOutput


class StepTrace:
    def __init__(self, path: str) -> None:
        try:
            self.file = open(path, "a", buffering=1)  # noqa: SIM115 - for the engine's life
        except OSError as e:
            raise ValueError(f"step_trace: cannot write {path!r}: {e.strerror}") from e
        self.last = time.perf_counter()

    def record(self, sched: SchedulerOutput, out: ModelRunnerOutput, scheduler: Any) -> None:
        """One line for a step that ran tokens. ``ms``: since the previous step's end (or the
        engine's start), idle time included; ``one_token_rows``: requests that ran a single
        token (decodes, as a rule)."""
        now = time.perf_counter()
        elapsed, self.last = now - self.last, now
        if not sched.total_num_scheduled_tokens:
            return
        counts = sched.num_scheduled_tokens.values()
        row = {
            "time": round(time.time(), 6),
            "step": sched.step_id,
            "tokens": sched.total_num_scheduled_tokens,
            "requests": len(sched.num_scheduled_tokens),
            "one_token_rows": sum(1 for n in counts if n == 1),
            "new_requests": len(sched.new_reqs),
            "running": scheduler.num_running,
            "waiting": scheduler.num_waiting,
            "kv_usage": round(scheduler.kv_cache_usage, 4),
            "ms": round(elapsed * 1e3, 3),
            "path": out.path,
        }
        self.file.write(json.dumps(row) + "\n")

    def close(self) -> None:
        self.file.close()
