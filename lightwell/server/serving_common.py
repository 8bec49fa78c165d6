"""What /v1/completions and /v1/chat/completions share: errors, sampling params, submission,
usage, and the SSE response that aborts its requests when the client goes away."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from lightwell.engine.async_engine import AsyncEngine, EngineDeadError, RequestStream
from lightwell.server.observability import DISCONNECTED, current_request_id, note_stream_error
from lightwell.server.protocol import PromptTokensDetails, SamplingRequest, UsageInfo
from lightwell.types import (
    FinishReason,
    Logprob,
    RequestOutput,
    SamplingParams,
    StructuredOutputs,
)

T = TypeVar("T")

# Request fields copied one-to-one into SamplingParams when set.
_SAMPLING_FIELDS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "min_tokens",
    "ignore_eos",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "cache_salt",
)


class APIError(Exception):
    """An error answered with OpenAI's envelope ``{"error": {message, type, param, code}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        err = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return {"error": err}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


@dataclass
class ServingContext:
    """What a serving handler needs: the engine front, its tokenizer and limits, the name."""

    engine: AsyncEngine
    model_name: str
    tool_call_parser: str = "auto"  # --tool-call-parser
    aliases: tuple[str, ...] = ()  # further names of --served-model-name, accepted in `model`
    limits: Any = None  # a server.limits.ServerLimits (None: its defaults)

    @property
    def tokenizer(self) -> Any:
        """The tokenizer; a 400 when the engine has none (--skip-tokenizer-init)."""
        self.require_text()
        return self.engine.engine.tokenizer

    @property
    def has_text(self) -> bool:
        return self.engine.engine.tokenizer is not None

    def require_text(self) -> None:
        if not self.has_text:
            raise bad_request(
                "this server runs without a tokenizer: send prompts as token ids; text, chat, "
                "echo and tokenize are unavailable"
            )

    def piece(self, token_id: int) -> str:
        """The text of one token (``token_id:N`` without a tokenizer, as vLLM writes it)."""
        if not self.has_text:
            return f"token_id:{token_id}"
        return self.tokenizer.id_to_piece(token_id)

    @property
    def max_model_len(self) -> int:
        return self.engine.engine.max_model_len

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name and model not in self.aliases:
            raise APIError(
                404,
                f"The model {_clip(model)} does not exist; this server serves '{self.model_name}'",
                param="model",
                code="model_not_found",
            )


def _clip(value: object, limit: int = 64) -> str:
    """A request value in an error message: escaped (repr), at most ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def new_id(prefix: str) -> str:
    """``prefix-<the HTTP request's id>`` (its X-Request-Id, or a random one)."""
    return f"{prefix}-{current_request_id() or uuid.uuid4().hex}"


def sampling_params(ctx: ServingContext, req: SamplingRequest, **overrides: Any) -> SamplingParams:
    """The request's SamplingParams over the model's defaults; bad values are 400s."""
    kw = {k: getattr(req, k) for k in _SAMPLING_FIELDS if getattr(req, k) is not None}
    if req.logit_bias:
        kw["logit_bias"] = {int(k): v for k, v in req.logit_bias.items()}
    kw.update({k: v for k, v in overrides.items() if v is not None or k == "max_tokens"})
    structured = req.structured_spec()
    if structured is not None:
        field, spec = structured
        try:
            kw["structured_outputs"] = StructuredOutputs(**spec)
        except ValueError as e:
            raise bad_request(f"{field}: {e}", param=field) from None
    try:
        return ctx.engine.engine.default_sampling_params(**kw)
    except (ValueError, TypeError) as e:
        raise bad_request(str(e), param=param_in(str(e))) from None


async def compile_grammar(
    ctx: ServingContext, req: SamplingRequest, params: SamplingParams, field: str | None = None
) -> None:
    """Compile the request's grammar (structured output) off the event loop, before queueing:
    one the engine cannot compile is a 400 that says why; the engine then finds it cached."""
    if params.structured_outputs is None:
        return
    ctx.require_text()
    try:
        await asyncio.to_thread(ctx.engine.engine.structured.validate, params)
    except ValueError as e:
        if field is None:
            structured = req.structured_spec()
            field = structured[0] if structured else "structured_outputs"
        raise bad_request(f"{field}: {e}", param=field) from None


_PARAMS = {*_SAMPLING_FIELDS, "logit_bias", "max_tokens", "logprobs", "prompt_logprobs", "prompt"}


def param_in(message: str) -> str | None:
    """The request field an engine error message starts with ("top_p must be ..."), if any."""
    first = message.split(" ", 1)[0]
    return first if first in _PARAMS else None


