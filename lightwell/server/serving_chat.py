"""POST /v1/chat/completions: the model's chat template, then the engine; SSE or whole."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from lightwell.engine.async_engine import EngineDeadError
from lightwell.server import serving_tools as tools
from lightwell.server.protocol import (
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    DeltaMessage,
    TopLogprob,
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


def chat_prompt_ids(
    ctx: ServingContext, messages: list[ChatMessage], add_gen: bool, tools: list | None = None
) -> list[int]:
    """The model's chat template applied to the messages (and tools); template errors are 400s."""
    rendered = [m.to_template() for m in messages]
    tokenizer = ctx.tokenizer
    kw = {} if tools is None else {"tools": tools}
    try:
        return tokenizer.apply_chat_template(rendered, add_generation_prompt=add_gen, **kw)
    except Exception as e:  # noqa: BLE001 - Jinja raises its own types; all are the client's
        raise bad_request(f"could not apply the chat template: {e}", param="messages") from None


async def create_chat_completion(
    ctx: ServingContext, req: ChatCompletionRequest, raw: Request
) -> ChatCompletionResponse | Response:
    ctx.check_model(req.model)
    setup = _tool_setup(ctx, req)
    # off the event loop: a long conversation must not stall the other streams
    prompt_ids = await asyncio.to_thread(
        chat_prompt_ids, ctx, req.messages, True, tools.template_tools(req)
    )
    check_prompt_fits(ctx, len(prompt_ids), req.max_output_tokens, "messages")
    keep_special = setup.parser is not None and setup.parser.needs_special_tokens
    params = sampling_params(
        ctx,
        req,
        max_tokens=req.max_output_tokens,
        logprobs=(req.top_logprobs or 0) if req.logprobs else None,
        structured_outputs=tools.tool_constraint(req, setup),
        skip_special_tokens=False if keep_special and req.skip_special_tokens is None else None,
    )
    await compile_grammar(
        ctx, req, params, "tools" if setup.mode in ("required", "named") else None
    )
    request_id = new_id("chatcmpl")
    streams = await submit(ctx, request_id, [prompt_ids], params, stream=bool(req.stream))
    if req.stream:
        return SSEResponse(_stream(ctx, req, request_id, streams, setup))
    (final,) = await until_disconnect(raw, collect(ctx, streams))
    choices = [_choice(ctx, req, setup, c) for c in final.outputs]
    return ChatCompletionResponse(
        id=request_id, model=ctx.model_name, choices=choices, usage=usage([final])
    )


def _tool_setup(ctx: ServingContext, req: ChatCompletionRequest) -> tools.ToolSetup:
    template = ctx.tokenizer.chat_template if req.tool_mode == "auto" else None
    try:
        return tools.tool_setup(req, ctx.tool_call_parser, template)
    except ValueError as e:
        raise bad_request(str(e), param="tool_choice") from None


def _choice(
    ctx: ServingContext, req: ChatCompletionRequest, setup: tools.ToolSetup, c: CompletionOutput
) -> ChatChoice:
    parsed = tools.parse_output(setup, c.text)
    return ChatChoice(
        index=c.index,
        message=ChatResponseMessage(content=parsed.content, tool_calls=tools.tool_calls(parsed)),
        logprobs=_logprobs(ctx, req, c.token_ids, c.logprobs) if req.logprobs else None,
        finish_reason=tools.finish_reason(setup, parsed, finish_reason(c.finish_reason)),
    )


def _logprobs(
    ctx: ServingContext,
    req: ChatCompletionRequest,
    token_ids: list[int],
    positions: list[PositionLogprobs] | None,
) -> ChatChoiceLogprobs:
    piece = ctx.piece
    k = req.top_logprobs or 0
    content = []
    for tid, pos in zip(token_ids, positions or []):
        chosen = pos.get(tid) or next(iter(pos.values()))
        token = piece(tid)
        top = [_top(piece(t), lp.logprob) for t, lp in ranked(pos, k)]
        content.append(
            ChatTokenLogprob(
                token=token,
                logprob=chosen.logprob,
                bytes=list(token.encode("utf-8")),
                top_logprobs=top,
            )
        )
    return ChatChoiceLogprobs(content=content)


