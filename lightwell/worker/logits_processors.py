"""The sampler's logits transforms, applied in vLLM's order.

min_tokens -> logit_bias -> penalties -> (greedy argmax) -> temperature -> min_p -> top_k -> top_p.
Each takes float32 logits ``[R, V]`` and a ``SamplingMetadata``, may modify the logits in place and
returns the result. A masked token gets ``-inf``.
"""

from __future__ import annotations

import torch

from lightwell.worker.sampling_metadata import SamplingMetadata

_NEG_INF = float("-inf")


def apply_min_tokens(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Mask EOS (unless ignore_eos) and stop token ids of rows still short of min_tokens."""
    # logits: [R, V]
    if meta.min_tokens_rows is None or meta.min_tokens_tokens is None:
        return logits
    index = (meta.min_tokens_rows, meta.min_tokens_tokens)
    return logits.index_put_(index, logits.new_full((), _NEG_INF))


def apply_logit_bias(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Add each row's logit_bias to its tokens' logits."""
    # logits: [R, V]
    if meta.logit_bias_rows is None or meta.logit_bias_tokens is None:
        return logits
    index = (meta.logit_bias_rows, meta.logit_bias_tokens)
    return logits.index_put_(index, meta.logit_bias_values, accumulate=True)


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Repetition penalty over prompt + output tokens, then presence/frequency over the output.

    repetition (HF/vLLM): a seen token's positive logit is divided by the penalty, a negative one
    multiplied. presence/frequency (OpenAI): logit -= presence * (count > 0) + frequency * count.
    """
    # logits: [R, V]
    if meta.repetition_penalty is not None and meta.prompt_output_mask is not None:
        penalty = meta.repetition_penalty.unsqueeze(1)  # [R, 1]
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(meta.prompt_output_mask, penalized, logits)
    counts = meta.output_token_counts  # [R, V]
    if counts is not None and meta.presence_penalty is not None:
        logits -= meta.frequency_penalty.unsqueeze(1) * counts
        logits -= meta.presence_penalty.unsqueeze(1) * (counts > 0).to(logits.dtype)
    return logits


def apply_temperature(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    # logits: [R, V]; greedy rows carry temperature 1.0 (their tokens come from the argmax)
    if meta.temperature is None:
        return logits
    return logits.div_(meta.temperature.unsqueeze(1))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Keep tokens whose probability is >= min_p * the row's largest probability."""
    # logits: [R, V]; min_p: [R] (0.0 = off)
    probs = logits.softmax(dim=-1)  # [R, V]
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)  # [R, 1]
    return logits.masked_fill_(probs < threshold, _NEG_INF)


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Keep each row's k largest logits (ties with the k-th are kept), without a full sort."""
    # logits: [R, V]; top_k: [R] int64 (0 = off); 0 < max_top_k < V
    top_values = logits.topk(max_top_k, dim=-1).values  # [R, max_top_k], descending
    kth = (torch.where(top_k > 0, top_k, max_top_k) - 1).unsqueeze(1)  # [R, 1]
    threshold = top_values.gather(1, kth).masked_fill_(top_k.unsqueeze(1) == 0, _NEG_INF)
    return logits.masked_fill_(logits < threshold, _NEG_INF)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor
) -> torch.Tensor:
    """top_k (as ``apply_top_k``) then top_p over one descending sort.

    top_p keeps the smallest prefix of the sorted tokens whose probability mass is >= top_p
    (always at least the most likely token); probabilities are renormalised after top_k.
    """
    # logits: [R, V]; top_k: [R] int64 (0 = off) or None; top_p: [R] float32 (1.0 = off)
    vocab = logits.shape[1]
    values, order = logits.sort(dim=-1, descending=True)  # [R, V], [R, V]
    if top_k is not None:
        kth = (torch.where(top_k > 0, top_k.clamp(max=vocab), vocab) - 1).unsqueeze(1)
        values.masked_fill_(values < values.gather(1, kth), _NEG_INF)
    probs = values.softmax(dim=-1)  # [R, V]
    mass_before = probs.cumsum(dim=-1) - probs  # [R, V]: mass of the more likely tokens
    drop = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    values.masked_fill_(drop, _NEG_INF)
    return torch.empty_like(logits).scatter_(1, order, values)


def apply_sampling_filters(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """min_p, then top_k, then top_p: only the filters some row uses run."""
    # logits: [R, V], already divided by the temperature
    if meta.any_min_p and meta.min_p is not None:
        logits = apply_min_p(logits, meta.min_p)
    if meta.any_top_p and meta.top_p is not None:
        return apply_top_k_top_p(logits, meta.top_k if meta.any_top_k else None, meta.top_p)
    if meta.any_top_k and meta.top_k is not None:
        return apply_top_k(logits, meta.top_k, meta.max_top_k)
    return logits
