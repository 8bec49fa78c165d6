"""Server counters and limits without a model: prompt tokens counted only once scheduled; the
limits middleware's API key, body size and lone-surrogate checks on a plain ASGI app."""

from __future__ import annotations

import asyncio
import json

import pytest

from lightwell.engine.llm_engine import EngineStats
from lightwell.server.limits import LimitsMiddleware, ServerLimits
from lightwell.server.metrics import ServerMetrics
from lightwell.types import CompletionOutput, FinishReason, RequestMetrics, RequestOutput


def _finished(scheduled: bool) -> RequestOutput:
    m = RequestMetrics(arrival_time=1.0, first_scheduled_time=2.0 if scheduled else None)
    out = CompletionOutput(0, "", [], finish_reason=FinishReason.ABORT)
    return RequestOutput("r", None, list(range(100)), [out], True, metrics=m)


def test_prompt_tokens_count_only_scheduled_requests():
    metrics = ServerMetrics("m")
    metrics.attach(lambda: EngineStats(0, 0, 0.0, 0, 0, 0))
    metrics.observe_finished(_finished(scheduled=False))  # aborted while waiting
    assert (
        metrics.registry.get_sample_value("lightwell:prompt_tokens_total", {"model_name": "m"}) == 0
    )
    metrics.observe_finished(_finished(scheduled=True))
    assert (
        metrics.registry.get_sample_value("lightwell:prompt_tokens_total", {"model_name": "m"})
        == 100
    )


async def _app(scope, receive, send):
    body = (await receive())["body"]
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"echo:" + body})


def _call(path: str, body: bytes, headers: dict[str, str], **limits) -> tuple[int, bytes]:
    mw = LimitsMiddleware(_app, "k", ServerLimits(**limits), metrics_path="/metrics")
    chunks = [body[i : i + 1000] for i in range(0, len(body), 1000)] or [b""]
    messages = [
        {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
        for i, c in enumerate(chunks)
    ]
    sent: list[dict] = []

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    raw = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    asyncio.run(mw({"type": "http", "path": path, "headers": raw}, receive, send))
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


AUTH = {"Authorization": "Bearer k"}


def test_api_key_everywhere_but_health():
    assert _call("/health", b"", {})[0] == 200
    for path in ("/metrics", "/docs", "/tokenize", "/v1/models"):
        status, body = _call(path, b"", {})
        assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
    assert _call("/metrics", b"", {}, public_metrics=True)[0] == 200
    assert _call("/metrics", b"", {"Authorization": "Bearer no"})[0] == 401
    assert _call("/v1/models", b"", AUTH) == (200, b"echo:")


@pytest.mark.parametrize("declared", [True, False])
def test_body_limit_413(declared):
    body = b"x" * 3000
    headers = {**AUTH, **({"Content-Length": str(len(body))} if declared else {})}
    status, out = _call("/v1/completions", body, headers, max_request_body_mb=2000 / 2**20)
    assert status == 413 and json.loads(out)["error"]["code"] == "request_too_large"
    assert _call("/v1/completions", body, headers)[0] == 200  # the default 8 MiB


def test_lone_surrogates_refused_paired_ones_kept():
    lone = json.dumps({"prompt": "a\ud800b"}).encode()
    status, out = _call("/v1/completions", lone, AUTH)
    assert status == 400 and json.loads(out)["error"]["code"] == "invalid_text"
    pair = json.dumps({"prompt": "a\U0001f600b"}).encode()  # \ud83d\ude00: valid
    assert _call("/v1/completions", pair, AUTH) == (200, b"echo:" + pair)
    literal = json.dumps({"prompt": "\\ud800"}).encode()  # a backslash, not a surrogate
    assert _call("/v1/completions", literal, AUTH)[0] == 200


def test_limits_validated():
    with pytest.raises(ValueError, match="request_timeout"):
        ServerLimits(request_timeout=float("inf")).validate()
    with pytest.raises(ValueError, match="max_request_body_mb"):
        ServerLimits(max_request_body_mb=0).validate()
