"""A launched step's handle: its sampled tokens (and logprobs) on their way to the host, and,
for a step launched with ``grammar_later``, its sampling held back until the mask comes."""

from __future__ import annotations

from collections.abc import Callable

import torch

from lightwell.scheduler.output import GrammarBitmask, ModelRunnerOutput
from lightwell.worker.logprobs import to_token_logprobs
from lightwell.worker.sampler import SamplerOutput


class PendingStep:
    """A launched step: its output once the sampled tokens have reached the host."""

    def __init__(self, out: ModelRunnerOutput) -> None:
        self.out = out
        self.req_ids: list[str] = []
        # On the host (pinned on CUDA): the tokens [S], then the logprob tensors if any.
        self.host: list[torch.Tensor] = []
        self.num_logprobs: list[int | None] | None = None
        self.event: torch.cuda.Event | None = None
        # Launched with ``grammar_later``: samples once ``sample`` brings the grammar's mask.
        self.deferred: Callable[[GrammarBitmask | None], None] | None = None

    def sample(self, grammar: GrammarBitmask | None) -> None:
        """Sample a step whose sampling was held back for its grammar mask (its forward is
        already queued; on a GPU the mask's copy and the sampler queue behind it)."""
        run, self.deferred = self.deferred, None
        if run is not None:
            with torch.inference_mode():
                run(grammar)

    def set_tokens(self, req_ids: list[str], result: SamplerOutput) -> None:
        """Start copying the sampled tokens (and logprobs) to the host, without waiting."""
        self.req_ids, self.num_logprobs = req_ids, result.num_logprobs
        tensors = [result.token_ids, *(result.logprob_tensors or ())]
        if result.token_ids.device.type != "cuda":
            self.host = tensors
            return
        self.host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
        for dst, src in zip(self.host, tensors):
            dst.copy_(src, non_blocking=True)
        self.event = torch.cuda.Event()
        self.event.record()

    def result(self) -> ModelRunnerOutput:
        if self.deferred is not None:
            raise RuntimeError("a step held back for its grammar mask was never sampled")
        if self.host:
            if self.event is not None:
                self.event.synchronize()
            for req_id, token in zip(self.req_ids, self.host[0].tolist()):
                self.out.sampled_token_ids[req_id] = [token]
            if len(self.host) > 1:
                rows = to_token_logprobs(*self.host[1:], self.num_logprobs)
                for req_id, row in zip(self.req_ids, rows):
                    if row is not None:
                        self.out.logprobs[req_id] = [row]
            self.host = []
        return self.out
