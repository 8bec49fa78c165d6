"""Tool calling for /v1/chat/completions: the tools the chat template sees, the JSON schema that
constrains ``tool_choice`` required / a named function (so arguments always parse), and the
model's text turned into OpenAI ``tool_calls``, whole or as streamed deltas.

- ``none``: no tools in the prompt, plain text out.
- ``auto``: the tools are in the prompt; the output is parsed by the server's tool-call parser
  (``--tool-call-parser``); calls become ``tool_calls``, ``finish_reason: "tool_calls"``.
- ``required``: the output is constrained to a JSON list of ``{"name", "parameters"}`` over the
  tools (at most one item with ``parallel_tool_calls: false``).
- named: the output is constrained to the function's ``parameters`` schema; it is the call's
  arguments (``finish_reason: "stop"``, as OpenAI answers a forced function).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from lightwell.server.protocol import ChatCompletionRequest
from lightwell.server.protocol_tools import (
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from lightwell.server.tool_parsers import ParsedOutput, ParsedToolCall, choose_parser
from lightwell.types import StructuredOutputs

_ANY_OBJECT = {"type": "object"}


@dataclass
class ToolSetup:
    mode: str  # none, auto, required, named
    parser: Any | None = None  # auto: the tool-call parser
    function: str | None = None  # named: the function's name
    single: bool = False  # parallel_tool_calls false: auto keeps only the first call


def tool_setup(
    req: ChatCompletionRequest, parser_option: str, chat_template: str | None
) -> ToolSetup:
    """``ValueError`` when ``auto`` has no parser to read the model's calls with."""
    mode = req.tool_mode
    if mode == "named":
        return ToolSetup(mode, function=req.tool_choice.function.name)  # type: ignore[union-attr]
    if mode != "auto":
        return ToolSetup(mode)
    parser = choose_parser(parser_option, chat_template)
    single = req.parallel_tool_calls is False
    if parser is None:
        raise ValueError(
            "tool_choice 'auto' needs a tool-call parser, and this model's chat template names "
            "no known tool-call format: start the server with --tool-call-parser, or use "
            "tool_choice 'required' or a named function"
        )
    return ToolSetup(mode, parser, single=single)


def template_tools(req: ChatCompletionRequest) -> list[dict] | None:
    """The tools as the chat template takes them (none when tool_choice is none)."""
    if req.tool_mode == "none":
        return None
    return [t.model_dump(exclude_none=True) for t in req.tools or []]


def tool_constraint(req: ChatCompletionRequest, setup: ToolSetup) -> StructuredOutputs | None:
    """The output's JSON schema for required / named; None otherwise."""
    params = {t.function.name: t.function.parameters or _ANY_OBJECT for t in req.tools or []}
    if setup.mode == "named":
        return StructuredOutputs(json=params[setup.function])
    if setup.mode != "required":
        return None
    items = [
        {
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for name, schema in params.items()
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if req.parallel_tool_calls is False:
        schema["maxItems"] = 1
    return StructuredOutputs(json=schema)


def parse_output(setup: ToolSetup, text: str) -> ParsedOutput:
    """The finished text of one choice as content and tool calls."""
    if setup.mode == "named":
        return ParsedOutput(None, [ParsedToolCall(setup.function or "", text)])
    if setup.mode == "required":
        try:
            items = json.loads(text)
            calls = [
                ParsedToolCall(i["name"], json.dumps(i["parameters"], ensure_ascii=False))
                for i in items
            ]
        except (ValueError, TypeError, KeyError):  # cut short by max_tokens
            return ParsedOutput(text)
        return ParsedOutput(None, calls)
    if setup.mode == "auto" and setup.parser is not None:
        parsed = setup.parser.parse(text)
        if setup.single:
            parsed.tool_calls = parsed.tool_calls[:1]
        return parsed
    return ParsedOutput(text)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_calls(parsed: ParsedOutput) -> list[ToolCall] | None:
    if not parsed.tool_calls:
        return None
    return [
        ToolCall(id=new_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
        for c in parsed.tool_calls
    ]


def finish_reason(setup: ToolSetup, parsed: ParsedOutput, reason: str | None) -> str | None:
    """``tool_calls`` when the model chose to call (auto / required) and stopped by itself."""
    if reason == "stop" and parsed.tool_calls and setup.mode in ("auto", "required"):
        return "tool_calls"
    return reason


@dataclass
class ToolStream:
    """One streamed choice: text deltas -> content deltas and ``tool_calls`` deltas. Content
    streams as it comes until a parser's start marker may have begun (held back from then);
    the calls are sent when the choice finishes (named: the arguments stream as they come)."""

    setup: ToolSetup
    sent: int = 0  # characters of the text sent as content (or, named, as arguments)
    call_id: str = field(default_factory=new_call_id)
    parsed: ParsedOutput | None = None  # set when the choice finished

    def delta(self, text: str, finished: bool) -> tuple[str | None, list[DeltaToolCall] | None]:
        """(content delta, tool-call deltas) for the choice's text so far."""
        if self.setup.mode == "named":
            return None, self._named(text)
        if not finished:
            end = self._safe_end(text)
            content, self.sent = text[self.sent : end], max(self.sent, end)
            return content or None, None
        self.parsed = parse_output(self.setup, text)
        if not self.parsed.tool_calls:
            content, self.sent = text[self.sent :], len(text)
            return content or None, None
        head = self._before_calls(text)
        content = text[self.sent : head] if head > self.sent else None
        self.sent = len(text)
        deltas = [
            DeltaToolCall(
                index=i,
                id=new_call_id(),
                type="function",
                function=DeltaFunctionCall(name=c.name, arguments=c.arguments),
            )
            for i, c in enumerate(self.parsed.tool_calls)
        ]
        return content or None, deltas

    def _named(self, text: str) -> list[DeltaToolCall] | None:
        new, first = text[self.sent :], self.sent == 0 and self.call_id != ""
        if not new and not first:
            return None
        self.sent = len(text)
        if first:
            self.call_id, call_id = "", self.call_id  # the head goes out once
            fn = DeltaFunctionCall(name=self.setup.function, arguments=new)
            return [DeltaToolCall(index=0, id=call_id, type="function", function=fn)]
        return [DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=new))]

    def _safe_end(self, text: str) -> int:
        """Where content may be sent up to: before any start of a tool call (or its prefix)."""
        if self.setup.mode == "required":
            return 0  # the whole output is the calls
        parser = self.setup.parser
        if parser is None:
            return len(text)
        if parser.name == "llama3_json":  # calls are the whole output, if any
            head = text.lstrip()
            return 0 if not head or "{<".startswith(head[0]) or head[0] in "{<" else len(text)
        return _before_markers(text, parser.start_markers)

    def _before_calls(self, text: str) -> int:
        parser = self.setup.parser
        if self.setup.mode != "auto" or parser is None or parser.name == "llama3_json":
            return 0
        found = [text.find(m) for m in parser.start_markers if m in text]
        return min(found) if found else len(text)


def _before_markers(text: str, markers: tuple[str, ...]) -> int:
    """The first marker's position, else the length minus a tail that could begin one."""
    found = [text.find(m) for m in markers if m in text]
    if found:
        return min(found)
    for cut in range(max(len(m) for m in markers) - 1, 0, -1):
        if any(m.startswith(text[-cut:]) for m in markers) and len(text) >= cut:
            return len(text) - cut
    return len(text)
