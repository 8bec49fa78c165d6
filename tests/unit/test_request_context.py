"""The request-context middleware: request ids in and out, errors and disconnects by reason
(counted on a real ServerMetrics), JSON log lines."""

from __future__ import annotations

import asyncio
import json
import logging

from lightwell.engine.llm_engine import EngineStats
from lightwell.server.metrics import ServerMetrics
from lightwell.server.observability import (
    DISCONNECTED,
    JsonFormatter,
    RequestContextMiddleware,
    current_request_id,
    note_stream_error,
)


def _metrics() -> ServerMetrics:
    m = ServerMetrics("m")
    m.attach(lambda: EngineStats(0, 0, 0.0, 0, 0, 0))
    return m


def _count(m: ServerMetrics, name: str, reason: str) -> float:
    value = m.registry.get_sample_value(
        f"lightwell:{name}_total", {"model_name": "m", "reason": reason}
    )
    return value or 0.0


def _call(app, headers=()) -> list[dict]:
    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/x", "headers": list(headers)}
    asyncio.run(app(scope, receive, send))
    return sent


def _app(status: int, stream_error: int | None = None, disconnect: bool = False):
    seen = {}

    async def app(scope, receive, send):
        seen["id"] = current_request_id()
        await send({"type": "http.response.start", "status": status, "headers": []})

        async def produce():  # a task, as the SSE producer is
            if stream_error:
                note_stream_error(stream_error)
            await send({"type": "http.response.body", "body": b"x"})

        await asyncio.create_task(produce())
        if disconnect:
            scope[DISCONNECTED] = True

    return app, seen


def test_request_id_echoed_or_made():
    m = _metrics()
    app, seen = _app(200)
    sent = _call(RequestContextMiddleware(app, m), [(b"x-request-id", b"abc-1")])
    assert seen["id"] == "abc-1" and (b"x-request-id", b"abc-1") in sent[0]["headers"]
    sent = _call(RequestContextMiddleware(app, m), [(b"x-request-id", b"bad id\n")])
    made = dict(sent[0]["headers"])[b"x-request-id"].decode()
    assert made == seen["id"] and len(made) == 32 and current_request_id() is None


def test_errors_stream_errors_and_disconnects_by_reason():
    m = _metrics()
    for status in (400, 400, 500):
        _call(RequestContextMiddleware(_app(status)[0], m))
    _call(RequestContextMiddleware(_app(200, stream_error=503)[0], m))
    _call(RequestContextMiddleware(_app(200, disconnect=True)[0], m))
    _call(RequestContextMiddleware(_app(499)[0], m))
    _call(RequestContextMiddleware(_app(200)[0], m))
    assert _count(m, "request_errors", "bad_request") == 2
    assert _count(m, "request_errors", "internal") == 1
    assert _count(m, "request_errors", "engine_dead") == 1
    assert _count(m, "request_timeouts", "client_disconnect") == 2


def test_json_formatter():
    record = logging.LogRecord("lightwell.x", logging.INFO, __file__, 1, "hello %s", ("a",), None)
    record.request_id = "r-1"
    entry = json.loads(JsonFormatter().format(record))
    assert entry["message"] == "hello a" and entry["request_id"] == "r-1"
    assert entry["level"] == "INFO" and entry["time"].endswith("Z")
