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
A grammar's token mask for step N+1 depends on step N's token, which is still on the device
when N+1 is launched. A step with constrained rows that sample is therefore launched with its
sampling held back (``grammar_later``): the device runs N+1's forward while the host waits for
N's tokens, applies them (the matchers accept them) and fills N+1's mask; the sampler then
takes the mask (a host -> device copy it waits on) and samples. So the mask fill overlaps the
forward, and the tokens are those of filling the mask before the launch. What does not overlap
in such a call: the detokenization of N's outputs and the scheduling of N+2 run after N+1's
sampling is queued, while the device only samples. Executors whose sampling happens in another
process (pipeline stages: ``defers_sampling`` false) run one step at a time instead while a
structured-output request is alive. The control plane stays torch-free: a launched step is an
opaque handle with ``result()`` (and ``sample(grammar)`` when its sampling was held back).
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
        if e.structured.active and not e.executor.defers_sampling:
            if self.in_flight:  # the mask needs the previous token: one step at a time
                done, handle = self.in_flight.popleft()
                return e.finish_step(done, handle.result())
        sched = e.schedule(grammar_later=e.executor.defers_sampling)
        launched = bool(sched.total_num_scheduled_tokens)
        if launched or sched.finished_req_ids:
            handle = e.executor.execute_model_async(sched)
            if sched.grammar_later:
                return self._sample_constrained(sched, handle)
            self.in_flight.append((sched, handle))
        # Keep depth - 1 steps queued behind the one we wait for, unless nothing new could be
        # launched.
        if not self.in_flight or (launched and len(self.in_flight) < self.depth):
            return []
        done, handle = self.in_flight.popleft()
        return e.finish_step(done, handle.result())

    def _sample_constrained(self, sched: SchedulerOutput, handle: Any) -> list[RequestOutput]:
        """``sched``'s forward is launched: apply the step before it (its tokens arrive while
        the forward runs), fill ``sched``'s mask, let it sample; then the outputs of the step
        before. Every step left in flight has sampled."""
        e = self.engine
        applied = []
        while self.in_flight:
            done, before = self.in_flight.popleft()
            applied += e.apply_step(done, before.result())
        handle.sample(e.structured.bitmask(sched, e.scheduler.requests))
        self.in_flight.append((sched, handle))
        return e.emit(applied)
