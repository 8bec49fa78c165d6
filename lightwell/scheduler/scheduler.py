"""The token-budget scheduler (vLLM v1 style).

One rule per step: with a budget of ``max_num_batched_tokens``, every request gets
``n = min(num_tokens - num_computed_tokens, budget left)`` tokens, running requests first (in
admission order), then waiting ones (first come, first served). Chunked prefill, mixed
prefill + decode batches and resumption after preemption all fall out of it.

``num_computed_tokens`` is advanced inside :meth:`Scheduler.schedule`, as soon as a request is
scheduled, so a second ``schedule()`` before ``update()`` does not schedule the same tokens twice.

Async scheduling (``async_scheduling=True``, the engine's overlapped loop): step N+1 is scheduled
before step N's tokens are known. A step that samples for a request leaves a placeholder
(``num_output_placeholders``) that counts as a token to run next; ``update()`` replaces it with
the real token. A request whose placeholders already reach max_tokens / max_model_len is not
scheduled again; one that stops on EOS or a stop string computes one step too many, whose token
``update()`` drops (the request is gone by then).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from lightwell.kvcache.block_pool import KVBlock
from lightwell.kvcache.manager import KVCacheManager
from lightwell.scheduler.output import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    TokenLogprobs,
)
from lightwell.scheduler.request import Request, RequestStatus
from lightwell.types import FinishReason

# Async scheduling keeps at most 2 steps in flight; older entries belong to steps that were
# dropped without an update() (an interrupted generate, a failed step).
_MAX_STEPS_TRACKED = 4


@dataclass
class _Batch:
    """What one schedule() call has built so far."""

    budget: int
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached_reqs: list[CachedRequestData] = field(default_factory=list)
    preempted: bool = False


class Scheduler:
    def __init__(
        self,
        *,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        num_kv_blocks: int,
        block_size: int,
        max_model_len: int,
        enable_prefix_caching: bool = True,
        enable_chunked_prefill: bool = True,
        async_scheduling: bool = False,
        long_prefill_fraction: float = 1.0,
    ) -> None:
        for name, value in (
            ("max_num_batched_tokens", max_num_batched_tokens),
            ("max_num_seqs", max_num_seqs),
            ("max_model_len", max_model_len),
        ):
            if value <= 0:
                raise ValueError(f"{name} must be > 0 (got {value})")
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.enable_chunked_prefill = enable_chunked_prefill
        self.async_scheduling = async_scheduling
        # while requests wait, running prefills leave this many tokens of a step to them
        self.prefill_reserve = int(max_num_batched_tokens * (1.0 - long_prefill_fraction))
        # Async scheduling: step_id -> the Request objects it scheduled, until its update().
        self._step_requests: dict[int, dict[str, Request]] = {}
        self._num_steps = 0
        self.kv = KVCacheManager(num_kv_blocks, block_size, enable_prefix_caching)
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order; the last one is preempted first
        self._finished_req_ids: set[str] = set()  # since the last SchedulerOutput
        self.num_preemptions = 0

    # ---- requests in and out -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a new request. Raises ValueError if it could never run."""
        if request.req_id in self.requests:
            raise ValueError(f"request id {request.req_id!r} is already in use")
        if request.num_tokens == 0:
            raise ValueError(f"request {request.req_id!r} has an empty prompt")
        if request.num_tokens > self.max_model_len:
            raise ValueError(
                f"request {request.req_id!r} has {request.num_tokens} prompt tokens, more than "
                f"max_model_len={self.max_model_len}"
            )
        self._check_fits_alone(request)
        request.status = RequestStatus.WAITING
        self.requests[request.req_id] = request
        self.waiting.append(request)

    def abort_requests(
        self, req_ids: str | Iterable[str], reason: FinishReason = FinishReason.ABORT
    ) -> None:
        """Finish the given requests in whatever state; unknown or finished ids are ignored."""
        for req_id in [req_ids] if isinstance(req_ids, str) else list(req_ids):
            request = self.requests.get(req_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.finish_reason = reason
            self._finish(request)

    def get_request(self, req_id: str) -> Request | None:
        """The unfinished request with that id, if any."""
        return self.requests.get(req_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix; returns how many blocks were uncached."""
        return self.kv.reset_prefix_cache()

    # ---- schedule --------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        batch = _Batch(budget=self.max_num_batched_tokens)
        self._schedule_running(batch)
        # After a preemption memory is short: admitting new work would only thrash.
        if not batch.preempted:
            self._schedule_waiting(batch)
        output = SchedulerOutput(
            new_reqs=batch.new_reqs,
            cached_reqs=batch.cached_reqs,
            num_scheduled_tokens=batch.num_scheduled_tokens,
            total_num_scheduled_tokens=sum(batch.num_scheduled_tokens.values()),
            finished_req_ids=self._finished_req_ids,
            step_id=self._num_steps,
        )
        self._num_steps += 1
        self._finished_req_ids = set()
        if self.async_scheduling and output.num_scheduled_tokens:
            self._step_requests[output.step_id] = {
                r: self.requests[r] for r in output.num_scheduled_tokens
            }
            while len(self._step_requests) > _MAX_STEPS_TRACKED:  # steps dropped un-updated
                del self._step_requests[next(iter(self._step_requests))]
        return output

    def _schedule_running(self, batch: _Batch) -> None:
        reserve = self._reserve(len(self.waiting), len(self.running))
        i = 0
        while i < len(self.running) and batch.budget > 0:
            request = self.running[i]
            i += 1
            if request.num_output_placeholders and request.reaches_limit_with_placeholders(
                self.max_model_len
            ):
                continue  # the step in flight produces its last token
            n = request.num_tokens + request.num_output_placeholders - request.num_computed_tokens
            prefilling = request.num_computed_tokens < request.num_prompt_tokens
            n = min(n, batch.budget - reserve if prefilling and n > 1 else batch.budget)
            if n <= 0:  # scheduled again before update(): nothing new to run yet
                continue
            new_block_ids = self._allocate_or_preempt(request, n, batch)
            if new_block_ids is None:  # it preempted itself: it was the last running request
                break
            batch.cached_reqs.append(
                CachedRequestData(
                    req_id=request.req_id,
                    new_token_ids=request.pending_token_ids,
                    new_block_ids=new_block_ids,
                    num_computed_tokens=request.num_computed_tokens,
                )
            )
            request.pending_token_ids = []
            self._commit(request, n, batch)

    def _allocate_or_preempt(self, request: Request, n: int, batch: _Batch) -> list[int] | None:
        """Blocks for ``n`` more tokens, preempting from the back of ``running`` until they fit."""
        while True:
            new_block_ids = self.kv.allocate_slots(request, n)
            if new_block_ids is not None:
                return new_block_ids
            victim = self.running.pop()
            self._preempt(victim)
            batch.preempted = True
            if victim is request:
                return None

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.num_output_placeholders = 0  # a token in flight is appended by update() as usual
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        self._finished_req_ids.add(request.req_id)  # the worker drops its state

    def _schedule_waiting(self, batch: _Batch) -> None:
        skipped: list[Request] = []
        while self.waiting and batch.budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if self._waits_for_sibling(request):
                skipped.append(self.waiting.popleft())
                continue
            if not self._admit(request, batch):
                break
        self.waiting.extendleft(reversed(skipped))

    def _waits_for_sibling(self, request: Request) -> bool:
        """An n>1 sibling waits until the first one's prompt is computed, to share its blocks."""
        if request.prefill_after is None or not self.enable_prefix_caching:
            return False
        sibling = self.requests.get(request.prefill_after)
        if sibling is None:
            return False
        in_queue = sibling.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        return in_queue or sibling.num_computed_tokens < sibling.num_prompt_tokens

    def _admit(self, request: Request, batch: _Batch) -> bool:
        """Try to schedule the head of the waiting queue; False leaves everything unchanged."""
        hits: list[KVBlock] = []
        num_hit_tokens = 0
        params = request.sampling_params
        if params.prompt_logprobs is None and params.pooling is None:  # both need every state
            hits, num_hit_tokens = self.kv.get_computed_blocks(request)
        n = request.num_tokens - num_hit_tokens
        if not self.enable_chunked_prefill and n > batch.budget:
            return False
        n = min(n, self._admit_budget(batch))
        if self.kv.allocate_slots(request, n, hits) is None:
            return False
        self.waiting.popleft()
        self.running.append(request)
        request.status = RequestStatus.RUNNING
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit_tokens
        request.num_computed_tokens = num_hit_tokens
        batch.new_reqs.append(
            NewRequestData(
                req_id=request.req_id,
                token_ids=list(request.all_token_ids),
                num_prompt_tokens=request.num_prompt_tokens,
                sampling_params=request.sampling_params,
                block_ids=self.kv.get_block_ids(request.req_id),
                num_computed_tokens=num_hit_tokens,
                eos_token_id=request.eos_token_id,
            )
        )
        request.pending_token_ids = []
        self._commit(request, n, batch)
        return True

    def _reserve(self, waiting: int, running: int) -> int:
        """Tokens a prefill chunk leaves to the requests waiting to start: the long-prefill
        reserve while ``waiting`` > 0 of them wait and ``running`` leaves them a slot."""
        room = waiting > 0 and running < self.max_num_seqs
        return self.prefill_reserve if room and self.enable_chunked_prefill else 0

    def _admit_budget(self, batch: _Batch) -> int:
        """Tokens the head of the queue may take: with requests waiting behind it, a prefill
        chunk leaves them the reserve, as running prefills do."""
        reserve = self._reserve(len(self.waiting) - 1, len(self.running) + 1)
        return batch.budget - reserve if batch.budget > reserve else batch.budget

    def _commit(self, request: Request, n: int, batch: _Batch) -> None:
        batch.num_scheduled_tokens[request.req_id] = n
        batch.budget -= n
        request.num_computed_tokens += n
        if (
            self.async_scheduling
            and request.num_computed_tokens == request.num_tokens + request.num_output_placeholders
        ):
            request.num_output_placeholders += 1  # this step samples its next token

    # ---- update ----------------------------------------------------------------------------

    def update(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append the sampled tokens, check stops, free finished requests.

        Returns one output per request that got tokens, plus one per request that got only
        prompt logprobs (a partial prefill chunk). Requests finished or aborted since
        ``scheduler_output`` was made are ignored.
        """
        starts = _step_starts(scheduler_output)
        owners = self._step_requests.pop(scheduler_output.step_id, None)
        outputs: list[EngineCoreOutput] = []
        for req_id, token_ids in runner_output.sampled_token_ids.items():
            request = self._scheduled_request(req_id, owners)
            if request is None:
                continue
            request.num_output_placeholders = max(
                0, request.num_output_placeholders - len(token_ids)
            )
            output = self._append_tokens(request, token_ids, runner_output.logprobs.get(req_id))
            output.pooled = runner_output.pooled.get(req_id)
            output.new_prompt_logprobs = self._take_prompt_logprobs(
                request, starts.get(req_id), runner_output.prompt_logprobs.get(req_id)
            )
            outputs.append(output)
        for req_id, prompt_lps in runner_output.prompt_logprobs.items():
            request = self._scheduled_request(req_id, owners)
            if request is None or req_id in runner_output.sampled_token_ids:
                continue
            new_lps = self._take_prompt_logprobs(request, starts.get(req_id), prompt_lps)
            if new_lps:
                outputs.append(
                    EngineCoreOutput(
                        req_id=req_id,
                        new_token_ids=[],
                        new_prompt_logprobs=new_lps,
                        num_cached_tokens=max(request.num_cached_tokens, 0),
                    )
                )
        self._remove_finished(outputs)
        return outputs

    def _scheduled_request(self, req_id: str, owners: dict[str, Request] | None) -> Request | None:
        """The live request a step's output belongs to; None if it finished or was aborted
        since (also when its id has been reused by a new request in the meantime)."""
        request = self.requests.get(req_id)
        if request is None or (owners is not None and owners.get(req_id) is not request):
            return None
        return request

    def _append_tokens(
        self, request: Request, token_ids: list[int], logprobs: list[TokenLogprobs] | None
    ) -> EngineCoreOutput:
        new_token_ids: list[int] = []
        for token_id in token_ids:
            request.append_token(token_id)
            new_token_ids.append(token_id)
            if request.check_stop(token_id, self.max_model_len):
                break
        return EngineCoreOutput(
            req_id=request.req_id,
            new_token_ids=new_token_ids,
            new_logprobs=None if logprobs is None else logprobs[: len(new_token_ids)],
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
            num_cached_tokens=max(request.num_cached_tokens, 0),
        )

    @staticmethod
    def _take_prompt_logprobs(
        request: Request, start: int | None, prompt_lps: list[TokenLogprobs] | None
    ) -> list[TokenLogprobs] | None:
        """Drop the positions already returned (a resumed request recomputes its prompt).

        Assumes the runner's entries are one per prompt position computed this step, the first
        at the step's first computed position ``start``.
        """
        if not prompt_lps:
            return None
        sent = request.num_prompt_logprobs_sent
        start = sent if start is None else start
        request.num_prompt_logprobs_sent = max(sent, start + len(prompt_lps))
        return prompt_lps[max(sent - start, 0) :] or None

    def _remove_finished(self, outputs: list[EngineCoreOutput]) -> None:
        finished = [self.requests[o.req_id] for o in outputs if o.finish_reason is not None]
        if not finished:
            return
        for request in finished:
            if request.status != RequestStatus.RUNNING:  # preempted after it was scheduled
                self.waiting.remove(request)
            self._finish(request)
        self.running = [r for r in self.running if not r.is_finished]

    def _finish(self, request: Request) -> None:
        """Mark finished and return every block; the caller took it out of its queue."""
        request.status = RequestStatus.FINISHED
        self.kv.free(request)
        del self.requests[request.req_id]
        self._finished_req_ids.add(request.req_id)

    def _check_fits_alone(self, request: Request) -> None:
        max_tokens = request.sampling_params.max_tokens
        final_len = self.max_model_len
        if max_tokens is not None:
            final_len = min(final_len, request.num_prompt_tokens + max_tokens)
        # The last sampled token is never fed back, so its K/V are never stored.
        max_kv_tokens = max(request.num_prompt_tokens, final_len - 1)
        num_blocks = -(-max_kv_tokens // self.block_size)
        if num_blocks > self.kv.num_blocks:
            raise ValueError(
                f"request {request.req_id!r} may need {num_blocks} KV blocks "
                f"({max_kv_tokens} tokens) but the cache has only {self.kv.num_blocks}"
            )

    # ---- stats -----------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def kv_cache_usage(self) -> float:
        return self.kv.usage

    @property
    def prefix_cache_queries(self) -> int:
        return self.kv.prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        return self.kv.prefix_cache_hits

    @property
    def num_free_blocks(self) -> int:
        return self.kv.num_free_blocks

    @property
    def num_kv_blocks(self) -> int:
        return self.kv.num_blocks


def _step_starts(scheduler_output: SchedulerOutput) -> dict[str, int]:
    """req_id -> num_computed_tokens before the step, for every request in it."""
    starts = {r.req_id: r.num_computed_tokens for r in scheduler_output.new_reqs}
    starts.update((r.req_id, r.num_computed_tokens) for r in scheduler_output.cached_reqs)
    return starts
