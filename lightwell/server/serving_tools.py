"""Tool calling for /v1/chat/completions: the tools the chat template sees, the JSON schema that
constrains ``tool_choice`` required / a named function (so arguments always parse), and the
model's text turned into OpenAI ``tool_calls``, whole or as streamed deltas (each call's head as
soon as its name is known, then its arguments as they are generated).

- ``none``: no tools in the prompt, plain text out.
- ``auto``: the tools are in the prompt; the output is parsed by the server's tool-call parser
  (``--tool-call-parser``); calls become ``tool_calls``, ``finish_reason: "tool_calls"``.
- ``required``: the output is constrained to a JSON list of ``{"name", "parameters"}`` over the
  tools (at most one item with ``parallel_tool_calls: false``).
- named: the output is constrained to the function's ``parameters`` schema; it is the call's
  arguments (``finish_reason: "stop"``, as OpenAI answers a forced function).
"""

from __future__ import annotations

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
from lightwell.server.tool_parsers import (
    ParsedOutput,
    ParsedToolCall,
    RequiredSplitter,
    Splitter,
    choose_parser,
    parse_with,
)
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
    if setup.mode == "required":  # cut short by max_tokens: the text as content
        return parse_with(RequiredSplitter(), text)
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
    """One streamed choice: text deltas -> content deltas and ``tool_calls`` deltas, as OpenAI
    streams them. Content streams until a call may have begun (a marker's possible beginning is
    held back); a call's head (``index``, ``id``, ``type``, ``function.name``) goes out once its
    name is complete, then its arguments as the model writes them. The arguments streamed add up
    to those of the whole answer; a call whose JSON turns out malformed after its name went out
    stays as sent (the whole answer would give the text as content instead)."""

    setup: ToolSetup
    sent: int = 0  # characters of the text sent as content (or, named, as arguments)
    call_id: str = field(default_factory=new_call_id)
    parsed: ParsedOutput | None = None  # set when the choice finished
    splitter: Splitter | None = None
    args_sent: list[int] = field(default_factory=list)  # per call whose head went out

    def __post_init__(self) -> None:
        if self.setup.mode == "required":
            self.splitter = RequiredSplitter()
        elif self.setup.mode == "auto" and self.setup.parser is not None:
            self.splitter = self.setup.parser.splitter()

    def delta(self, text: str, finished: bool) -> tuple[str | None, list[DeltaToolCall] | None]:
        """(content delta, tool-call deltas) for the choice's text so far."""
        if self.setup.mode == "named":
            return None, self._named(text)
        sp = self.splitter
        if sp is None:
            content, self.sent = text[self.sent :], len(text)
            return content or None, None
        sp.feed(text)
        if finished:
            sp.finish(text)
            self.parsed = parse_output(self.setup, text)
        calls = self._calls(text, sp)
        end = sp.content_hold(text)
        if finished and not self.parsed.tool_calls and not self.args_sent:
            end = len(text)  # no call after all: the held-back text is content
        content = text[self.sent : end] if end > self.sent else None
        self.sent = max(self.sent, end)
        return content or None, calls or None

    def _calls(self, text: str, sp: Splitter) -> list[DeltaToolCall]:
        out = []
        for i, call in enumerate(sp.calls[: 1 if self.setup.single else None]):
            name = None
            if i == len(self.args_sent):  # its head has not gone out
                name = call.name(text)
                if name is None:
                    break
                self.args_sent.append(0)
            args = call.arguments(text)
            new, self.args_sent[i] = args[self.args_sent[i] :], len(args)
            if name is not None:
                fn = DeltaFunctionCall(name=name, arguments=new)
                out.append(DeltaToolCall(index=i, id=new_call_id(), type="function", function=fn))
            elif new:
                out.append(DeltaToolCall(index=i, function=DeltaFunctionCall(arguments=new)))
        return out

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
