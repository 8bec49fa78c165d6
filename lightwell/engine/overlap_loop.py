"""The overlapped step loop (``--async-scheduling``): step N+1 is scheduled and launched before
step N's tokens come back, so the host's per-step work (scheduling, input preparation, kernel
launches, output processing) runs while the device computes.

    call k:  schedule N+1 -> launch N+1 -> wait for N's tokens -> update N -> outputs of N

Pipeline parallelism uses the same loop with ``depth`` = the batches in flight (the number
of stages by default) and the plain scheduler (no placeholders): a request whose next token is
still in flight has nothing to schedule and waits, so each batch in flight holds other
requests (or a prompt's next chunk), and the stages work on different batches at once.

Under async scheduling, at most two steps are in flight. The scheduler counts a token being
sampled as a placeholder (``Request.num_output_placeholders``) and the worker feeds it to step
N+1 from the device, so greedy and per-request-seeded tokens are those of the plain loop in
``LLMEngine.step`` (unseeded rows draw from one shared random stream, which depends on the
batch in either loop); a request that stops on EOS or a stop string computes one extra token,
which ``Scheduler.update`` drops (the request is gone by then, even if its id is reused).
While a structured-output request is alive the loop runs one step at a time: each step is
scheduled after the previous one's tokens are applied, since a grammar's token mask depends on
the token before. The control plane stays torch-free: a launched step is an opaque handle with
``result()``.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

from lightwell.scheduler.output import SchedulerOutput
from lightwell.types import RequestOutput

if TYPE_CHECKING:
    from lightwell.engine.llm_engine import LLMEngine


class OverlapLoop:
    def __init__(self, engine: LLMEngine, depth: int = 2) -> None:
        self.engine = engine
        self.depth = depth
        self.in_flight: deque[tuple[SchedulerOutput, Any]] = deque()

    def has_work(self) -> bool:
        return bool(self.in_flight)

    def step(self) -> list[RequestOutput]:
        e = self.engine
        if self.in_flight and e.structured.active:
            # A grammar's mask needs the previous token: no step is scheduled past one in flight.
            done, handle = self.in_flight.popleft()
            return e.finish_step(done, handle.result())
        sched = e.schedule()
        launched = bool(sched.total_num_scheduled_tokens)
        if launched or sched.finished_req_ids:
            self.in_flight.append((sched, e.executor.execute_model_async(sched)))
        # Keep depth - 1 steps queued behind the one we wait for, unless nothing new could be
        # launched.
        if not self.in_flight or (launched and len(self.in_flight) < self.depth):
            return []
        done, handle = self.in_flight.popleft()
        return e.finish_step(done, handle.result())
