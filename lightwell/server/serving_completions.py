"""POST /v1/completions: protocol <-> engine types, streamed as SSE or answered whole."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.responses import Response

from lightwell.engine.async_engine import EngineDeadError
from lightwell.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from lightwell.server.serving_common import (
    SSE_DONE,
    ServingContext,
    SSEResponse,
    bad_request,
    check_prompt_fits,
    collect,
    compile_grammar,
    engine_dead,
    finish_reason,
    merged,
    new_id,
    ranked,
    sampling_params,
    sse,
    sse_error,
    submit,
    until_disconnect,
    usage,
)
from lightwell.types import CompletionOutput, PositionLogprobs, RequestOutput


@dataclass
class _Prompt:
    token_ids: list[int]
    text: str | None  # None when given as token ids


async def create_completion(
    ctx: ServingContext, req: CompletionRequest, raw: Request
) -> CompletionResponse | Response:
    ctx.check_model(req.model)
    if req.echo:
        ctx.require_text()
    # off the event loop: a long prompt must not stall the other streams
    prompts = await asyncio.to_thread(lambda: [_tokenize(ctx, p) for p in req.prompt_list()])
    explicit_max = req.max_tokens if "max_tokens" in req.model_fields_set else None
    for p in prompts:
        check_prompt_fits(ctx, len(p.token_ids), explicit_max, "prompt")
    echo_logprobs = req.logprobs if req.echo and req.logprobs is not None else None
    best_of = req.best_of if req.best_of is not None and req.best_of > (req.n or 1) else None
    params = sampling_params(
        ctx,
        req,
        max_tokens=req.max_tokens,
        logprobs=req.logprobs if best_of is None else (req.logprobs or 0),  # ranks best_of
        prompt_logprobs=echo_logprobs,
        n=best_of,
    )
    await compile_grammar(ctx, req, params)
    request_id = new_id("cmpl")
    token_ids = [p.token_ids for p in prompts]
    streams = await submit(ctx, request_id, token_ids, params, stream=bool(req.stream))
    if req.stream:
        return SSEResponse(_stream(ctx, req, request_id, prompts, streams))
    finals = await until_disconnect(raw, collect(ctx, streams))
    n = req.n or 1
    choices = [
        _choice(ctx, req, prompts[i], out, c, i * n + j)
        for i, out in enumerate(finals)
        for j, c in enumerate(_best(out.outputs, n))
    ]
    return CompletionResponse(
        id=request_id, model=ctx.model_name, choices=choices, usage=usage(finals)
    )


def _tokenize(ctx: ServingContext, prompt: str | list[int]) -> _Prompt:
    if isinstance(prompt, str):
        return _Prompt(ctx.tokenizer.encode(prompt), prompt)
    try:
        ctx.engine.engine.check_token_ids(prompt)
    except ValueError as e:
        raise bad_request(str(e), "prompt") from None
    return _Prompt(list(prompt), None)


def _prompt_text(ctx: ServingContext, p: _Prompt) -> str:
    if p.text is not None:
        return p.text
    return ctx.tokenizer.decode(p.token_ids, skip_special_tokens=False)


def _best(outputs: list[CompletionOutput], n: int) -> list[CompletionOutput]:
    """best_of > n: the n samples of highest cumulative logprob, best first."""
    if len(outputs) <= n:
        return outputs
    return sorted(outputs, key=lambda c: -(c.cumulative_logprob or 0.0))[:n]


def _choice(
    ctx: ServingContext,
    req: CompletionRequest,
    prompt: _Prompt,
    out: RequestOutput,
    c: CompletionOutput,
    index: int,
) -> CompletionChoice:
    prefix = _prompt_text(ctx, prompt) if req.echo else ""
    logprobs = None
    if req.logprobs is not None:
        logprobs = CompletionLogprobs()
        offset = 0
        if req.echo:
            positions = out.prompt_logprobs or []
            offset = _add_logprobs(ctx, logprobs, prompt.token_ids, positions, req.logprobs, 0)
        _add_logprobs(ctx, logprobs, c.token_ids, c.logprobs or [], req.logprobs, offset)
    return CompletionChoice(
        index=index,
        text=prefix + c.text,
        logprobs=logprobs,
        finish_reason=finish_reason(c.finish_reason),
    )


def _add_logprobs(
    ctx: ServingContext,
    into: CompletionLogprobs,
    token_ids: list[int],
    positions: list[PositionLogprobs | None],
    num_top: int,
    offset: int,
) -> int:
    """Append OpenAI's legacy logprobs for these tokens; returns the next text offset."""
    piece = ctx.piece
    for i, tid in enumerate(token_ids):
        pos = positions[i] if i < len(positions) else None
        token = piece(tid)
        into.tokens.append(token)
        into.text_offset.append(offset)
        offset += len(token)
        if pos is None:
            into.token_logprobs.append(None)
            into.top_logprobs.append(None)
            continue
        chosen = pos.get(tid) or next(iter(pos.values()))
        into.token_logprobs.append(chosen.logprob)
        # The sampled token and the top num_top alternatives, as OpenAI (and vLLM) return them.
        top = {piece(t): lp.logprob for t, lp in ranked(pos, num_top)}
        top.setdefault(token, chosen.logprob)
        into.top_logprobs.append(top)
    return offset


