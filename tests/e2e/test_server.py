"""`lightwell serve` end to end on 127.0.0.1 with the official openai SDK and the SmolLM2 model.

One server subprocess for the module (1 torch thread, API key set, the hermes tool-call parser),
once with the plain step loop and once with --async-scheduling; max_tokens stay small.
The last test sends SIGTERM and checks the graceful shutdown.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import openai
import pytest

KEY = "sk-lightwell-test"
MODEL = "SmolLM2-135M-Instruct"
ALIAS = "smol"
MAX_MODEL_LEN = 1024


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, *extra: str) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "lightwell.cli", "serve", "--port", str(self.port)]
        cmd += ["--api-key", KEY, "--num-threads", "1", "--max-model-len", str(MAX_MODEL_LEN)]
        cmd += ["--stats-interval", "1", "--shutdown-timeout", "20", *extra]
        cmd += ["--served-model-name", MODEL, ALIAS]
        env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.http = httpx.Client(base_url=self.url, timeout=60)
        self.auth = {"Authorization": f"Bearer {KEY}"}

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.output()}")
            try:
                if self.http.get("/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"server not ready:\n{self.output()}")

    def output(self) -> str:
        with open(self.log.name) as f:
            return f.read()

    def post(self, path: str, **kw) -> httpx.Response:
        headers = {**self.auth, **kw.pop("headers", {})}
        return self.http.post(path, headers=headers, **kw)

    def metric(self, name: str, labels: str = "") -> float:
        text = self.http.get("/metrics", headers=self.auth).text
        pattern = rf"^lightwell:{re.escape(name)}\{{([^}}]*)\}} (\S+)$"
        total = 0.0
        for m in re.finditer(pattern, text, re.M):
            if labels in m.group(1):
                total += float(m.group(2))
        return total

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.http.close()
        os.unlink(self.log.name)


@pytest.fixture(scope="module", params=[(), ("--async-scheduling",)], ids=["plain", "async"])
def server(request):
    """Every test runs against the plain step loop and the overlapped one."""
    srv = Server("--tool-call-parser", "hermes", *request.param)
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def _complete(client, prompt="The capital of France is", **kw):
    kw.setdefault("max_tokens", 8)
    kw.setdefault("temperature", 0.0)
    return client.completions.create(model=MODEL, prompt=prompt, **kw)


def _chat(client, content="Name a colour.", **kw):
    kw.setdefault("max_tokens", 8)
    kw.setdefault("temperature", 0.0)
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], **kw
    )


# ---- basics ------------------------------------------------------------
def test_startup_banner_models_health_version(server, client):
    out = server.output()
    assert f"{server.url}/v1" in out and MODEL in out and "KV cache:" in out
    assert [m.id for m in client.models.list().data] == [MODEL, ALIAS]
    assert client.models.retrieve(ALIAS).id == ALIAS
    r = client.completions.create(model=ALIAS, prompt="Hi", max_tokens=1)
    assert r.model == MODEL and r.choices[0].text
    assert server.http.get("/health").status_code == 200
    assert server.http.get("/version", headers=server.auth).json()["version"]
    assert server.http.get("/openapi.json", headers=server.auth).json()["paths"]["/v1/completions"]


def test_completion_nonstream(server, client):
    r = _complete(client, max_tokens=5)
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == MODEL
    (choice,) = r.choices
    assert choice.finish_reason == "length" and choice.text
    count = server.post("/tokenize", json={"prompt": "The capital of France is"}).json()
    assert r.usage.prompt_tokens == count["count"]
    assert r.usage.completion_tokens == 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + 5


def test_completion_stream_matches_nonstream(client):
    whole = _complete(client, max_tokens=10).choices[0]
    chunks = list(_complete(client, max_tokens=10, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_stop_string_ends_with_stop(client):
    full = _complete(client, max_tokens=12).choices[0].text
    words = full.split()
    assert len(words) >= 3, full
    stop = words[2]
    r = _complete(client, max_tokens=12, stop=[stop, "@@never@@"]).choices[0]
    assert r.finish_reason == "stop"
    assert r.text == full[: full.index(stop)]
    chunks = list(_complete(client, max_tokens=12, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == r.text
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_chat_nonstream_and_stream(client):
    whole = _chat(client)
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")
    msg = whole.choices[0].message
    assert msg.role == "assistant" and msg.content
    chunks = list(_chat(client, stream=True, stream_options={"include_usage": True}))
    first = chunks[0].choices[0]
    assert first.delta.role == "assistant" and first.delta.content  # role + first token
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == msg.content
    assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_n2_choices(client):
    r = _chat(client, n=2, temperature=1.0, seed=7)
    assert [c.index for c in r.choices] == [0, 1]
    assert 2 <= r.usage.completion_tokens <= 16
    chunks = list(_complete(client, n=2, temperature=1.0, seed=7, stream=True))
    by_index: dict[int, str] = {0: "", 1: ""}
    for c in chunks:
        by_index[c.choices[0].index] += c.choices[0].text
    whole = _complete(client, n=2, temperature=1.0, seed=7)
    assert [c.text for c in whole.choices] == [by_index[0], by_index[1]]


def test_seed_reproducible(client):
    a = _complete(client, temperature=1.0, seed=1234, max_tokens=16).choices[0].text
    b = _complete(client, temperature=1.0, seed=1234, max_tokens=16).choices[0].text
    c = _complete(client, temperature=1.0, seed=4321, max_tokens=16).choices[0].text
    assert a == b
    assert a != c


def test_logit_bias_is_honoured(server, client):
    first = _complete(client, max_tokens=1).choices[0].text
    tid = server.post("/tokenize", json={"prompt": first}).json()["tokens"][0]
    biased = _complete(client, max_tokens=1, logit_bias={str(tid): -100}).choices[0].text
    assert biased != first


def test_completion_logprobs_and_echo(client):
    r = _complete(client, max_tokens=4, logprobs=2).choices[0]
    lp = r.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == r.text
    assert all(x <= 0 for x in lp.token_logprobs)
    assert all(1 <= len(t) <= 3 for t in lp.top_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    prompt = "The capital of France is"
    e = _complete(client, max_tokens=4, logprobs=1, echo=True).choices[0]
    assert e.text == prompt + r.text
    assert e.logprobs.token_logprobs[0] is None and len(e.logprobs.tokens) > 4
    assert e.logprobs.token_logprobs[-4:] == pytest.approx(lp.token_logprobs, abs=1e-4)


def test_chat_logprobs(client):
    r = _chat(client, logprobs=True, top_logprobs=3).choices[0]
    content = r.logprobs.content
    assert len(content) == 8
    assert "".join(t.token for t in content) == r.message.content
    for t in content:
        assert len(t.top_logprobs) == 3 and t.bytes == list(t.token.encode())
        assert t.top_logprobs[0].logprob >= t.logprob - 1e-6
    chunks = list(_chat(client, logprobs=True, stream=True))
    streamed = [t for c in chunks for t in (c.choices[0].logprobs.content or [])]
    assert [t.token for t in streamed] == [t.token for t in content]


def test_cached_tokens_on_repeat(client):
    prompt = "Once upon a time, in a land of unique test number 9137, " * 6
    first = _complete(client, prompt=prompt, max_tokens=2)
    second = _complete(client, prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens >= 16
    assert second.choices[0].text == first.choices[0].text


def test_cache_salt_isolates_prefixes(client):
    prompt = "A salted prompt for tenant isolation, unique test number 4471, " * 6
    salted = [
        _complete(client, prompt=prompt, max_tokens=1, extra_body={"cache_salt": s})
        for s in ("tenant-a", "tenant-b", "tenant-a")
    ]
    plain = _complete(client, prompt=prompt, max_tokens=1)
    cached = [r.usage.prompt_tokens_details.cached_tokens for r in (*salted, plain)]
    assert cached[0] == cached[1] == cached[3] == 0  # no sharing across salts or with none
    assert cached[2] >= 16  # the same salt shares its blocks


def test_best_of_keeps_the_most_likely_samples(client):
    kw = dict(prompt="My favourite animal is", max_tokens=6, temperature=1.0, seed=21)
    samples = _complete(client, n=3, logprobs=0, **kw).choices
    total = {c.text: sum(c.logprobs.token_logprobs) for c in samples}
    best = _complete(client, best_of=3, **kw)
    assert len(best.choices) == 1 and best.choices[0].logprobs is None
    assert best.choices[0].text == max(total, key=total.get)
    two = _complete(client, n=2, best_of=3, **kw).choices
    assert [c.text for c in two] == sorted(total, key=total.get, reverse=True)[:2]


def test_token_id_prompts_and_tokenize_roundtrip(server, client):
    ids = server.post("/tokenize", json={"prompt": "Hello there"}).json()["tokens"]
    back = server.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    assert back == "Hello there"
    by_ids = _complete(client, prompt=ids, max_tokens=4).choices[0].text
    assert by_ids == _complete(client, prompt="Hello there", max_tokens=4).choices[0].text
    multi = _complete(client, prompt=[ids, ids], max_tokens=4)
    assert [c.index for c in multi.choices] == [0, 1] and multi.choices[1].text == by_ids
    msgs = [{"role": "user", "content": "Name a colour."}]
    n = server.post("/tokenize", json={"messages": msgs}).json()["count"]
    assert n == _chat(client, max_tokens=1).usage.prompt_tokens


# ---- errors ------------------------------------------------------------
_CHAT_OK = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
_LONG = "hello " * (MAX_MODEL_LEN + 10)


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("/v1/completions", "{not json", 400, None),
        ("/v1/completions", "[1, 2]", 400, None),
        ("/v1/completions", {}, 400, "prompt"),
        ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 2.5}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": [1, "a"]}, 400, "prompt"),
        ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
        ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
        ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
        ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"999999": 1}}, 400, "logit_bias"),
        ("/v1/completions", {"prompt": [999999]}, 400, "prompt"),
        ("/v1/completions", {"prompt": ""}, 400, "prompt"),
        ("/v1/completions", {"prompt": []}, 400, "prompt"),
        ("/v1/completions", {"prompt": "x", "frobnicate": 1}, 400, "frobnicate"),
        ("/v1/completions", {"prompt": "x", "suffix": "end"}, 400, "suffix"),
        ("/v1/completions", {"prompt": "x", "best_of": 1, "n": 2}, 400, "best_of"),
        ("/v1/completions", {"prompt": "x", "cache_salt": ""}, 400, "cache_salt"),
        (
            "/v1/completions",
            {"prompt": "x", "stream_options": {"include_usage": True}},
            400,
            "stream_options",
        ),
        ("/v1/completions", {"prompt": _LONG}, 400, "prompt"),
        ("/v1/completions", {"prompt": "x", "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
        (
            "/v1/chat/completions",
            {**_CHAT_OK, "tools": [{"type": "function"}]},
            400,
            "tools.0.function",
        ),
        (
            "/v1/chat/completions",
            {**_CHAT_OK, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            400,
            "response_format",
        ),
        (
            "/v1/chat/completions",
            {**_CHAT_OK, "response_format": {"type": "json_object"}, "guided_regex": "a"},
            400,
            "guided_regex",
        ),
        ("/v1/completions", {"prompt": "x", "guided_regex": "([a-"}, 400, "guided_regex"),
        ("/v1/completions", {"prompt": "x", "guided_choice": []}, 400, "guided_choice"),
        ("/v1/chat/completions", {**_CHAT_OK, "top_logprobs": 2}, 400, "top_logprobs"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "robot", "content": "x"}]},
            400,
            "messages.0.role",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": _LONG}]},
            400,
            "messages",
        ),
        ("/v1/chat/completions", {**_CHAT_OK, "model": "nope"}, 404, "model"),
        ("/v1/nothing-here", {}, 404, None),
    ],
)
def test_error_paths(server, path, body, status, param):
    kw = {"content": body} if isinstance(body, str) else {"json": body}
    r = server.post(path, headers={"Content-Type": "application/json"}, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
        assert param.split(".")[0] in err["message"] or status == 404


def test_accepted_and_ignored_fields(client):
    r = _chat(
        client,
        user="u-1",
        metadata={"k": "v"},
        tool_choice="none",
        tools=[],
        response_format={"type": "text"},
        max_completion_tokens=3,
    )
    assert r.usage.completion_tokens == 3


def test_api_key_required_on_v1(server):
    for path in ("/v1/models", "/v1/completions", "/v1/chat/completions"):
        assert server.http.post(path, json={}).status_code in (401, 405)
    assert server.http.get("/v1/models").status_code == 401
    wrong = server.http.get("/v1/models", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    assert server.http.get("/health").status_code == 200


def test_sdk_error_types(server):
    bad_key = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.models.list()
    good = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        good.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        good.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "x"}],
            tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
            tool_choice={"type": "function", "function": {"name": "g"}},
        )
    assert _complete(good, max_tokens=2).choices[0].text  # still serving


# ---- structured output ---------------------------------------------------------------------------
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_response_format_json_schema_stream_and_nonstream(server, client):
    import json

    import jsonschema

    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}}
    compiles = server.metric("grammar_compiles_total")
    kw = dict(content="A person as JSON.", max_tokens=40, response_format=fmt)
    whole = _chat(client, **kw)
    text = whole.choices[0].message.content
    jsonschema.validate(json.loads(text), PERSON)
    assert whole.choices[0].finish_reason == "stop"
    chunks = list(_chat(client, stream=True, **kw))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert server.metric("grammar_compiles_total") - compiles <= 1  # the second one hit
    assert server.metric("grammar_cache_hits_total") >= 1


def test_guided_fields_on_completions_with_n2(client):
    import re

    r = _complete(
        client,
        prompt="Phone:",
        n=2,
        temperature=1.0,
        seed=4,
        max_tokens=12,
        extra_body={"guided_regex": r"[0-9]{3}-[0-9]{4}"},
    )
    assert len(r.choices) == 2
    for c in r.choices:
        assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", c.text) and c.finish_reason == "stop"
    choice = _chat(client, max_tokens=5, extra_body={"guided_choice": ["cat", "dog"]})
    assert choice.choices[0].message.content in ("cat", "dog")
    obj = _chat(client, max_tokens=30, extra_body={"structured_outputs": {"json_object": True}})
    assert obj.choices[0].message.content.startswith("{")


def test_bad_schema_is_a_400_with_the_reason(client):
    with pytest.raises(openai.BadRequestError, match="invalid JSON schema: Unsupported type"):
        _chat(client, extra_body={"guided_json": {"type": "objectx"}})
    with pytest.raises(openai.BadRequestError, match="invalid grammar: EBNF parser error"):
        _complete(client, extra_body={"guided_grammar": "root ::= nothing"})
    assert _complete(client, max_tokens=2).choices[0].text  # still serving


# ---- tool calling --------------------------------------------------------------------------------
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}


def _tool_chat(client, **kw):
    kw.setdefault("max_tokens", 40)
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER, TIME],
        temperature=0.0,
        **kw,
    )


def test_named_tool_choice_arguments_parse_whole_and_streamed(client):
    import json

    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = _tool_chat(client, tool_choice=choice)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert set(json.loads(call.function.arguments)) == {"city"}
    assert r.choices[0].message.content is None and r.choices[0].finish_reason == "stop"
    chunks = [c for c in _tool_chat(client, tool_choice=choice, stream=True) if c.choices]
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "get_weather" and deltas[0].id
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments


def test_required_tool_choice_and_history_with_tool_messages(client):
    import json

    r = _tool_chat(client, tool_choice="required", parallel_tool_calls=False)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name in ("get_weather", "get_time")
    json.loads(call.function.arguments)
    assert r.choices[0].finish_reason == "tool_calls"
    history = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"},
    ]
    follow = client.chat.completions.create(
        model=MODEL, messages=history, tools=[WEATHER], tool_choice="none", max_tokens=8
    )
    assert follow.choices[0].message.content and not follow.choices[0].message.tool_calls
    kw = {"tool_choice": "required", "parallel_tool_calls": False, "stream": True}
    streamed = [c for c in _tool_chat(client, **kw) if c.choices]
    head, *rest = [d for c in streamed for d in (c.choices[0].delta.tool_calls or [])]
    assert head.id and head.function.name == call.function.name and rest
    assert all(d.index == 0 and d.id is None for d in rest)  # the arguments as they come
    args = head.function.arguments + "".join(d.function.arguments for d in rest)
    assert args == call.function.arguments
    assert streamed[-1].choices[0].finish_reason == "tool_calls"


# The model's text is forced by a regex into content and one hermes call, so auto's parser has a
# call to read (two parallel calls and every parser: tests/unit/test_tool_calls.py).
_ONE_CALL = r'Hi<tool_call>\{"name": "get_time", "arguments": \{"tz": "UTC"\}\}</tool_call>'


def test_auto_tool_call_streams_its_head_then_argument_pieces(server, client):
    if "--async-scheduling" in server.proc.args:
        pytest.skip("the server's streaming is the same over either loop: once is enough")
    kw = {"extra_body": {"guided_regex": _ONE_CALL}, "max_tokens": 80, "stream": True}
    chunks = [c.choices[0] for c in _tool_chat(client, **kw) if c.choices]
    content = "".join(ch.delta.content or "" for ch in chunks)
    (head, *rest), at = zip(
        *[(d, n) for n, ch in enumerate(chunks) for d in ch.delta.tool_calls or []]
    )
    assert content == "Hi" and chunks[-1].finish_reason == "tool_calls"
    assert head.index == 0 and head.id.startswith("call_") and head.function.name == "get_time"
    assert all(d.index == 0 and d.id is None and d.function.name is None for d in rest)
    pieces = [head.function.arguments, *(d.function.arguments for d in rest)]
    assert "".join(pieces) == '{"tz": "UTC"}' and len([p for p in pieces if p]) > 2
    assert at[0] < at[-1] < len(chunks)  # the head went out before the arguments were done


# ---- /v1/responses -------------------------------------------------------------------------------
def test_responses_basic_text_matches_chat(client):
    r = client.responses.create(
        model=MODEL,
        instructions="Answer briefly.",
        input="Name a colour.",
        max_output_tokens=6,
        temperature=0.0,
    )
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Name a colour."},
        ],
        max_tokens=6,
        temperature=0.0,
    )
    assert r.output_text == chat.choices[0].message.content
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError, match="stream"):
        client.responses.create(model=MODEL, input="x", stream=True)


# ---- disconnects, concurrency, metrics ----------------------------------------------------------
def test_disconnect_mid_stream_frees_blocks(server):
    aborted = server.metric("request_success_total", 'finished_reason="abort"')
    body = {
        "prompt": "Tell me a long story.",
        "max_tokens": 500,
        "ignore_eos": True,
        "stream": True,
        "temperature": 0,
    }
    with server.http.stream("POST", "/v1/completions", json=body, headers=server.auth) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: {") for line in got)
        assert server.metric("kv_cache_usage_perc") > 0
    deadline = time.time() + 5
    while time.time() < deadline:
        if server.metric("num_requests_running") == 0 and server.metric("kv_cache_usage_perc") == 0:
            break
        time.sleep(0.05)
    assert server.metric("num_requests_running") == 0
    assert server.metric("kv_cache_usage_perc") == 0
    assert server.metric("request_success_total", 'finished_reason="abort"') == aborted + 1


def test_disconnect_while_waiting_nonstream_aborts(server):
    aborted = server.metric("request_success_total", 'finished_reason="abort"')
    body = {"prompt": "Tell me a long story.", "max_tokens": 500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        server.post("/v1/completions", json=body, timeout=1.5)
    deadline = time.time() + 5
    while time.time() < deadline and server.metric("num_requests_running") > 0:
        time.sleep(0.05)
    assert server.metric("kv_cache_usage_perc") == 0
    assert server.metric("request_success_total", 'finished_reason="abort"') == aborted + 1


def test_32_concurrent_streams_match_sequential(server, client):
    prompts = [f"Fact number {i}: the" for i in range(32)]
    sequential = [_complete(client, prompt=p, max_tokens=6).choices[0].text for p in prompts]

    async def one(aclient, p):
        text = ""
        stream = await aclient.completions.create(
            model=MODEL, prompt=p, max_tokens=6, temperature=0, stream=True
        )
        async for chunk in stream:
            text += chunk.choices[0].text
        return text

    async def run_all():
        async with openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120
        ) as aclient:
            return await asyncio.gather(*(one(aclient, p) for p in prompts))

    assert asyncio.run(run_all()) == sequential


def test_metrics_move_as_requests_finish(server, client):
    before = {
        "prompt": server.metric("prompt_tokens_total"),
        "gen": server.metric("generation_tokens_total"),
        "ok": server.metric("request_success_total", 'finished_reason="length"'),
        "ttft": server.metric("time_to_first_token_seconds_count"),
        "e2e": server.metric("e2e_request_latency_seconds_count"),
        "queue": server.metric("request_queue_time_seconds_count"),
        "itl": server.metric("inter_token_latency_seconds_count"),
        "queries": server.metric("prefix_cache_queries_total"),
    }
    r = _complete(client, prompt="Metrics are moving", max_tokens=4)
    time.sleep(0.2)
    assert server.metric("prompt_tokens_total") == before["prompt"] + r.usage.prompt_tokens
    assert server.metric("generation_tokens_total") == before["gen"] + 4
    assert server.metric("request_success_total", 'finished_reason="length"') == before["ok"] + 1
    for name in ("ttft", "e2e", "queue"):
        key = {
            "ttft": "time_to_first_token_seconds_count",
            "e2e": "e2e_request_latency_seconds_count",
            "queue": "request_queue_time_seconds_count",
        }[name]
        assert server.metric(key) == before[name] + 1
    assert server.metric("inter_token_latency_seconds_count") == before["itl"] + 3
    assert server.metric("prefix_cache_queries_total") > before["queries"]
    assert server.metric("num_requests_running") == 0
    assert "finished cmpl-" in server.output()  # one log line per finished request
    assert "generation throughput" in server.output()  # periodic stats


# ---- shutdown (last: it stops the module's server) ----------------------------------------------
def test_sigterm_finishes_in_flight_then_exits_0(server):
    body = {
        "prompt": "Count slowly:",
        "max_tokens": 60,
        "ignore_eos": True,
        "stream": True,
        "temperature": 0,
    }
    lines: list[str] = []
    started = threading.Event()

    def consume():
        with httpx.stream(
            "POST", server.url + "/v1/completions", json=body, headers=server.auth, timeout=60
        ) as r:
            for line in r.iter_lines():
                lines.append(line)
                started.set()

    t = threading.Thread(target=consume)
    t.start()
    assert started.wait(30)
    server.proc.send_signal(signal.SIGTERM)
    t.join(60)
    assert server.proc.wait(60) == 0
    assert lines[-2:] == ["data: [DONE]", ""] or lines[-1] == "data: [DONE]"
    assert '"finish_reason":"length"' in "".join(lines)
    with pytest.raises(httpx.TransportError):
        httpx.get(server.url + "/health", timeout=2)
