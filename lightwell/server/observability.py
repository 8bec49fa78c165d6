"""Per-request context for the HTTP server: the request id (a client's ``X-Request-Id`` or a new
one, returned in ``X-Request-Id`` and carried into the engine's request ids and the logs), error
and timeout accounting by reason, and the JSON log format (``--log-format json``)."""

from __future__ import annotations

import contextvars
import json
import logging
import re
import time
import uuid
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)
# per HTTP request, shared with the tasks it starts: {"stream_error": HTTP status or None}
_STATE: contextvars.ContextVar[dict | None] = contextvars.ContextVar("request_state", default=None)
HEADER = b"x-request-id"
_VALID_ID = re.compile(r"^[A-Za-z0-9._:/+=@-]{1,128}$")
# HTTP status -> the `reason` label of lightwell:request_errors
ERROR_REASONS = {
    400: "bad_request",
    401: "unauthorized",
    404: "not_found",
    413: "too_large",
    429: "queue_full",
    500: "internal",
    503: "engine_dead",
}
TIMEOUT_REASONS = ("client_disconnect", "request_timeout")
DISCONNECTED = "lightwell.client_disconnected"  # set in the ASGI scope by streamed responses


def current_request_id() -> str | None:
    return REQUEST_ID.get()


def note_stream_error(status: int) -> None:
    """An error sent inside a stream whose 200 has gone out: accounted like an error response."""
    state = _STATE.get()
    if state is not None:
        state["stream_error"] = status


def incoming_id(scope: Scope) -> str:
    """The client's X-Request-Id when it is a sane token, else a new random one."""
    for name, value in scope.get("headers", []):
        if name == HEADER:
            text = value.decode("latin-1").strip()
            if _VALID_ID.match(text):
                return text
    return uuid.uuid4().hex


class RequestContextMiddleware:
    """Pure ASGI (streams and disconnects pass through untouched): sets the request id, echoes
    it in the response headers, counts error responses and client disconnects on ``metrics``."""

    def __init__(self, app: ASGIApp, metrics: Any) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = incoming_id(scope)
        token = REQUEST_ID.set(rid)
        state: dict = {"stream_error": None}
        state_token = _STATE.set(state)
        status = [0]

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                headers = [h for h in message.get("headers", []) if h[0].lower() != HEADER]
                message = {**message, "headers": [*headers, (HEADER, rid.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            self._account(state["stream_error"] or status[0], bool(scope.get(DISCONNECTED)))
            _STATE.reset(state_token)
            REQUEST_ID.reset(token)

    def _account(self, status: int, disconnected: bool) -> None:
        if status == 499 or disconnected:
            self.metrics.observe_timeout("client_disconnect")
        elif status == 504:  # --request-timeout
            self.metrics.observe_timeout("request_timeout")
        elif status >= 400:
            self.metrics.observe_error(ERROR_REASONS.get(status, f"http_{status}"))


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, request_id (when known)."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        rid = getattr(record, "request_id", None) or REQUEST_ID.get()
        if rid:
            entry["request_id"] = rid
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def use_json_logs() -> None:
    """Every handler of the root logger writes JSON lines."""
    root = logging.getLogger()
    if not root.handlers:
        root.addHandler(logging.StreamHandler())
    for handler in root.handlers:
        handler.setFormatter(JsonFormatter())
