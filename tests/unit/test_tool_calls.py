"""Tool calling without a model: request checks, the parsers on each format's text, the schema
that constrains required / named choices, and the streamed deltas."""

from __future__ import annotations

import json

import pytest

from lightwell.server.api_server import validation_error
from lightwell.server.protocol import ChatCompletionRequest
from lightwell.server.serving_tools import (
    ToolSetup,
    ToolStream,
    parse_output,
    tool_constraint,
    tool_setup,
)
from lightwell.server.tool_parsers import PARSERS, ParsedOutput, choose_parser

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
BASE = {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER, TIME]}


def _req(**extra) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({**BASE, **extra})


def _error(body: dict):
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate(body)
    return validation_error(list(e.value.errors()))


@pytest.mark.parametrize(
    "extra,mode",
    [
        ({}, "auto"),
        ({"tool_choice": "none"}, "none"),
        ({"tool_choice": "required"}, "required"),
        ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "named"),
    ],
)
def test_tool_modes(extra, mode):
    assert _req(**extra).tool_mode == mode


@pytest.mark.parametrize(
    "body,param,message",
    [
        (
            {**BASE, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "not in tools",
        ),
        ({"messages": BASE["messages"], "tool_choice": "required"}, "tool_choice", "needs tools"),
        ({**BASE, "tools": [WEATHER, WEATHER]}, "tools", "distinct"),
        ({**BASE, "tool_choice": "required", "guided_regex": "a"}, "tool_choice", "guided_regex"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages", "tool_call_id"),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": "call_1",
                                "type": "function",
                                "function": {"name": "f", "arguments": "{not json"},
                            }
                        ],
                    },
                    {"role": "user", "content": "x"},
                ]
            },
            "messages",
            "must be JSON text",
        ),
    ],
)
def test_bad_tool_requests(body, param, message):
    err = _error(body)
    assert err.status == 400 and err.param == param and message in err.message


def test_history_with_tool_calls_reaches_the_template_as_objects():
    req = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "user", "content": "weather?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "12C"},
            ]
        }
    )
    assistant, tool = (m.to_template() for m in req.messages[1:])
    assert assistant["tool_calls"][0]["function"] == {
        "name": "get_weather",
        "arguments": {"city": "Oslo"},
    }
    assert tool == {"role": "tool", "content": "12C", "tool_call_id": "call_1"}


@pytest.mark.parametrize(
    "parser,text,content,calls",
    [
        (
            "hermes",
            'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
            "Let me check.",
            [("get_weather", {"city": "Oslo"}), ("get_time", {})],
        ),
        ("hermes", "No tools needed.", "No tools needed.", []),
        ("hermes", "<tool_call>{broken</tool_call>", "<tool_call>{broken</tool_call>", []),
        (
            "llama3_json",
            '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
            '{"name": "get_time", "parameters": {}}',
            None,
            [("get_weather", {"city": "Oslo"}), ("get_time", {})],
        ),
        ("llama3_json", "Hello {there}", "Hello {there}", []),
        (
            "mistral",
            '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]',
            None,
            [("get_weather", {"city": "Oslo"})],
        ),
        (
            "mistral",
            'Sure [TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time[ARGS]{}',
            "Sure",
            [("get_weather", {"city": "Oslo"}), ("get_time", {})],
        ),
    ],
)
def test_parsers(parser, text, content, calls):
    out = PARSERS[parser].parse(text)
    assert out.content == content
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == calls


def test_auto_with_parallel_tool_calls_false_keeps_the_first_call():
    text = (
        '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b"}</tool_call>'
    )
    setup = tool_setup(_req(parallel_tool_calls=False), "hermes", None)
    assert [c.name for c in parse_output(setup, text).tool_calls] == ["a"]
    both = tool_setup(_req(), "hermes", None)
    assert [c.name for c in parse_output(both, text).tool_calls] == ["a", "b"]


