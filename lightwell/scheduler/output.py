"""What crosses the scheduler <-> worker boundary: picklable diffs, no tensors, no live objects."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lightwell.types import FinishReason, SamplingParams


@dataclass
class NewRequestData:
    """A request the worker has no state for: first scheduled, or resumed after preemption."""

    req_id: str
    token_ids: list[int]  # prompt + output tokens so far (outputs are non-empty on resume)
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int  # tokens already in the KV cache (prefix-cache hits)
    eos_token_id: int | None = None  # the EOS the engine stops on (min_tokens masks it)


@dataclass
class CachedRequestData:
    """A request the worker already holds: only what changed since its last step."""

    req_id: str
    new_token_ids: list[int]  # tokens appended since the worker last saw it (sampled tokens)
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass
class GrammarBitmask:
    """Structured output: the tokens each constrained row of a step may sample (bit ``t % 32``
    of word ``t // 32`` of row g set = token t allowed); filled by the engine, applied by the
    sampler. The one array in these messages (numpy on the host, not a torch tensor)."""

    req_ids: list[str]  # row g's request
    bitmask: Any  # [G, ceil(V / 32)] int32 numpy array


@dataclass
class SchedulerOutput:
    new_reqs: list[NewRequestData]
    cached_reqs: list[CachedRequestData]
    # req_id -> tokens to run this step; the dict's order is the batch order.
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests the worker must forget: finished, aborted or preempted since the last step.
    finished_req_ids: set[str] = field(default_factory=set)
    # The scheduler's serial number of this step (async scheduling: ties update() to the
    # requests that were scheduled, not to whatever request holds the same id by then).
    step_id: int = -1
    # Structured output: the allowed tokens of the constrained rows that sample this step.
    grammar: GrammarBitmask | None = None
    # Async scheduling: the step has constrained rows whose mask is filled after its launch
    # (the driver's sampler waits for it: ``PendingStep.sample``).
    grammar_later: bool = False

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class TokenLogprobs:
    """Logprobs at one position: the chosen token first, then the top-k alternatives."""

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]  # 1 = most likely


@dataclass
class ModelRunnerOutput:
    # Only requests that produced a token this step (their prefill is complete) appear here.
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # Prompt logprobs for the prompt positions computed this step (chunked: in pieces).
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # Embedding requests whose prompt finished this step: their pooled hidden state.
    pooled: dict[str, list[float]] = field(default_factory=dict)
    # How the step ran on the driving rank: "graph decode B" / "graph mixed T" (a CUDA graph
    # of that size), "eager", "eager split" (micro-batches), "" (no forward); --step-trace
    path: str = ""


@dataclass
class EngineCoreOutput:
    """Per request, what one step changed: produced by ``Scheduler.update``."""

    req_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    new_prompt_logprobs: list[TokenLogprobs] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    pooled: list[float] | None = None  # an embedding request's vector

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