@dataclass
class _ChoiceState:
    chars: int = 0  # output characters sent
    tokens: int = 0  # output tokens whose logprobs were sent
    offset: int = 0  # text offset of the next token
    started: bool = False
    done: bool = False


@dataclass
class _StreamState:
    choices: dict[int, _ChoiceState] = field(default_factory=dict)
    created: int = field(default_factory=lambda: int(time.time()))


async def _stream(
    ctx: ServingContext,
    req: CompletionRequest,
    request_id: str,
    prompts: list[_Prompt],
    streams: list,
) -> AsyncIterator[bytes]:
    state = _StreamState()
    n = req.n or 1
    finals: dict[int, RequestOutput] = {}
    try:
        async with contextlib.aclosing(merged(ctx, streams)) as outputs:
            async for i, out in outputs:
                finals[i] = out
                for c in out.outputs:
                    choice = _delta_choice(ctx, req, prompts[i], out, c, state, i * n + c.index)
                    if choice is not None:
                        yield _chunk(ctx, request_id, state, [choice], None)
        if req.include_usage:
            yield _chunk(ctx, request_id, state, [], usage(list(finals.values())))
    except EngineDeadError as e:
        yield sse_error(engine_dead(str(e)))
    yield SSE_DONE


def _chunk(ctx: ServingContext, request_id: str, state: _StreamState, choices, use) -> bytes:
    resp = CompletionResponse(
        id=request_id, created=state.created, model=ctx.model_name, choices=choices, usage=use
    )
    return sse(resp.model_dump_json(exclude={"usage"} if use is None else None))


def _delta_choice(
    ctx: ServingContext,
    req: CompletionRequest,
    prompt: _Prompt,
    out: RequestOutput,
    c: CompletionOutput,
    state: _StreamState,
    index: int,
) -> CompletionChoice | None:
    st = state.choices.setdefault(index, _ChoiceState())
    if st.done or not (c.token_ids or c.finished):
        return None
    delta = c.text[st.chars :]
    echo = req.echo and not st.started
    no_news = not delta and not c.finished and not echo
    if no_news and (ctx.has_text or len(c.token_ids) == st.tokens):
        return None  # text held back (partial character or possible stop string)
    prefix = _prompt_text(ctx, prompt) if echo else ""
    logprobs = None
    if req.logprobs is not None:
        logprobs = CompletionLogprobs()
        if echo:
            positions = out.prompt_logprobs or []
            st.offset = _add_logprobs(
                ctx, logprobs, prompt.token_ids, positions, req.logprobs, st.offset
            )
        new_ids, new_lps = c.token_ids[st.tokens :], (c.logprobs or [])[st.tokens :]
        st.offset = _add_logprobs(ctx, logprobs, new_ids, new_lps, req.logprobs, st.offset)
    st.chars, st.tokens, st.started, st.done = len(c.text), len(c.token_ids), True, c.finished
    return CompletionChoice(
        index=index,
        text=prefix + delta,
        logprobs=logprobs,
        finish_reason=finish_reason(c.finish_reason),
    )