def test_auto_parser_reads_the_template():
    assert choose_parser("auto", "{% if tools %}<tool_call>{% endif %}").name == "hermes"
    assert choose_parser("auto", "[TOOL_CALLS]").name == "mistral"
    assert choose_parser("auto", "<|python_tag|>").name == "llama3_json"
    assert choose_parser("auto", "{{ messages }}") is None
    assert choose_parser("none", "<tool_call>") is None
    with pytest.raises(ValueError, match="needs a tool-call parser"):
        tool_setup(_req(), "auto", "{{ messages }}")


def test_required_schema_and_its_output():
    req = _req(tool_choice="required", parallel_tool_calls=False)
    schema = json.loads(tool_constraint(req, tool_setup(req, "auto", None)).json)
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    weather, time = schema["items"]["anyOf"]
    assert weather["properties"]["name"] == {"type": "string", "enum": ["get_weather"]}
    assert weather["properties"]["parameters"] == WEATHER["function"]["parameters"]
    assert time["properties"]["parameters"] == {"type": "object"}
    out = parse_output(ToolSetup("required"), '[{"name": "get_time", "parameters": {}}]')
    assert out.content is None and [(c.name, c.arguments) for c in out.tool_calls] == [
        ("get_time", "{}")
    ]
    assert parse_output(ToolSetup("required"), "[{").content == "[{"  # cut short: text


def test_named_schema_is_the_function_parameters():
    req = _req(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    setup = tool_setup(req, "none", None)
    assert json.loads(tool_constraint(req, setup).json) == WEATHER["function"]["parameters"]


def _run(stream: ToolStream, pieces: list[str]):
    text, out = "", []
    for i, p in enumerate(pieces):
        text += p
        out.append(stream.delta(text, i == len(pieces) - 1))
    return out


def test_stream_named_sends_the_head_once_then_argument_deltas():
    out = _run(ToolStream(ToolSetup("named", function="f")), ['{"a"', ": 1}"])
    (first,), (second,) = out[0][1], out[1][1]
    assert first.id.startswith("call_") and first.function.name == "f"
    assert first.function.arguments == '{"a"' and second.id is None
    assert second.function.arguments == ": 1}" and second.function.name is None


def test_stream_auto_holds_back_a_possible_tag_and_streams_the_call():
    setup = ToolSetup("auto", PARSERS["hermes"])
    pieces = [
        "Let me",
        " look.<tool",
        '_call>{"name": "get_time", ',
        '"arguments": {"tz": ',
        '"UTC"}}</tool_call>',
    ]
    out = _run(ToolStream(setup), pieces)
    assert [c for c, _ in out] == ["Let me", " look.", None, None, None]
    assert out[1][1] is None
    (head,) = out[2][1]  # the head as soon as the name is complete
    assert head.index == 0 and head.id.startswith("call_") and head.type == "function"
    assert head.function.name == "get_time" and head.function.arguments == ""
    assert [d.function.arguments for _, calls in out[3:] for d in calls] == ['{"tz": ', '"UTC"}']
    assert all(d.id is None and d.function.name is None for _, calls in out[3:] for d in calls)
    plain = _run(ToolStream(setup), ["Just <b>", "text"])
    assert "".join(c or "" for c, _ in plain) == "Just <b>text" and plain[-1][1] is None


# Two parallel calls per format, with arguments that split badly: braces, quotes and escapes
# inside strings, nesting, non-ASCII, a scalar last.
_ARGS = '{"q": "a}b{\\"c\\"]", "n": [1, {"x": null}], "s": "é\\\\", "t": true}'
_STREAMED = {
    "hermes": f'Checking.\n<tool_call>\n{{"name": "get_weather", "arguments": {_ARGS}}}\n'
    '</tool_call>\n<tool_call>{"arguments": {}, "name": "get_time"}</tool_call>',
    "llama3_json": f'<|python_tag|>{{"name": "get_weather", "parameters": {_ARGS}}}; '
    '{"name": "get_time"}',
    "mistral": f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {_ARGS}}}, '
    '{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}]',
    "mistral_args": f"Sure. [TOOL_CALLS]get_weather[ARGS]{_ARGS}[TOOL_CALLS]get_time[ARGS]{{}}",
    "required": f'[{{"name": "get_weather", "parameters": {_ARGS}}},\n {{"name": "get_time", '
    '"parameters": {"tz": 5}}]',
}


