"""Benchmark prompts: random token prompts of exact lengths (vLLM's random dataset) and JSONL files.

Random prompts follow vLLM's `--dataset-name random`: each prompt is a shared prefix of
``prefix_len`` random tokens plus ``input_len`` random tokens, and output lengths are fixed; with
``range_ratio`` r both lengths are drawn uniformly from ``[len * (1 - r), len * (1 + r)]``. As
text, a prompt is re-tokenized until it has exactly the intended number of tokens.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

_FIT_TRIES = 20


class TokenizerLike(Protocol):
    vocab_size: int
    all_special_ids: list[int]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


@dataclass
class SampleRequest:
    prompt: str | list[int]  # text, or token ids (for servers that take them)
    prompt_len: int
    output_len: int


def sample_lengths(rng: np.random.Generator, n: int, length: int, range_ratio: float) -> list[int]:
    """n lengths uniform in [length * (1 - r), length * (1 + r)] (integers, at least 1)."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1) (got {range_ratio})")
    low = max(int(length * (1 - range_ratio)), 1)
    high = max(int(length * (1 + range_ratio)), low)
    return [int(x) for x in rng.integers(low, high + 1, size=n)]


def _id_sampler(tokenizer: TokenizerLike, rng: np.random.Generator) -> Callable[[int], list[int]]:
    """Draws uniform token ids, special tokens excluded."""
    allowed = np.setdiff1d(np.arange(tokenizer.vocab_size), tokenizer.all_special_ids)
    return lambda k: [int(t) for t in rng.choice(allowed, size=max(k, 0))]


def fit_text(
    tokenizer: TokenizerLike, prefix: str, ids: list[int], target: int, draw: Callable
) -> tuple[str, int]:
    """``prefix`` + text decoded from ``ids``, trimmed or grown until it is ``target`` tokens.

    Returns (text, its token count); the count can miss the target only for pathological
    tokenizers (then the real count is reported, not the target).
    """
    best = ("", -1)
    for _ in range(_FIT_TRIES):
        text = prefix + tokenizer.decode(ids)
        n = len(tokenizer.encode(text))
        if n == target:
            return text, n
        if best[1] < 0 or abs(n - target) < abs(best[1] - target):
            best = (text, n)
        if n > target:
            ids = ids[: max(len(ids) - (n - target), 0)]
        else:
            ids = ids + draw(target - n)
    return best


def random_requests(
    tokenizer: TokenizerLike,
    num_prompts: int,
    input_len: int,
    output_len: int,
    *,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    seed: int = 0,
    as_token_ids: bool = False,
    prefix_seed: int | None = None,
) -> list[SampleRequest]:
    """vLLM-style random prompts: ``prefix_len`` shared tokens + ``input_len`` random tokens.

    The shared prefix is drawn from ``prefix_seed`` (default ``seed``) so runs with different
    seeds can share one prefix.
    """
    if input_len < 1 or output_len < 1 or prefix_len < 0 or num_prompts < 1:
        raise ValueError("need num_prompts >= 1, input_len >= 1, output_len >= 1, prefix_len >= 0")
    rng = np.random.default_rng(seed)
    draw = _id_sampler(tokenizer, rng)
    prefix_draw = _id_sampler(
        tokenizer, np.random.default_rng(seed if prefix_seed is None else prefix_seed)
    )
    in_lens = sample_lengths(rng, num_prompts, input_len, range_ratio)
    out_lens = sample_lengths(rng, num_prompts, output_len, range_ratio)
    prefix_ids = prefix_draw(prefix_len)
    prefix_text = ""
    if prefix_len and not as_token_ids:
        prefix_text, _ = fit_text(tokenizer, "", prefix_ids, prefix_len, prefix_draw)
    out = []
    for n_in, n_out in zip(in_lens, out_lens):
        ids = draw(n_in)
        if as_token_ids:
            out.append(SampleRequest(prefix_ids + ids, prefix_len + n_in, n_out))
        else:
            text, n = fit_text(tokenizer, prefix_text, ids, prefix_len + n_in, draw)
            out.append(SampleRequest(text, n, n_out))
    return out


def jsonl_requests(
    path: str, tokenizer: TokenizerLike, num_prompts: int, default_output_len: int
) -> list[SampleRequest]:
    """The first ``num_prompts`` lines of a JSONL file of {"prompt": ..., "output_len"?: ...}.

    ``prompt`` is text or a list of token ids.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"dataset file {path!r} does not exist")
    out: list[SampleRequest] = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if len(out) >= num_prompts:
                break
            if line.strip():
                out.append(_parse_line(line, lineno, path, tokenizer, default_output_len))
    if not out:
        raise ValueError(f"dataset file {path!r} holds no prompts")
    return out


def _parse_line(
    line: str, lineno: int, path: str, tokenizer: TokenizerLike, default_output_len: int
) -> SampleRequest:
    where = f"{path}:{lineno}"
    try:
        row: Any = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e})") from None
    if not isinstance(row, dict) or "prompt" not in row:
        raise ValueError(f"{where}: each line must be an object with a 'prompt'")
    prompt = row["prompt"]
    n_out = row.get("output_len", default_output_len)
    if not isinstance(n_out, int) or n_out < 1:
        raise ValueError(f"{where}: output_len must be an integer >= 1")
    if isinstance(prompt, str) and prompt:
        return SampleRequest(prompt, len(tokenizer.encode(prompt)), n_out)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return SampleRequest(prompt, len(prompt), n_out)
    raise ValueError(f"{where}: 'prompt' must be a non-empty string or list of token ids")
