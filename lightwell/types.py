"""Plain request/response data shared by every layer. No torch here."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context length reached
    ABORT = "abort"  # aborted by the caller (or the client went away)


@dataclass
class SamplingParams:
    """How to sample one request. Invalid values raise ``ValueError`` at construction."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None  # number of top alternatives returned per sampled token
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        self._validate()

    def _validate(self) -> None:
        _need(isinstance(self.n, int) and self.n >= 1, "n must be an integer >= 1", self.n)
        _need(self.temperature >= 0.0, "temperature must be >= 0", self.temperature)
        _need(0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]", self.top_p)
        _need(
            isinstance(self.top_k, int) and self.top_k >= 0,
            "top_k must be -1, 0 (off) or a positive integer",
            self.top_k,
        )
        _need(0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]", self.min_p)
        _need(
            -2.0 <= self.presence_penalty <= 2.0,
            "presence_penalty must be in [-2, 2]",
            self.presence_penalty,
        )
        _need(
            -2.0 <= self.frequency_penalty <= 2.0,
            "frequency_penalty must be in [-2, 2]",
            self.frequency_penalty,
        )
        _need(
            self.repetition_penalty > 0.0, "repetition_penalty must be > 0", self.repetition_penalty
        )
        _need(
            self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
            "max_tokens must be an integer >= 1",
            self.max_tokens,
        )
        _need(
            isinstance(self.min_tokens, int) and self.min_tokens >= 0,
            "min_tokens must be an integer >= 0",
            self.min_tokens,
        )
        if self.max_tokens is not None:
            _need(
                self.min_tokens <= self.max_tokens,
                "min_tokens must be <= max_tokens",
                self.min_tokens,
            )
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            _need(
                v is None or (isinstance(v, int) and 0 <= v <= 20),
                f"{name} must be an integer in [0, 20]",
                v,
            )
        _need(
            all(isinstance(s, str) and s for s in self.stop),
            "stop strings must be non-empty strings",
            self.stop,
        )
        _need(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids must be non-negative integers",
            self.stop_token_ids,
        )
        if self.logit_bias:
            _need(
                all(-100.0 <= v <= 100.0 for v in self.logit_bias.values()),
                "logit_bias values must be in [-100, 100]",
                self.logit_bias,
            )
            _need(
                all(k >= 0 for k in self.logit_bias),
                "logit_bias keys must be token ids >= 0",
                self.logit_bias,
            )
        if self.seed is not None:
            _need(isinstance(self.seed, int), "seed must be an integer", self.seed)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def uses_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids named by the request must exist in the vocabulary."""
        bad = [t for t in (self.logit_bias or {}) if t >= vocab_size]
        _need(not bad, f"logit_bias token ids must be < vocab size {vocab_size}", bad)
        bad = [t for t in self.stop_token_ids if t >= vocab_size]
        _need(not bad, f"stop_token_ids must be < vocab size {vocab_size}", bad)

    def for_child(self, index: int) -> SamplingParams:
        """Params for the index-th of n samples: n=1, and a distinct derived seed."""
        import dataclasses

        seed = None if self.seed is None else self.seed + index
        return dataclasses.replace(self, n=1, seed=seed)


def _need(ok: bool, message: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{message} (got {value!r})")


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = most likely
    decoded_token: str | None = None


# One position: token id -> Logprob, the chosen token first, then the top alternatives.
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: RequestMetrics | None = None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)
