"""One streamed OpenAI request, timed chunk by chunk (SSE over aiohttp).

Every SSE chunk that carries a choice is a token arrival, as in vLLM's `bench serve`: the first
one sets TTFT, each later one adds an inter-token gap, the last one sets E2E. A chunk with only
``usage`` (``stream_options.include_usage``) gives the output token count.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from lightwell.bench.datasets import SampleRequest
from lightwell.bench.metrics import RequestResult

CHAT_ENDPOINT = "/v1/chat/completions"
COMPLETIONS_ENDPOINT = "/v1/completions"


class ServerUnreachable(RuntimeError):
    """The server could not be reached or did not answer as an OpenAI server."""


@dataclass
class RequestConfig:
    base_url: str
    endpoint: str
    model: str
    api_key: str | None = None
    ignore_eos: bool = False
    temperature: float = 0.0
    extra_body: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + self.endpoint

    @property
    def is_chat(self) -> bool:
        return self.endpoint.rstrip("/").endswith("chat/completions")

    def headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h


def build_payload(cfg: RequestConfig, req: SampleRequest) -> dict[str, Any]:
    """The JSON body of one streamed request."""
    body: dict[str, Any] = {
        "model": cfg.model,
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.is_chat:
        if not isinstance(req.prompt, str):
            raise ValueError("the chat endpoint takes text prompts only (not token ids)")
        body["messages"] = [{"role": "user", "content": req.prompt}]
        body["max_completion_tokens"] = req.output_len
    else:
        body["prompt"] = req.prompt
        body["max_tokens"] = req.output_len
    body.update(cfg.extra_body)
    return body


def _chunk_text(choice: dict[str, Any], is_chat: bool) -> str:
    if is_chat:
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


async def send_request(
    session: aiohttp.ClientSession, cfg: RequestConfig, req: SampleRequest, t0: float
) -> RequestResult:
    """Send one request and time its stream; ``t0`` is the benchmark's start (perf_counter)."""
    result = RequestResult(prompt_len=req.prompt_len)
    payload = build_payload(cfg, req)
    st = time.perf_counter()
    result.start_time = st - t0
    last = st
    try:
        async with session.post(cfg.url, json=payload, headers=cfg.headers()) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:500]}"
                return result
            async for raw in resp.content:
                chunk = _sse_data(raw)
                if chunk is None:
                    continue
                if chunk == "[DONE]":
                    break
                now = time.perf_counter()
                data = json.loads(chunk)
                if data.get("error"):
                    result.error = json.dumps(data["error"])[:500]
                    break
                choices = data.get("choices")
                if choices:
                    if not result.success:
                        result.success = True
                        result.ttft = now - st
                    else:
                        result.itl.append(now - last)
                    last = now
                    result.generated_text += _chunk_text(choices[0], cfg.is_chat)
                usage = data.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    result.output_tokens = int(usage["completion_tokens"])
        if result.error:
            result.success = False
        elif not result.success:
            result.error = "the stream ended without a single token chunk"
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError, ValueError) as e:
        result.success = False
        result.error = f"{type(e).__name__}: {e}"
    result.latency = (last if result.success else time.perf_counter()) - st
    return result


def _sse_data(raw: bytes) -> str | None:
    line = raw.decode("utf-8", errors="replace").strip()
    if not line.startswith("data:"):
        return None  # blank separators, comments (": ping"), event: lines
    return line[len("data:") :].strip()


async def fetch_models(session: aiohttp.ClientSession, base_url: str, api_key: str | None) -> list:
    """GET /v1/models: the served model ids. Raises ServerUnreachable with a clear message."""
    url = base_url.rstrip("/") + "/v1/models"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with session.get(url, headers=headers, timeout=aiohttp.ClientTimeout(10)) as r:
            if r.status != 200:
                text = (await r.text())[:300]
                raise ServerUnreachable(f"GET {url} answered HTTP {r.status}: {text}")
            body = await r.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError) as e:
        raise ServerUnreachable(
            f"cannot reach the server at {base_url} ({type(e).__name__}: {e}); is it running "
            "(e.g. `lightwell serve`) and is --base-url right?"
        ) from None
    return [m.get("id") for m in body.get("data", []) if isinstance(m, dict)]