def _setup(fmt: str) -> ToolSetup:
    if fmt == "required":
        return ToolSetup("required")
    return ToolSetup("auto", PARSERS[fmt.removesuffix("_args")])


def _assemble(out):
    """The streamed deltas as OpenAI clients merge them: content, and per index id/name/args."""
    content, calls = "", {}
    for text, deltas in out:
        content += text or ""
        for d in deltas or []:
            if d.id is not None:
                assert d.index not in calls and d.index == len(calls)
                calls[d.index] = [d.id, d.function.name, ""]
            calls[d.index][2] += d.function.arguments or ""
    return content, [(name, args) for _, name, args in calls.values()]


@pytest.mark.parametrize("fmt", list(_STREAMED))
@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 1000])
def test_streamed_arguments_add_up_to_the_parsed_ones(fmt, chunk):
    text = _STREAMED[fmt]
    whole = parse_output(_setup(fmt), text)
    assert [c.name for c in whole.tool_calls] == ["get_weather", "get_time"]
    assert json.loads(whole.tool_calls[0].arguments) == json.loads(_ARGS)
    stream = ToolStream(_setup(fmt))
    out = _run(stream, [text[i : i + chunk] for i in range(0, len(text), chunk)])
    content, calls = _assemble(out)
    assert calls == [(c.name, c.arguments) for c in whole.tool_calls]
    assert content.strip() == (whole.content or "")
    assert not any(m in content for m in ("<tool", "[TOOL", "<|python", "{"))
    assert stream.parsed.tool_calls == whole.tool_calls


@pytest.mark.parametrize("fmt", ["hermes", "mistral_args", "required"])
def test_call_heads_and_arguments_stream_before_the_text_ends(fmt):
    text = _STREAMED[fmt]
    cut = text.index('"s"')  # inside the first call's arguments
    out = _run(ToolStream(_setup(fmt)), [text[:cut], text[cut:]])
    (head,) = out[0][1]
    assert head.function.name == "get_weather" and head.index == 0
    assert head.function.arguments.startswith("{") and head.function.arguments.endswith(", ")


@pytest.mark.parametrize(
    "fmt,text",
    [
        ("hermes", 'Hi <tool_call>{"name": "f", "arguments": {"a": }</tool_call>'),
        ("hermes", "Hi <tool_call>not json</tool_call>"),
        ("llama3_json", '{"x": 1} and more'),
        ("mistral", "[TOOL_CALLS]f[ARGS]{} trailing"),
        ("hermes", '<tool_call>{"name": "bad\\x", "arguments": {}}</tool_call>'),
        ("required", '[{"name": "f", "parameters": {"a": [}}]'),
    ],
)
def test_malformed_calls_are_content_whole_and_without_a_head_streamed(fmt, text):
    assert parse_output(_setup(fmt), text) == ParsedOutput(text)
    out = _run(ToolStream(_setup(fmt)), list(text))
    content, calls = _assemble(out)
    if not calls:
        assert content == text


def test_parallel_tool_calls_false_streams_only_the_first_call():
    setup = ToolSetup("auto", PARSERS["hermes"], single=True)
    text = _STREAMED["hermes"]
    _, calls = _assemble(_run(ToolStream(setup), list(text)))
    assert calls == [(c.name, c.arguments) for c in parse_output(setup, text).tool_calls]
    assert len(calls) == 1
