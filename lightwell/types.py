"""Plain request/response data shared by every layer. No torch here."""

from __future__ import annotations

import enum
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar, overload

T = TypeVar("T")
# Upper bounds of the unbounded sampling fields (Infinity / NaN are rejected with them).
MAX_TEMPERATURE = 100.0
MAX_REPETITION_PENALTY = 100.0


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context length reached
    ABORT = "abort"  # aborted by the caller (or the client went away)


@dataclass(frozen=True)
class StructuredOutputs:
    """A constraint on a request's output: exactly one of a JSON schema (``json``: a dict or its
    JSON text), any JSON object (``json_object``: an object, not any JSON value), a regular
    expression (``regex``), one of a list of strings (``choice``) or an EBNF grammar
    (``grammar``, xgrammar's GBNF dialect). Constrained sampling masks every token the
    constraint cannot continue with; EOS is allowed only once the output is complete. Shapes
    are checked here; whether the spec compiles is checked by the engine when the request is
    added (a ``ValueError`` naming the reason)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        import json as _json

        kinds = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        kinds += ["json_object"] if self.json_object else []
        _need(
            len(kinds) == 1,
            "structured_outputs needs exactly one of json, regex, choice, grammar, json_object",
            kinds,
        )
        if isinstance(self.json, dict):
            object.__setattr__(self, "json", _json.dumps(self.json))
        _need(
            self.json is None or isinstance(self.json, str),
            "json must be a JSON schema (a dict or a string)",
            type(self.json).__name__,
        )
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            _need(v is None or (isinstance(v, str) and v), f"{name} must be a non-empty string", v)
        if self.choice is not None:
            _need(
                isinstance(self.choice, (list, tuple))
                and bool(self.choice)
                and all(isinstance(c, str) and c for c in self.choice),
                "choice must be a non-empty list of non-empty strings",
                self.choice,
            )
            object.__setattr__(self, "choice", list(self.choice))

    @property
    def kind(self) -> str:
        for k in ("json", "regex", "choice", "grammar"):
            if getattr(self, k) is not None:
                return k
        return "json_object"

    def key(self) -> tuple[str, str]:
        """(kind, spec text): what a compiled grammar is cached under."""
        import json as _json

        kind = self.kind
        if kind == "choice":
            return kind, _json.dumps(self.choice)
        return kind, "" if kind == "json_object" else getattr(self, kind)


@dataclass(frozen=True)
class PoolingParams:
    """An embedding request: the prompt's hidden states pooled into one vector (no tokens are
    generated). ``pooling``: ``last`` (the last token's state, as Qwen3-Embedding) or ``mean``
    (over every prompt token); None: the engine's ``--pooling``. ``normalize``: unit L2 norm.
    ``dimensions``: keep the first d components (Matryoshka embeddings), before normalizing."""

    pooling: str | None = None
    normalize: bool = True
    dimensions: int | None = None

    def __post_init__(self) -> None:
        _need(self.pooling in (None, "last", "mean"), "pooling must be last or mean", self.pooling)
        _need(
            self.dimensions is None or (isinstance(self.dimensions, int) and self.dimensions >= 1),
            "dimensions must be an integer >= 1",
            self.dimensions,
        )


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
    # Constrained output (JSON schema, regex, choice, grammar); a dict is read as its fields.
    structured_outputs: StructuredOutputs | None = None
    # Prefix-cache isolation: KV blocks are shared only between requests with the same salt.
    cache_salt: str | None = None
    # An embedding request (the engine sets max_tokens=1 and samples nothing).
    pooling: PoolingParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputs(**self.structured_outputs)
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
        _need(
            0.0 <= self.temperature <= MAX_TEMPERATURE,
            f"temperature must be in [0, {MAX_TEMPERATURE:g}]",
            self.temperature,
        )
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
            0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY,
            f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}]",
            self.repetition_penalty,
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
        _need(
            self.cache_salt is None or (isinstance(self.cache_salt, str) and self.cache_salt),
            "cache_salt must be a non-empty string",
            self.cache_salt,
        )
        if self.structured_outputs is not None:
            self._validate_structured()

    def _validate_structured(self) -> None:
        _need(
            isinstance(self.structured_outputs, StructuredOutputs),
            "structured_outputs must be a StructuredOutputs",
            type(self.structured_outputs).__name__,
        )
        # The grammar ends the output with EOS: neither may hold EOS back.
        _need(not self.ignore_eos, "ignore_eos cannot be combined with structured_outputs", True)
        _need(
            self.min_tokens == 0,
            "min_tokens cannot be combined with structured_outputs",
            self.min_tokens,
        )

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
        shown = repr(value)  # escaped, and cut: an error never echoes a long value whole
        raise ValueError(f"{message} (got {shown if len(shown) <= 80 else shown[:77] + '...'})")


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = most likely
    decoded_token: str | None = None


# One position: token id -> Logprob, the chosen token first, then the top alternatives.
PositionLogprobs = dict[int, Logprob]


class ListPrefix(Sequence[T], Generic[T]):
    """The first ``n`` items of a list that only grows (``extend``): a snapshot that copies
    nothing, so a streamed output costs O(1) a step, not O(tokens so far). Slices are lists of
    just the items asked for."""

    __slots__ = ("_items", "_n")

    def __init__(self, items: list[T], n: int) -> None:
        if not 0 <= n <= len(items):
            raise ValueError(f"a prefix of {n} items of a list of {len(items)}")
        self._items, self._n = items, n

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, i: int) -> T: ...

    @overload
    def __getitem__(self, i: slice) -> list[T]: ...

    def __getitem__(self, i: int | slice) -> T | list[T]:
        if isinstance(i, slice):
            start, stop, step = i.indices(self._n)  # (a stop of -1 is "before 0" here)
            if step == 1:
                return self._items[start:stop] if start < stop else []
            return [self._items[k] for k in range(start, stop, step)]
        if not -self._n <= i < self._n:
            raise IndexError("ListPrefix index out of range")
        return self._items[i % self._n]

    def __iter__(self) -> Iterator[T]:
        items = self._items
        for k in range(self._n):
            yield items[k]

    def __eq__(self, other: Any) -> bool:
        if not isinstance(other, (list, tuple, ListPrefix)):
            return NotImplemented
        return len(other) == self._n and all(a == b for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]  (mutable underneath, like a list)

    def __repr__(self) -> str:
        return repr(self[:])


@dataclass
class CompletionOutput:
    """One completion of a request. In a streamed (unfinished) output, ``token_ids`` and
    ``logprobs`` are ``ListPrefix`` views of what was generated so far (read-only sequences:
    len, index, slice, iterate, compare); a finished output holds lists."""

    index: int
    text: str
    token_ids: Sequence[int]
    cumulative_logprob: float | None = None
    logprobs: Sequence[PositionLogprobs] | None = None
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
    embedding: list[float] | None = None  # an embedding request's vector


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)
