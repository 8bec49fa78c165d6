"""The engine's side of structured output: one xgrammar matcher per constrained sequence (n > 1:
one per sample), the token bitmask of each step's constrained rows, and the matchers' advance as
tokens come back.

Matchers follow the scheduler's tokens, not the worker's: a matcher accepts exactly the tokens
``Scheduler.update`` appended, so a preempted request (whose output tokens stay, to be
recomputed) keeps its matcher as is, and prefix caching never touches it. The mask of a step is
filled once every constrained row's previous token is known: with async scheduling the overlap
loop waits for the step in flight before it schedules while any constrained request is alive.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import Any

from lightwell.scheduler.output import EngineCoreOutput, GrammarBitmask, SchedulerOutput
from lightwell.scheduler.request import Request
from lightwell.structured.compiler import CompileStats, GrammarCache, tokenizer_info
from lightwell.types import SamplingParams

logger = logging.getLogger(__name__)


class StructuredOutputManager:
    def __init__(
        self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], cache_size: int = 256
    ) -> None:
        """``tokenizer``: the engine's ``Tokenizer`` (None: structured output is refused);
        ``vocab_size``: the logits' width (it may exceed the tokenizer's); ``stop_token_ids``:
        the ids that end a request (EOS and generation_config's), which end a grammar too."""
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self._cache_size = cache_size
        self._cache: GrammarCache | None = None
        self._lock = threading.Lock()
        self.matchers: dict[str, Any] = {}  # req_id -> xgrammar.GrammarMatcher

    @property
    def cache(self) -> GrammarCache:
        """Built on first use (the server's compile thread or the engine's, whichever first)."""
        with self._lock:
            if self._cache is None:
                if self._tokenizer is None:
                    raise ValueError("structured output needs a tokenizer; this engine has none")
                info = tokenizer_info(self._tokenizer.hf, self._vocab_size, self._stop_token_ids)
                self._cache = GrammarCache(info, self._cache_size)
            return self._cache

    @property
    def stats(self) -> CompileStats:
        return CompileStats() if self._cache is None else self._cache.stats

    @property
    def active(self) -> bool:
        """Whether any constrained sequence is alive (waiting or running)."""
        return bool(self.matchers)

    def validate(self, params: SamplingParams) -> None:
        """Compile (or find cached) the request's grammar; ``ValueError`` says why it cannot."""
        if params.structured_outputs is not None:
            self.cache.get(params.structured_outputs)

    def add(self, req_id: str, params: SamplingParams) -> None:
        if params.structured_outputs is None:
            return
        import xgrammar as xgr

        self.matchers[req_id] = xgr.GrammarMatcher(self.cache.get(params.structured_outputs))

    def remove(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self.matchers.pop(req_id, None)

    def prune(self, live: dict[str, Request]) -> None:
        """Forget matchers of sequences the scheduler no longer holds (however they ended)."""
        gone = [r for r in self.matchers if r not in live]
        self.remove(gone)

    def bitmask(
        self, sched: SchedulerOutput, requests: dict[str, Request]
    ) -> GrammarBitmask | None:
        """The allowed tokens of the step's constrained rows that sample (their prefill ends in
        this step), or None when there are none."""
        rows = [
            r
            for r in sched.num_scheduled_tokens
            if r in self.matchers and _samples(requests.get(r))
        ]
        if not rows:
            return None
        import numpy as np

        words = (self._vocab_size + 31) // 32
        mask = np.empty((len(rows), words), dtype=np.int32)  # [G, W], every row filled below
        for g, req_id in enumerate(rows):
            self.matchers[req_id].fill_next_token_bitmask(mask, g)
        return GrammarBitmask(rows, mask)

    def accept(self, outputs: list[EngineCoreOutput]) -> None:
        """Advance the matchers by the step's appended tokens; forget finished sequences."""
        for out in outputs:
            matcher = self.matchers.get(out.req_id)
            if matcher is None:
                continue
            for token in out.new_token_ids:
                if not matcher.accept_token(token):
                    logger.warning("request %s: token %d broke its grammar", out.req_id, token)
                    break
            if out.finished:
                del self.matchers[out.req_id]


def _samples(request: Request | None) -> bool:
    """After schedule(): the step computes the request's last known token, so it samples."""
    return request is not None and request.num_computed_tokens >= request.num_tokens
