"""Request schemas: strict types, unknown fields refused, unsupported fields named, 400s."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from lightwell.server.api_server import validation_error
from lightwell.server.protocol import ChatCompletionRequest, CompletionRequest

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def _error(cls, body: dict):
    with pytest.raises(ValidationError) as info:
        cls.model_validate(body)
    errors = [{**e, "loc": ("body", *e["loc"])} for e in info.value.errors()]
    return validation_error(errors)


def test_prompt_shapes():
    assert CompletionRequest(prompt="a").prompt_list() == ["a"]
    assert CompletionRequest(prompt=["a", "b"]).prompt_list() == ["a", "b"]
    assert CompletionRequest(prompt=[1, 2]).prompt_list() == [[1, 2]]
    assert CompletionRequest(prompt=[[1], [2, 3]]).prompt_list() == [[1], [2, 3]]


def test_harmless_fields_are_accepted():
    CompletionRequest.model_validate(
        {"prompt": "x", "user": "u", "stream": True, "stream_options": {"include_usage": True}}
    )
    req = ChatCompletionRequest.model_validate(
        {
            **CHAT,
            "user": "u",
            "metadata": {"a": "b"},
            "tools": [],
            "tool_choice": "none",
            "response_format": {"type": "text"},
            "parallel_tool_calls": True,
            "store": False,
            "service_tier": "auto",
        }
    )
    assert req.max_output_tokens is None


@pytest.mark.parametrize(
    "field, value",
    [
        ("functions", [{"name": "f"}]),
        ("audio", {"voice": "x"}),
        ("modalities", ["text", "audio"]),
        ("prediction", {"type": "content"}),
        ("reasoning_effort", "high"),
        ("store", True),
    ],
)
def test_unsupported_chat_fields_are_named(field, value):
    err = _error(ChatCompletionRequest, {**CHAT, field: value})
    assert err.status == 400 and err.param == field and field in err.message


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "x", "bogus": 1}, "bogus"),
        ({"prompt": "x", "suffix": "y"}, "suffix"),
        ({"prompt": "x", "best_of": 1, "n": 2}, "best_of"),
        ({"prompt": "x", "best_of": 3, "stream": True}, "best_of"),
        ({"prompt": "x", "cache_salt": 3}, "cache_salt"),
        ({"prompt": "x", "temperature": "0.5"}, "temperature"),
        ({"prompt": "x", "echo": 1}, "echo"),
        ({"prompt": "x", "seed": 2**70}, "seed"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": "x", "stream": True, "stream_options": {"bogus": 1}}, "stream_options.bogus"),
        ({"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias"),
        ({}, "prompt"),
    ],
)
def test_completion_errors_name_the_field(body, param):
    err = _error(CompletionRequest, body)
    assert err.status == 400 and err.param == param, err.message


def test_chat_message_to_template():
    req = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "developer", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
            ],
            "max_tokens": 3,
            "max_completion_tokens": 5,
        }
    )
    assert [m.to_template() for m in req.messages] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "ab"},
    ]
    assert req.max_output_tokens == 5
    err = _error(
        ChatCompletionRequest,
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
    )
    assert err.param is not None and err.param.startswith("messages.0.content")


@pytest.mark.parametrize(
    "extra, spec",
    [
        ({}, None),
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, ("response_format", {"json_object": True})),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "n", "schema": {"type": "object"}, "strict": True},
                }
            },
            ("response_format", {"json": {"type": "object"}}),
        ),
        ({"guided_json": '{"type": "object"}'}, ("guided_json", {"json": '{"type": "object"}'})),
        ({"guided_regex": "a+"}, ("guided_regex", {"regex": "a+"})),
        ({"guided_choice": ["a", "b"]}, ("guided_choice", {"choice": ["a", "b"]})),
        ({"guided_grammar": 'root ::= "a"'}, ("guided_grammar", {"grammar": 'root ::= "a"'})),
        (
            {"structured_outputs": {"json": {"type": "string"}}},
            ("structured_outputs", {"json": {"type": "string"}}),
        ),
        ({"structured_outputs": {"choice": ["x"]}}, ("structured_outputs", {"choice": ["x"]})),
    ],
)
def test_structured_output_fields(extra, spec):
    for cls, base in ((ChatCompletionRequest, CHAT), (CompletionRequest, {"prompt": "x"})):
        assert cls.model_validate({**base, **extra}).structured_spec() == spec


def test_two_structured_fields_are_refused():
    err = _error(CompletionRequest, {"prompt": "x", "guided_regex": "a", "guided_choice": ["b"]})
    assert (
        err.param == "guided_choice" and "at most one of guided_regex, guided_choice" in err.message
    )
    err = _error(ChatCompletionRequest, {**CHAT, "response_format": {"type": "json_schema"}})
    assert err.param == "response_format" and "json_schema.schema" in err.message


def test_a_param_error_raised_while_serving_is_a_400():
    """Validation catches what it can; a ParamError found later in a handler (or a thread it
    awaits) is still the client's 400 naming the field, not a 500."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from lightwell.server.api_server import _add_error_handlers
    from lightwell.server.protocol_tools import ParamError

    app = FastAPI()
    _add_error_handlers(app)

    @app.post("/late")
    async def late() -> None:
        raise ParamError("messages", "tool call arguments must be JSON text")

    r = TestClient(app).post("/late")
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "messages" and err["type"] == "invalid_request_error"
    assert "JSON text" in err["message"]
