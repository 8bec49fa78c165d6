"""What keeps one client from hurting the others: the API key on every route but /health, the
request body size limit, lone-surrogate text refused, CORS (off unless asked), the per-request
sequence and queue limits (429 with Retry-After), the request timeout, and error text that
never echoes a request verbatim."""

from __future__ import annotations

import asyncio
import hmac
import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from lightwell.server.serving_common import (
    SSE_DONE,
    APIError,
    ServingContext,
    SSEResponse,
    sse_error,
)


def _opt(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class ServerLimits:
    max_request_body_mb: float = _opt(
        8.0, "Largest request body in MiB; a larger one is refused with a 413 before it is read."
    )
    max_sequences_per_request: int = _opt(
        256, "Most sequences one request may ask for (prompts x n); more is a 400."
    )
    max_waiting_requests: int = _opt(
        1024,
        "Most sequences waiting for their first step; a request that would pass it gets a 429 "
        "with Retry-After (the client retries later) instead of queueing without end.",
    )
    request_timeout: float = _opt(
        0.0,
        "Seconds a request may take in all (queue + generation) before it is aborted: a 504, "
        "or an error event and [DONE] in a stream. 0: no limit.",
    )
    allowed_origins: str | None = _opt(
        None,
        "CORS: comma-separated origins browsers may call the API from (* for any). Default: "
        "no CORS headers (browsers on other origins are refused).",
    )
    public_metrics: bool = _opt(
        False,
        "Serve /metrics without the API key (for a Prometheus scraper inside the cluster); "
        "otherwise, with --api-key set, every route but /health needs the key.",
    )

    def validate(self) -> None:
        if not self.max_request_body_mb > 0:
            raise ValueError("max_request_body_mb must be > 0")
        if self.max_sequences_per_request < 1 or self.max_waiting_requests < 1:
            raise ValueError("max_sequences_per_request and max_waiting_requests must be >= 1")
        if not 0 <= self.request_timeout < float("inf"):
            raise ValueError("request_timeout must be >= 0 (0: no limit)")


class TooBusy(APIError):
    """A 429 that tells the client when to retry."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(429, message, type="rate_limit_error", code="queue_full")
        self.headers = {"Retry-After": str(retry_after)}


def admit(ctx: ServingContext, num_prompts: int, n: int) -> None:
    """400 for a request of too many sequences; 429 when the queue is full."""
    limits: ServerLimits = getattr(ctx, "limits", None) or ServerLimits()
    seqs = num_prompts * n
    if seqs > limits.max_sequences_per_request:
        raise APIError(
            400,
            f"this request asks for {seqs} sequences (prompts x n); this server allows "
            f"{limits.max_sequences_per_request} per request",
            param="n",
        )
    waiting = ctx.engine.stats.num_waiting
    if waiting + seqs > limits.max_waiting_requests:
        raise TooBusy(f"the server is busy ({waiting} sequences waiting); retry later")


async def limited(ctx: ServingContext, work: Any) -> Any:
    """A route's work under the request timeout: a response whole, or a stream guarded."""
    result = await with_timeout(ctx, work)
    if isinstance(result, SSEResponse):
        result.chunks = guard_stream(ctx, result.chunks)
    return result


async def with_timeout(ctx: ServingContext, work: Any) -> Any:
    """``work`` under the request timeout (a 504 when it runs out)."""
    timeout = _timeout(ctx)
    if not timeout:
        return await work
    try:
        return await asyncio.wait_for(work, timeout)
    except TimeoutError:
        raise _timed_out(timeout) from None


async def guard_stream(ctx: ServingContext, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """A stream under the request timeout: cut, it ends with an error event and [DONE]."""
    timeout = _timeout(ctx)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout if timeout else None
    try:
        while True:
            left = None if deadline is None else max(deadline - loop.time(), 0.001)
            try:
                chunk = await asyncio.wait_for(anext(chunks), left)
            except StopAsyncIteration:
                return
            except TimeoutError:
                yield sse_error(_timed_out(timeout))
                yield SSE_DONE
                return
            yield chunk
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]


def _timeout(ctx: ServingContext) -> float:
    limits: ServerLimits = getattr(ctx, "limits", None) or ServerLimits()
    return limits.request_timeout


def _timed_out(timeout: float) -> APIError:
    return APIError(
        504, f"the request took longer than {timeout:g} s and was aborted", type="timeout",
        code="request_timeout",
    )  # fmt: skip


# ---- the ASGI middleware ----------------------------------------------------------------------
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")


class LimitsMiddleware:
    """Pure ASGI: the API key, the body size limit and lone surrogates, answered before any
    route runs (in OpenAI's error envelope)."""

    def __init__(
        self, app: ASGIApp, api_key: str | None, limits: ServerLimits, metrics_path: str = ""
    ) -> None:
        self.app, self.api_key, self.limits = app, api_key, limits
        self.open_paths = {"/health", metrics_path} if limits.public_metrics else {"/health"}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        if self.api_key and scope["path"] not in self.open_paths:
            err = self._auth_error(headers.get(b"authorization", b"").decode("latin-1"))
            if err is not None:
                await _send_error(send, err)
                return
        body = await self._read_body(headers, receive, send)
        if body is None:
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _auth_error(self, auth: str) -> APIError | None:
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not token:
            return APIError(
                401, "Missing API key: send 'Authorization: Bearer <key>'.", code="invalid_api_key"
            )
        if not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):  # type: ignore[union-attr]
            return APIError(401, "Incorrect API key provided.", code="invalid_api_key")
        return None

    async def _read_body(self, headers: dict, receive: Receive, send: Send) -> bytes | None:
        """The whole body, or None after answering (too large, bad text, client gone)."""
        limit = int(self.limits.max_request_body_mb * (1 << 20))
        too_large = APIError(
            413,
            f"the request body is larger than {self.limits.max_request_body_mb:g} MiB",
            code="request_too_large",
        )
        declared = headers.get(b"content-length", b"0")
        if declared.isdigit() and int(declared) > limit:
            await _send_error(send, too_large)
            return None
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await _send_error(send, too_large)
                return None
            chunks.append(chunk)
            if not message.get("more_body"):
                break
        body = b"".join(chunks)
        if _SURROGATE.search(body) and _has_lone_surrogate(body):
            await _send_error(
                send,
                APIError(400, "the request holds a lone UTF-16 surrogate (\\ud800-\\udfff) "
                         "that is not valid Unicode text", code="invalid_text"),
            )  # fmt: skip
            return None
        return body


def _has_lone_surrogate(body: bytes) -> bool:
    try:
        data = json.loads(body)
    except ValueError:
        return False  # the route answers invalid JSON itself
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


async def _send_error(send: Send, err: APIError) -> None:
    body = json.dumps(err.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in getattr(err, "headers", {}).items()]
    if err.status == 413:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def cors_origins(limits: ServerLimits) -> list[str]:
    return [o.strip() for o in (limits.allowed_origins or "").split(",") if o.strip()]