def _top(token: str, logprob: float) -> TopLogprob:
    return TopLogprob(token=token, logprob=logprob, bytes=list(token.encode("utf-8")))


@dataclass
class _ChoiceState:
    chars: int = 0
    tokens: int = 0
    started: bool = False  # the role was sent (with the first text)
    done: bool = False
    tools: tools.ToolStream | None = None  # tool calling: the text goes through it


@dataclass
class _StreamState:
    request_id: str
    include_usage: bool
    setup: tools.ToolSetup
    choices: dict[int, _ChoiceState] = field(default_factory=dict)
    created: int = field(default_factory=lambda: int(time.time()))


async def _stream(
    ctx: ServingContext,
    req: ChatCompletionRequest,
    request_id: str,
    streams: list,
    setup: tools.ToolSetup,
) -> AsyncIterator[bytes]:
    state = _StreamState(request_id, req.include_usage, setup)
    final: RequestOutput | None = None
    try:
        async with contextlib.aclosing(merged(ctx, streams)) as outputs:
            async for _, out in outputs:
                final = out
                for c in out.outputs:
                    choice = _delta_choice(ctx, req, c, state)
                    if choice is not None:
                        yield _chunk(ctx, state, [choice], None)
        if req.include_usage and final is not None:
            yield _chunk(ctx, state, [], usage([final]))
    except EngineDeadError as e:
        yield sse_error(engine_dead(str(e)))
    yield SSE_DONE


def _delta_choice(
    ctx: ServingContext, req: ChatCompletionRequest, c: CompletionOutput, state: _StreamState
) -> ChatStreamChoice | None:
    st = state.choices.get(c.index)
    if st is None:
        st = state.choices[c.index] = _ChoiceState()
        if state.setup.mode != "none":
            st.tools = tools.ToolStream(state.setup)
    delta_text, calls = c.text[st.chars :], None
    if st.done or (not delta_text and not c.finished):
        return None  # nothing new, or text held back (partial character / possible stop)
    if st.tools is not None:
        delta_text, calls = st.tools.delta(c.text, c.finished)
        if not delta_text and not calls and not c.finished:
            return None  # held back: maybe the start of a tool call
    delta = DeltaMessage(content=delta_text or None, tool_calls=calls)
    if not st.started:  # the first chunk of a choice carries the role and the first text
        delta.role = "assistant"
        delta.content = delta_text or ("" if calls is None else None)
    logprobs = None
    if req.logprobs:
        new_lps = (c.logprobs or [])[st.tokens :]
        logprobs = _logprobs(ctx, req, c.token_ids[st.tokens :], new_lps)
    st.chars, st.tokens, st.started, st.done = len(c.text), len(c.token_ids), True, c.finished
    reason = finish_reason(c.finish_reason)
    if st.tools is not None and st.tools.parsed is not None:
        reason = tools.finish_reason(state.setup, st.tools.parsed, reason)
    return ChatStreamChoice(index=c.index, delta=delta, logprobs=logprobs, finish_reason=reason)


def _chunk(ctx: ServingContext, state: _StreamState, choices: list, use: Any) -> bytes:
    chunk = ChatCompletionChunk(
        id=state.request_id,
        created=state.created,
        model=ctx.model_name,
        choices=choices,
        usage=use,
    )
    data = chunk.model_dump(mode="json")
    if not state.include_usage:
        data.pop("usage")
    for choice in data["choices"]:
        choice["delta"] = delta = {k: v for k, v in choice["delta"].items() if v is not None}
        for call in delta.get("tool_calls", []):  # as OpenAI: a piece carries only what is new
            for k in [k for k, v in call.items() if v is None]:
                del call[k]
            call["function"] = {k: v for k, v in call["function"].items() if v is not None}
    return sse(json.dumps(data, separators=(",", ":"), ensure_ascii=False))