def check_prompt_fits(
    ctx: ServingContext, num_prompt_tokens: int, max_tokens: int | None, prompt_param: str
) -> None:
    """400 unless the prompt leaves room for the output (and for max_tokens, when given)."""
    limit = ctx.max_model_len
    if num_prompt_tokens == 0:
        raise bad_request(f"'{prompt_param}' is empty: give at least one token", prompt_param)
    if num_prompt_tokens >= limit:
        raise bad_request(
            f"This model's maximum context length is {limit} tokens, but '{prompt_param}' is "
            f"{num_prompt_tokens} tokens long (at least one token must be left for the output).",
            param=prompt_param,
        )
    if max_tokens is not None and num_prompt_tokens + max_tokens > limit:
        raise bad_request(
            f"This model's maximum context length is {limit} tokens, but {num_prompt_tokens} "
            f"prompt tokens + max_tokens={max_tokens} = {num_prompt_tokens + max_tokens}. "
            "Reduce the prompt or max_tokens.",
            param="max_tokens",
        )


async def submit(
    ctx: ServingContext,
    base_id: str,
    prompts: list[list[int]],
    params: SamplingParams,
    stream: bool = True,
) -> list[RequestStream]:
    """Add one engine request per prompt, all in the same engine iteration; if any is refused,
    abort the others and raise (400 for a ValueError, 503 if the engine is gone). Without
    ``stream`` each request yields only its final output."""
    from lightwell.server.limits import admit  # (limits builds on this module)

    admit(ctx, len(prompts), params.n)
    ids = [base_id] if len(prompts) == 1 else [f"{base_id}-{i}" for i in range(len(prompts))]
    adds = [
        ctx.engine.add_request(r, {"prompt_token_ids": p}, params, final_only=not stream)
        for r, p in zip(ids, prompts)
    ]
    results = await asyncio.gather(*adds, return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if not errors:
        return results  # type: ignore[return-value]
    for r in results:
        if isinstance(r, RequestStream):
            ctx.engine.abort(r.request_id)
    e = errors[0]
    if isinstance(e, EngineDeadError):
        raise engine_dead(str(e))
    if isinstance(e, ValueError):
        raise bad_request(str(e), param=param_in(str(e)))
    raise e


async def merged(ctx: ServingContext, streams: list[RequestStream]) -> AsyncIterator[tuple]:
    """(prompt index, output) from all streams as they arrive; aborts all of them on exit."""
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in ctx.engine.iterate(stream):
                queue.put_nowait((i, out))
        except Exception as e:  # noqa: BLE001 - forwarded to the consumer
            queue.put_nowait((i, e))
        queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            if not s.finished:
                ctx.engine.abort(s.request_id)


async def collect(ctx: ServingContext, streams: list[RequestStream]) -> list[RequestOutput]:
    """The final output of each stream, in order."""
    finals: list[RequestOutput | None] = [None] * len(streams)
    async with contextlib.aclosing(merged(ctx, streams)) as outputs:
        async for i, out in outputs:
            finals[i] = out
    return finals  # type: ignore[return-value]


def usage(finals: list[RequestOutput]) -> UsageInfo:
    prompt = sum(len(o.prompt_token_ids) for o in finals)
    completion = sum(len(c.token_ids) for o in finals for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in finals)
    return UsageInfo(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


def finish_reason(reason: FinishReason | None) -> str | None:
    return None if reason is None else str(reason)


def ranked(position: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The top-k alternatives at one position, most likely first."""
    return sorted(position.items(), key=lambda kv: kv[1].rank)[:k]


def sse(payload: str) -> bytes:
    return f"data: {payload}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"


def sse_error(error: APIError) -> bytes:
    note_stream_error(error.status)
    return sse(json.dumps(error.body()))


class SSEResponse(StreamingResponse):
    """Streams ``data:`` events; a client disconnect cancels the producer at once, which aborts
    its engine requests (their KV blocks are free before the next step)."""

    media_type = "text/event-stream"

    def __init__(self, chunks: AsyncIterator[bytes]) -> None:
        super().__init__(chunks, headers={"Cache-Control": "no-cache"})
        self.chunks = chunks

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        producer = asyncio.create_task(self._produce(send))
        watcher = asyncio.create_task(_wait_disconnect(receive))
        try:
            await asyncio.wait({producer, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if watcher.done() and not producer.done():
                scope[DISCONNECTED] = True
        except asyncio.CancelledError:  # the server's shutdown deadline: end the stream properly
            await self._cut(producer, send)
        finally:
            for task in (producer, watcher):
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await producer

    async def _cut(self, producer: asyncio.Task, send: Send) -> None:
        """Stop the producer (aborting its requests); an error event and [DONE] close the body."""
        producer.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await producer
        err = APIError(
            503, "the server shut down before this request finished", "server_error", None,
            "shutdown",
        )  # fmt: skip
        body = sse_error(err) + SSE_DONE
        with contextlib.suppress(Exception):
            await send({"type": "http.response.body", "body": body, "more_body": False})

    async def _produce(self, send: Send) -> None:
        start = {"type": "http.response.start", "status": 200, "headers": self.raw_headers}
        try:
            await send(start)
            async for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await self.chunks.aclose()  # type: ignore[attr-defined]


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; cancel it (aborting its requests) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.create_task(_wait_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            raise APIError(499, "client disconnected", code="client_closed")
        return task.result()
    finally:
        task.cancel()
        watcher.cancel()


def engine_dead(message: str) -> APIError:
    """The 503 of a server whose engine loop has stopped."""
    return APIError(503, message, type="server_error", code="engine_dead")
