"""Per-step sampling parameters of a batch, as tensors (one row per request that samples).

Built once per step from the requests' ``SamplingParams``; features that no row uses are left
``None`` behind a false ``any_*`` flag, so they cost nothing in the sampler.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lightwell.types import SamplingParams
from lightwell.worker.input_batch import to_device
from lightwell.worker.structured_output import GrammarMask

_MASK64 = (1 << 64) - 1
_MASK63 = (1 << 63) - 1


@dataclass
class SamplingMetadata:
    num_reqs: int  # R
    vocab_size: int  # V
    all_greedy: bool
    all_random: bool  # no greedy row
    greedy_mask: torch.Tensor | None  # [R] bool; only when greedy and random rows mix
    temperature: torch.Tensor | None  # [R] float32, 1.0 on greedy rows; None if all greedy
    any_top_k: bool
    top_k: torch.Tensor | None  # [R] int64, 0 = off (k >= V is off too)
    max_top_k: int  # the largest k of any row (0 if none)
    any_top_p: bool
    top_p: torch.Tensor | None  # [R] float32, 1.0 = off
    any_min_p: bool
    min_p: torch.Tensor | None  # [R] float32, 0.0 = off
    any_penalties: bool
    repetition_penalty: torch.Tensor | None  # [R] float32; None unless a row uses it
    prompt_output_mask: torch.Tensor | None  # [R, V] bool: token in prompt or output
    presence_penalty: torch.Tensor | None  # [R] float32; None unless a row uses it
    frequency_penalty: torch.Tensor | None  # [R] float32; None unless a row uses it
    output_token_counts: torch.Tensor | None  # [R, V] float32: occurrences in the output
    any_logit_bias: bool
    logit_bias_rows: torch.Tensor | None  # [K] int64
    logit_bias_tokens: torch.Tensor | None  # [K] int64
    logit_bias_values: torch.Tensor | None  # [K] float32
    any_min_tokens: bool
    min_tokens_rows: torch.Tensor | None  # [M] int64: (row, token) pairs masked to -inf
    min_tokens_tokens: torch.Tensor | None  # [M] int64
    seeded_rows: list[int]  # rows that draw noise from their own seed
    row_seeds: list[int]  # per seeded row: seed derived from (seed, output tokens so far)
    generator: torch.Generator | None  # for unseeded rows; None = the global RNG
    num_logprobs: list[int | None]  # per row: top alternatives wanted (None = no logprobs)
    max_num_logprobs: int | None  # None when no row wants logprobs
    # Structured output: the constrained rows' allowed tokens (set by the model runner).
    grammar: GrammarMask | None = None


def build_sampling_metadata(
    params: list[SamplingParams],
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    eos_token_id: int | None | list[int | None],
    vocab_size: int,
    device: torch.device | str,
    default_generator: torch.Generator | None = None,
) -> SamplingMetadata:
    """Tensors for one step's sampling; row i is ``params[i]`` with its prompt and outputs.

    ``eos_token_id``: one id for every row, or one per row (what each request stops on)."""
    num_reqs = len(params)
    if not (len(prompt_token_ids) == len(output_token_ids) == num_reqs):
        raise ValueError(
            f"params, prompt_token_ids and output_token_ids differ in length: {num_reqs}, "
            f"{len(prompt_token_ids)}, {len(output_token_ids)}"
        )
    device = torch.device(device)
    greedy = [p.greedy for p in params]
    all_greedy, all_random = all(greedy), not any(greedy)
    seeded_rows = [i for i, p in enumerate(params) if p.seed is not None and not greedy[i]]
    num_logprobs = [p.logprobs for p in params]
    wanted = [k for k in num_logprobs if k is not None]
    return SamplingMetadata(
        num_reqs=num_reqs,
        vocab_size=vocab_size,
        all_greedy=all_greedy,
        all_random=all_random,
        greedy_mask=None if all_greedy or all_random else _tensor(greedy, torch.bool, device),
        temperature=None if all_greedy else _temperatures(params, greedy, device),
        **_top_k_top_p_min_p(params, greedy, vocab_size, device),
        **_penalties(params, prompt_token_ids, output_token_ids, vocab_size, device),
        **_logit_bias(params, vocab_size, device),
        **_min_tokens(params, output_token_ids, eos_token_id, vocab_size, device),
        seeded_rows=seeded_rows,
        row_seeds=[derive_seed(params[i].seed, len(output_token_ids[i])) for i in seeded_rows],
        generator=default_generator,
        num_logprobs=num_logprobs,
        max_num_logprobs=max(wanted) if wanted else None,
    )


def plain_greedy(params: SamplingParams, num_outputs: int) -> bool:
    """Whether the sampler's token for this row is the argmax of the raw logits: greedy, and
    none of what ``Sampler`` applies to a greedy row's logits (min_tokens still in force, logit
    bias, penalties, a grammar) nor wants from them (logprobs). Keep in step with
    ``Sampler.__call__``: steps of such rows on a GPU or under tensor parallelism skip it
    (``ModelRunner._sharded_greedy``)."""
    return (
        params.greedy
        and params.logprobs is None
        and not params.logit_bias
        and not params.uses_penalties
        and params.structured_outputs is None
        and num_outputs >= params.min_tokens
    )


def derive_seed(seed: int, step: int) -> int:
    """A generator seed for one sampling step of a seeded request (splitmix64-style mixing).

    Stateless: it depends only on (seed, number of output tokens so far), so a batch's other
    rows, preemption and recomputation never change a seeded request's samples.
    """
    x = _mix64((seed & _MASK64) ^ 0x6A09E667F3BCC909)
    x = _mix64((x + 0x9E3779B97F4A7C15 * (step + 1)) & _MASK64)
    return x & _MASK63


def _mix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _tensor(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return to_device(torch.tensor(values, dtype=dtype), device)


def _temperatures(
    params: list[SamplingParams], greedy: list[bool], device: torch.device
) -> torch.Tensor:
    # Greedy rows take the argmax; 1.0 keeps their (unused) division harmless.
    return _tensor(
        [1.0 if g else p.temperature for p, g in zip(params, greedy)], torch.float32, device
    )


def _top_k_top_p_min_p(
    params: list[SamplingParams], greedy: list[bool], vocab_size: int, device: torch.device
) -> dict:
    # Greedy rows never reach these filters' results; leaving them off keeps the flags honest.
    top_k = [0 if g or p.top_k >= vocab_size else p.top_k for p, g in zip(params, greedy)]
    top_p = [1.0 if g else p.top_p for p, g in zip(params, greedy)]
    min_p = [0.0 if g else p.min_p for p, g in zip(params, greedy)]
    any_top_k = any(k > 0 for k in top_k)
    any_top_p = any(p < 1.0 for p in top_p)
    any_min_p = any(p > 0.0 for p in min_p)
    return dict(
        any_top_k=any_top_k,
        top_k=_tensor(top_k, torch.int64, device) if any_top_k else None,
        max_top_k=max(top_k, default=0),
        any_top_p=any_top_p,
        top_p=_tensor(top_p, torch.float32, device) if any_top_p else None,
        any_min_p=any_min_p,
        min_p=_tensor(min_p, torch.float32, device) if any_min_p else None,
    )


def _penalties(
    params: list[SamplingParams],
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
    vocab_size: int,
    device: torch.device,
) -> dict:
    use_rep = [p.repetition_penalty != 1.0 for p in params]
    use_freq = [p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params]
    out = dict(
        any_penalties=any(use_rep) or any(use_freq),
        repetition_penalty=None,
        prompt_output_mask=None,
        presence_penalty=None,
        frequency_penalty=None,
        output_token_counts=None,
    )
    if any(use_rep):
        # Rows without the penalty get empty token lists: their mask row stays all False.
        ids = [
            list(p) + list(o) if u else []
            for p, o, u in zip(prompt_token_ids, output_token_ids, use_rep)
        ]
        out["prompt_output_mask"] = _token_counts(ids, vocab_size, device) > 0
        out["repetition_penalty"] = _tensor(
            [p.repetition_penalty for p in params], torch.float32, device
        )
    if any(use_freq):
        ids = [list(o) if u else [] for o, u in zip(output_token_ids, use_freq)]
        out["output_token_counts"] = _token_counts(ids, vocab_size, device)
        out["presence_penalty"] = _tensor(
            [p.presence_penalty for p in params], torch.float32, device
        )
        out["frequency_penalty"] = _tensor(
            [p.frequency_penalty for p in params], torch.float32, device
        )
    return out


def _token_counts(ids: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[R, V] float32: how often each token id occurs in each row's list (ids >= V ignored)."""
    width = max(max((len(row) for row in ids), default=0), 1)
    # Pad with V: an extra column that is dropped, so ragged rows need no per-row tensor work.
    padded = [row + [vocab_size] * (width - len(row)) for row in ids]
    padded = _tensor(padded, torch.int64, device).clamp_(0, vocab_size)
    counts = torch.zeros(len(ids), vocab_size + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab_size]


