"""Turns per-step EngineCoreOutputs into RequestOutputs: text, stop strings, logprobs, n > 1."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from lightwell.engine.detokenizer import IncrementalDetokenizer
from lightwell.engine.tokenizer import Tokenizer
from lightwell.scheduler.output import EngineCoreOutput, TokenLogprobs
from lightwell.types import (
    CompletionOutput,
    FinishReason,
    ListPrefix,
    Logprob,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
)


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    final_only: bool = False  # emit one RequestOutput, when finished (offline generate)
    children: list[_Child] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    embedding: list[float] | None = None

    @property
    def finished(self) -> bool:
        return all(c.out.finish_reason is not None for c in self.children)


@dataclass
class _Child:
    req_id: str
    parent: _Parent
    detok: IncrementalDetokenizer | _NoText
    out: CompletionOutput


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.children: dict[str, _Child] = {}
        self.parents: dict[str, _Parent] = {}

    def add_request(
        self,
        request_id: str,
        child_ids: list[str],
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
        final_only: bool = False,
    ) -> None:
        metrics = RequestMetrics(arrival_time)
        parent = _Parent(request_id, prompt, prompt_token_ids, params, metrics, final_only)
        if params.prompt_logprobs is not None:
            parent.prompt_logprobs = [None]
        for i, cid in enumerate(child_ids):
            detok = (
                IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params)
                if self.tokenizer is not None
                else _NoText()
            )
            logprobs = [] if params.logprobs is not None else None
            cum = 0.0 if params.logprobs is not None else None
            out = CompletionOutput(i, "", [], cumulative_logprob=cum, logprobs=logprobs)
            child = _Child(cid, parent, detok, out)
            parent.children.append(child)
            self.children[cid] = child
        self.parents[request_id] = parent

    def has(self, request_id: str) -> bool:
        return request_id in self.parents

    def child_ids(self, request_id: str) -> list[str]:
        parent = self.parents.get(request_id)
        return [c.req_id for c in parent.children] if parent else []

    def mark_scheduled(self, child_ids: list[str], now: float) -> None:
        """Record when each request was first scheduled (its queue time ends there)."""
        for cid in child_ids:
            child = self.children.get(cid)
            if child is not None and child.parent.metrics.first_scheduled_time is None:
                child.parent.metrics.first_scheduled_time = now

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Returns the changed RequestOutputs and child ids stopped by a stop string."""
        now = time.time()
        touched: dict[str, _Parent] = {}
        stopped: list[str] = []
        for co in outputs:
            child = self.children.get(co.req_id)
            if child is None or child.out.finish_reason is not None:
                continue
            parent = child.parent
            touched[parent.request_id] = parent
            parent.num_cached_tokens = max(parent.num_cached_tokens, co.num_cached_tokens)
            if co.pooled is not None:
                parent.embedding = co.pooled
            first_child = child is parent.children[0]
            if co.new_prompt_logprobs and parent.prompt_logprobs is not None and first_child:
                parent.prompt_logprobs.extend(self._convert(co.new_prompt_logprobs))
            if co.new_token_ids and self._update_child(child, co, now):
                stopped.append(child.req_id)
        emitted = [self._emit(p) for p in touched.values() if p.finished or not p.final_only]
        return emitted, stopped

    def abort(self, request_id: str) -> RequestOutput | None:
        parent = self.parents.get(request_id)
        if parent is None:
            return None
        for c in parent.children:
            if c.out.finish_reason is None:
                c.out.finish_reason = FinishReason.ABORT
        return self._emit(parent)

    def _update_child(self, child: _Child, co: EngineCoreOutput, now: float) -> bool:
        out, m = child.out, child.parent.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        m.last_token_time = now
        m.token_times.append(now)
        out.token_ids.extend(co.new_token_ids)
        if out.logprobs is not None and co.new_logprobs:
            converted = self._convert(co.new_logprobs)
            out.logprobs.extend(converted)
            out.cumulative_logprob += sum(next(iter(p.values())).logprob for p in converted)
        stop_str = child.detok.update(
            co.new_token_ids, stop_terminated=co.finish_reason == FinishReason.STOP
        )
        by_stop_string = stop_str is not None
        if by_stop_string:
            out.finish_reason, out.stop_reason = FinishReason.STOP, stop_str
        elif co.finish_reason is not None:
            out.finish_reason, out.stop_reason = co.finish_reason, co.stop_reason
        out.text += child.detok.get_delta(finished=out.finish_reason is not None)
        return by_stop_string and co.finish_reason is None

    def _convert(self, items: list[TokenLogprobs]) -> list[PositionLogprobs]:
        piece = self.tokenizer.id_to_piece if self.tokenizer is not None else _no_piece
        return [
            {t: Logprob(lp, r, piece(t)) for t, lp, r in zip(x.token_ids, x.logprobs, x.ranks)}
            for x in items
        ]

    def _emit(self, parent: _Parent) -> RequestOutput:
        finished = parent.finished
        if finished:
            parent.metrics.finished_time = time.time()
            self.parents.pop(parent.request_id, None)
            for c in parent.children:
                self.children.pop(c.req_id, None)
        outs = [_snapshot(c.out, finished) for c in parent.children]
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=outs,
            finished=finished,
            prompt_logprobs=parent.prompt_logprobs,
            num_cached_tokens=parent.num_cached_tokens,
            metrics=parent.metrics,
            embedding=parent.embedding,
        )


class _NoText:
    """The detokenizer of an engine without a tokenizer: token ids only, no text."""

    def update(self, new_token_ids: list[int], stop_terminated: bool = False) -> None:
        return None

    def get_delta(self, finished: bool) -> str:
        return ""


def _no_piece(token_id: int) -> None:
    return None


def _snapshot(o: CompletionOutput, finished: bool) -> CompletionOutput:
    """The output as it is now: views of the growing lists while the request runs (a copy each
    step would make streaming O(tokens^2)), copies once it has finished."""
    keep = list if finished else _prefix
    return CompletionOutput(
        index=o.index,
        text=o.text,
        token_ids=keep(o.token_ids),
        cumulative_logprob=o.cumulative_logprob,
        logprobs=keep(o.logprobs) if o.logprobs is not None else None,
        finish_reason=o.finish_reason,
        stop_reason=o.stop_reason,
    )


def _prefix(items: list) -> ListPrefix:
    return ListPrefix(items, len(items))
