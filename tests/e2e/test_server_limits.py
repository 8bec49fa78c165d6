"""`lightwell serve` against a hostile client: the API key everywhere but /health, body size,
sequence and queue limits, the request timeout, CORS, no 500s on odd text, a fuzz of a few
hundred malformed requests, and streams cut by shutdown ending with an error event and [DONE].

One server subprocess for the module, with small limits; the last test shuts it down.
"""

from __future__ import annotations

import json
import random
import signal
import threading
import time

import httpx
import pytest

from tests.e2e.test_server import KEY, MODEL, Server

TIMEOUT_S = 6


@pytest.fixture(scope="module")
def server():
    srv = Server(
        "--max-request-body-mb", "0.25", "--max-sequences-per-request", "8",
        "--max-waiting-requests", "6", "--request-timeout", str(TIMEOUT_S),
        "--allowed-origins", "https://app.example", "--shutdown-timeout", "1",
    )  # fmt: skip
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def _ok(server) -> None:
    """The engine is healthy and still answers a normal request."""
    assert server.http.get("/health").status_code == 200
    r = server.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def test_api_key_on_every_route_but_health(server):
    for path in ("/metrics", "/version", "/openapi.json", "/docs", "/v1/models"):
        assert _error(server.http.get(path), 401)["code"] == "invalid_api_key"
    for path in ("/tokenize", "/detokenize", "/v1/completions"):
        assert _error(server.http.post(path, json={}), 401)["code"] == "invalid_api_key"
    assert server.http.get("/health").status_code == 200
    assert server.http.get("/metrics", headers=server.auth).status_code == 200


def test_body_size_limit(server):
    big = {"model": MODEL, "prompt": "x" * 300_000, "max_tokens": 1}
    err = _error(server.post("/v1/completions", json=big), 413)
    assert err["code"] == "request_too_large" and "0.25 MiB" in err["message"]
    _ok(server)


def test_sequence_and_queue_limits(server):
    body = {"model": MODEL, "prompt": ["a", "b", "c"], "n": 3, "max_tokens": 1}
    assert "9 sequences" in _error(server.post("/v1/completions", json=body), 400)["message"]
    body = {"model": MODEL, "prompt": ["a"] * 7, "max_tokens": 1}  # 7 > 6 waiting allowed
    r = server.post("/v1/completions", json=body)
    assert _error(r, 429)["code"] == "queue_full" and r.headers["retry-after"] == "1"


def test_request_timeout(server):
    body = {"model": MODEL, "prompt": "Tell a story.", "max_tokens": 900, "ignore_eos": True}
    t0 = time.perf_counter()
    assert _error(server.post("/v1/completions", json=body), 504)["code"] == "request_timeout"
    with server.http.stream(
        "POST", "/v1/completions", json={**body, "stream": True}, headers=server.auth
    ) as r:
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["error"]["code"] == "request_timeout"
    assert time.perf_counter() - t0 < 4 * TIMEOUT_S
    assert server.metric("request_timeouts_total", 'reason="request_timeout"') == 2
    assert server.metric("request_errors_total", 'reason="too_large"') >= 1
    _ok(server)


def test_cors_only_for_the_allowed_origin(server):
    pre = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}
    r = server.http.options("/v1/completions", headers=pre)
    assert r.headers.get("access-control-allow-origin") == "https://app.example"
    r = server.http.options("/v1/completions", headers={**pre, "Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in r.headers


@pytest.mark.parametrize(
    "body,status",
    [
        ({"prompt": "\ud800 lone"}, 400),
        ({"model": "\udfff"}, 400),
        ({"prompt": "ok", "logit_bias": {"\u00b2": 1}}, 400),  # a non-ASCII digit
        ({"prompt": "ok", "logit_bias": {"\u0661": 1}}, 400),
        ({"prompt": "ok", "temperature": float("inf")}, 400),
        ({"prompt": "ok", "repetition_penalty": float("nan")}, 400),
        ({"prompt": "ok", "top_p": float("inf")}, 400),
        ({"prompt": "ok", "model": "m" * 5000}, 404),
    ],
)
def test_odd_inputs_are_4xx_not_500(server, body, status):
    payload = json.dumps({"model": MODEL, "max_tokens": 1, **body})  # Infinity / NaN as JSON
    r = server.post(
        "/v1/completions", content=payload, headers={"Content-Type": "application/json"}
    )
    err = _error(r, status)
    assert len(err["message"]) < 300  # the request is not echoed whole


def test_models_list_shows_no_path(server):
    card = server.http.get("/v1/models", headers=server.auth).json()["data"][0]
    assert card["root"] == MODEL and "/" not in json.dumps(card)


_BAD = [
    None, -1, 0, 2**70, -(2**70), float("inf"), float("nan"), "", "x" * 3000, "\ud800", "\u00b2",
    [], {}, [[]], [None], True, "abc", 0.5, {"\u00b2": 1}, {"\ud800": 1}, [-5], [2**40],
    {"role": "user"}, [{"role": "nope", "content": 1}],
]  # fmt: skip
_FIELDS = [
    "model", "prompt", "max_tokens", "n", "temperature", "top_p", "top_k", "min_p", "seed",
    "stop", "logit_bias", "logprobs", "presence_penalty", "repetition_penalty", "echo",
    "stream", "stream_options", "messages", "min_tokens", "stop_token_ids", "best_of",
]  # fmt: skip


def _fuzz_body(rng: random.Random) -> tuple[str, bytes]:
    chat = rng.random() < 0.4
    base: dict = {"model": MODEL, "max_tokens": 1}
    if chat:
        base["messages"] = [{"role": "user", "content": "hi"}]
    else:
        base["prompt"] = "hi"
    for _ in range(rng.randint(1, 3)):
        base[rng.choice(_FIELDS)] = rng.choice(_BAD)
    raw = json.dumps(base).encode()
    cut = rng.random()
    if cut < 0.1:
        raw = raw[: rng.randrange(len(raw))]  # truncated JSON
    elif cut < 0.15:
        raw = bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
    return ("/v1/chat/completions" if chat else "/v1/completions"), raw


def test_fuzz_no_5xx_and_a_healthy_engine(server):
    rng = random.Random(23)
    statuses = []
    headers = {**server.auth, "Content-Type": "application/json"}
    for _ in range(300):
        path, raw = _fuzz_body(rng)
        r = server.http.post(path, content=raw, headers=headers)
        statuses.append(r.status_code)
        assert r.status_code < 500, (raw[:200], r.text[:300])
        if r.status_code >= 400:
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert statuses.count(400) > 150
    _ok(server)


def test_shutdown_ends_open_streams_with_an_error_and_done(server):
    body = {"model": MODEL, "prompt": "Count.", "max_tokens": 900, "ignore_eos": True,
            "stream": True}  # fmt: skip
    events: list[str] = []

    def read() -> None:
        with (
            httpx.Client(base_url=server.url, timeout=60) as c,
            c.stream(
                "POST", "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
            ) as r,
        ):
            events.extend(line for line in r.iter_lines() if line.startswith("data: "))

    reader = threading.Thread(target=read)
    reader.start()
    deadline = time.time() + 30
    while not events and time.time() < deadline:
        time.sleep(0.05)
    server.proc.send_signal(signal.SIGTERM)
    reader.join(60)
    assert server.proc.wait(60) == 0
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["error"]["code"] in ("shutdown", "request_timeout")
    assert "Traceback" not in server.output()