def _logit_bias(params: list[SamplingParams], vocab_size: int, device: torch.device) -> dict:
    rows, tokens, values = [], [], []
    for i, p in enumerate(params):
        for token, bias in (p.logit_bias or {}).items():
            _check_token(token, vocab_size, "logit_bias")
            rows.append(i)
            tokens.append(token)
            values.append(bias)
    if not rows:
        return dict(
            any_logit_bias=False,
            logit_bias_rows=None,
            logit_bias_tokens=None,
            logit_bias_values=None,
        )
    return dict(
        any_logit_bias=True,
        logit_bias_rows=_tensor(rows, torch.int64, device),
        logit_bias_tokens=_tensor(tokens, torch.int64, device),
        logit_bias_values=_tensor(values, torch.float32, device),
    )


def _min_tokens(
    params: list[SamplingParams],
    output_token_ids: list[list[int]],
    eos_token_id: int | None | list[int | None],
    vocab_size: int,
    device: torch.device,
) -> dict:
    rows, tokens = [], []
    eos_ids = eos_token_id if isinstance(eos_token_id, list) else [eos_token_id] * len(params)
    for i, (p, out) in enumerate(zip(params, output_token_ids)):
        if len(out) >= p.min_tokens:
            continue
        banned = set(p.stop_token_ids or [])
        if eos_ids[i] is not None and not p.ignore_eos:
            banned.add(eos_ids[i])
        for token in sorted(banned):
            _check_token(token, vocab_size, "stop_token_ids")
            rows.append(i)
            tokens.append(token)
    if not rows:
        return dict(any_min_tokens=False, min_tokens_rows=None, min_tokens_tokens=None)
    return dict(
        any_min_tokens=True,
        min_tokens_rows=_tensor(rows, torch.int64, device),
        min_tokens_tokens=_tensor(tokens, torch.int64, device),
    )


def _check_token(token: int, vocab_size: int, what: str) -> None:
    if not 0 <= token < vocab_size:
        raise ValueError(f"{what} token id {token} is outside the vocabulary [0, {vocab_size})")
