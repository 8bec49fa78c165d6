"""The sampler: processed logits -> one token per row, plus optional logprobs.

Random rows sample by an exponential race: argmax(probs / E) with E ~ Exponential(1) i.i.d.
picks token i with probability probs[i], in one vectorised op. A seeded row draws its E from a
generator seeded from (seed, output tokens so far), so its tokens depend on nothing else: not
the batch, not its position in it, not preemption or recomputation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightwell.scheduler.output import TokenLogprobs
from lightwell.worker import logits_processors as lp
from lightwell.worker.logprobs import prompt_logprobs, sampled_logprobs, to_token_logprobs
from lightwell.worker.sampling_metadata import SamplingMetadata
from lightwell.worker.structured_output import apply_grammar_mask


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [R] int64, on the logits' device
    # When any row asked for logprobs: (token ids, logprobs, ranks), each [R, 1 + K] on the
    # device, the sampled token first; and each row's k (None: the row asked for none).
    logprob_tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    num_logprobs: list[int | None] | None = None

    @property
    def logprobs(self) -> list[TokenLogprobs | None] | None:
        """Per row: the sampled token, then its top-k alternatives (copied to the host)."""
        if self.logprob_tensors is None:
            return None
        return to_token_logprobs(*self.logprob_tensors, self.num_logprobs)


class Sampler:
    """Samples one token per row of ``logits`` following ``SamplingMetadata``.

    The logits are modified in place (pass a copy to keep them).
    """

    def __init__(self) -> None:
        self._seed_generators: dict[torch.device, torch.Generator] = {}

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        # logits: [R, V] float32
        _check_shape(logits, meta)
        logits = logits.float()
        raw_logprobs = None
        if meta.max_num_logprobs is not None:
            raw_logprobs = logits.log_softmax(dim=-1)  # [R, V], before any processing
        if meta.grammar is not None:  # structured output: disallowed tokens to -inf first
            logits = apply_grammar_mask(logits, meta.grammar)
        logits = lp.apply_min_tokens(logits, meta)
        logits = lp.apply_logit_bias(logits, meta)
        if meta.any_penalties:
            logits = lp.apply_penalties(logits, meta)
        token_ids = self._sample(logits, meta)
        if raw_logprobs is None:
            return SamplerOutput(token_ids)
        tensors = sampled_logprobs(raw_logprobs, token_ids, meta.num_logprobs)
        return SamplerOutput(token_ids, tensors, meta.num_logprobs)

    def compute_prompt_logprobs(
        self, logits: torch.Tensor, target_token_ids: torch.Tensor, num_top: int
    ) -> list[TokenLogprobs]:
        """Logprobs of each next prompt token (row i predicts target i) and the top alternatives."""
        # logits: [N, V]; target_token_ids: [N] int64
        return compute_prompt_logprobs(logits, target_token_ids, num_top)

    def _sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        # logits: [R, V] -> [R] int64
        greedy = None if meta.all_random else logits.argmax(dim=-1)
        if meta.all_greedy and greedy is not None:
            return greedy
        logits = lp.apply_temperature(logits, meta)
        logits = lp.apply_sampling_filters(logits, meta)
        probs = logits.softmax(dim=-1)  # [R, V]
        sampled = probs.div_(self._exponential_noise(probs, meta)).argmax(dim=-1)
        if greedy is None or meta.greedy_mask is None:
            return sampled
        return torch.where(meta.greedy_mask, greedy, sampled)

    def _exponential_noise(self, probs: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Exponential(1) noise [R, V] on the probs' device: seeded rows from their own seed."""
        # probs: [R, V]
        noise = torch.empty_like(probs)
        if len(meta.seeded_rows) < meta.num_reqs:
            noise.exponential_(generator=meta.generator)
        if meta.seeded_rows:
            generator = self._seed_generator(probs.device)
            for row, seed in zip(meta.seeded_rows, meta.row_seeds):
                generator.manual_seed(seed)
                # A fresh [V] draw, so the row's noise cannot depend on the batch's layout.
                row_noise = torch.empty(probs.shape[1], dtype=probs.dtype, device=probs.device)
                noise[row] = row_noise.exponential_(generator=generator)
        # An exact 0 would turn a masked token's 0 / 0 into NaN.
        return noise.clamp_(min=torch.finfo(noise.dtype).tiny)

    def _seed_generator(self, device: torch.device) -> torch.Generator:
        generator = self._seed_generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            self._seed_generators[device] = generator
        return generator


def compute_prompt_logprobs(
    logits: torch.Tensor, target_token_ids: torch.Tensor, num_top: int
) -> list[TokenLogprobs]:
    """Per prompt position: the next prompt token's logprob first, then the top ``num_top``."""
    # logits: [N, V] (row i predicts target i); target_token_ids: [N] int64
    return prompt_logprobs(logits, target_token_ids, num_top)


def _check_shape(logits: torch.Tensor, meta: SamplingMetadata) -> None:
    expected = (meta.num_reqs, meta.vocab_size)
    if logits.dim() != 2 or tuple(logits.shape) != expected:
        raise ValueError(
            f"logits of shape {tuple(logits.shape)} do not match the sampling metadata "
            f"(expected [R, V] = {list(expected)})"
        )
