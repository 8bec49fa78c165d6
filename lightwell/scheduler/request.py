"""The scheduler's view of one sequence being generated."""

from __future__ import annotations

import enum
import time

from lightwell.types import FinishReason, SamplingParams


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()  # back in the waiting queue; its KV blocks were freed
    FINISHED = enum.auto()


class Request:
    """One sequence: prompt tokens, generated tokens and progress through the KV cache.

    ``num_computed_tokens`` counts tokens whose K/V are in the cache; the next step runs
    ``num_tokens - num_computed_tokens`` of them at most.
    """

    def __init__(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None = None,
        arrival_time: float | None = None,
        prefill_after: str | None = None,
    ) -> None:
        self.req_id = req_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        # A sibling (n > 1) whose prompt prefill this one waits for, to share its cached blocks.
        self.prefill_after = prefill_after

        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prompt tokens found in the prefix cache at first schedule
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.block_hashes: list[int] = []  # chained hashes of the full blocks of all_token_ids
        # Tokens appended since the worker last saw this request (sent as a diff).
        self.pending_token_ids: list[int] = []
        # Prompt positions whose logprobs were already returned (a resumed request recomputes them).
        self.num_prompt_logprobs_sent = 0
        # Async scheduling: tokens being sampled by a step in flight, not yet appended. The next
        # step is scheduled as if they were there (the worker feeds them from the device).
        self.num_output_placeholders = 0

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    def reaches_limit_with_placeholders(self, max_model_len: int) -> bool:
        """Whether the tokens in flight already end the request by length (no step is left)."""
        max_tokens = self.sampling_params.max_tokens
        n_out = self.num_output_tokens + self.num_output_placeholders
        if max_tokens is not None and n_out >= max_tokens:
            return True
        return self.num_tokens + self.num_output_placeholders >= max_model_len

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
        self.pending_token_ids.append(token_id)

    def check_stop(self, token_id: int, max_model_len: int) -> bool:
        """After appending ``token_id``: set finish_reason (and stop_reason) if it ends the request.

        Order: EOS (unless ignore_eos), a stop token id (both only once min_tokens are out), then
        max_tokens, then the context length.
        """
        params = self.sampling_params
        past_min = self.num_output_tokens >= params.min_tokens
        if token_id == self.eos_token_id and not params.ignore_eos and past_min:
            self.finish_reason = FinishReason.STOP
        elif token_id in (params.stop_token_ids or ()) and past_min:
            self.finish_reason = FinishReason.STOP
            self.stop_reason = token_id
        elif params.max_tokens is not None and self.num_output_tokens >= params.max_tokens:
            self.finish_reason = FinishReason.LENGTH
        elif self.num_tokens >= max_model_len:
            self.finish_reason = FinishReason.LENGTH
        return self.finish_reason is not None

    def __repr__(self) -> str:
        return (
            f"Request({self.req_id}, {self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
