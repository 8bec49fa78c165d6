"""The engine's side of structured output: one xgrammar matcher per constrained sequence (n > 1:
one per sample), the token bitmask of each step's constrained rows, and the matchers' advance as
tokens come back.

Matchers follow the scheduler's tokens, not the worker's: a matcher accepts exactly the tokens
``Scheduler.update`` appended, so a preempted request (whose output tokens stay, to be
recomputed) keeps its matcher as is, and prefix caching never touches it. The mask of a step is
filled once every constrained row's previous token is accepted: the plain loop fills it when it
schedules the step; the overlapped loop launches the step's forward first and fills the mask
while it runs, once the step before has been applied (``OverlapLoop``). The whole batch's rows
are filled into one buffer kept across steps (with ``grammar_fill_threads`` > 1, by xgrammar's
``BatchGrammarMatcher`` on that many threads).
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
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: list[int],
        cache_size: int = 256,
        fill_threads: int = 1,
    ) -> None:
        """``tokenizer``: the engine's ``Tokenizer`` (None: structured output is refused);
        ``vocab_size``: the logits' width (it may exceed the tokenizer's); ``stop_token_ids``:
        the ids that end a request (EOS and generation_config's), which end a grammar too;
        ``fill_threads``: threads that fill a step's bitmask (1: the engine thread alone)."""
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self._cache_size = cache_size
        self._cache: GrammarCache | None = None
        self._lock = threading.Lock()
        self.matchers: dict[str, Any] = {}  # req_id -> xgrammar.GrammarMatcher
        self._fill_threads = fill_threads
        self._batch_matcher: Any = None  # xgrammar.BatchGrammarMatcher, fill_threads > 1
        self._mask: Any = None  # [rows, W] int32 numpy buffer, grown to the largest batch

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

    def rows(self, sched: SchedulerOutput, requests: dict[str, Request]) -> list[str]:
        """The step's constrained rows that sample (their prefill ends in this step)."""
        return [
            r
            for r in sched.num_scheduled_tokens
            if r in self.matchers and _samples(requests.get(r))
        ]

    def bitmask(
        self, sched: SchedulerOutput, requests: dict[str, Request]
    ) -> GrammarBitmask | None:
        """The allowed tokens of the step's constrained rows that sample, or None when there
        are none. The array is a view of a buffer the next call overwrites: the step consumes
        it first (the sampler copies it to the device before the next step is filled)."""
        rows = self.rows(sched, requests)
        if not rows:
            return None
        mask = self._buffer(len(rows))  # [G, W], every row filled below
        matchers = [self.matchers[r] for r in rows]
        if self._fill_threads > 1:
            self._batch().batch_fill_next_token_bitmask(matchers, mask)
        else:
            for g, matcher in enumerate(matchers):
                matcher.fill_next_token_bitmask(mask, g)
        return GrammarBitmask(rows, mask)

    def _buffer(self, num_rows: int) -> Any:
        import numpy as np

        if self._mask is None or self._mask.shape[0] < num_rows:
            words = (self._vocab_size + 31) // 32
            self._mask = np.empty((max(num_rows, 64), words), dtype=np.int32)
        return self._mask[:num_rows]

    def _batch(self) -> Any:
        if self._batch_matcher is None:
            import xgrammar as xgr

            self._batch_matcher = xgr.BatchGrammarMatcher(self._fill_threads)
        return self._batch_matcher

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
