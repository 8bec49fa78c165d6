"""Request and response schemas of structured output and tool calling (pydantic, with
protocol.py): ``response_format``, vLLM's ``structured_outputs``, ``tools``, ``tool_choice``,
assistant ``tool_calls`` and their streamed deltas."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class ParamError(ValueError):
    """A request field with an invalid or unsupported value; ``param`` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


class _Request(BaseModel):
    """Strict (no type coercion) and closed (an unknown field is a 400)."""

    model_config = ConfigDict(extra="forbid", strict=True)


class JsonSchemaSpec(_Request):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # accepted: the schema is always enforced


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and (
            self.json_schema is None or not self.json_schema.schema_
        ):
            raise ParamError(
                "response_format", "response_format json_schema needs json_schema.schema"
            )
        return self


class StructuredOutputsRequest(_Request):
    """vLLM's ``structured_outputs`` field: exactly one constraint."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


# Fields that constrain the output (docs/serving.md: structured output); at most one is used.
STRUCTURED_FIELDS = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)


def constrains(name: str, value: Any) -> bool:
    """Whether a structured-output field holds a constraint (``response_format: text`` does not)."""
    if name == "response_format":
        return value is not None and value.type != "text"
    return value is not None


# ---- tools -----------------------------------------------------------------------------------
class FunctionDef(_Request):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # accepted: with tool_choice required / named the schema is enforced


class ToolDef(_Request):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCallIn(_Request):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallIn(_Request):
    """An assistant message's earlier tool call, in a conversation's history."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


def tool_mode(tools: list[ToolDef] | None, choice: Any) -> str:
    """none (no tools, or tool_choice none), auto, required or named."""
    if not tools or choice == "none":
        return "none"
    if choice is None:
        return "auto"
    return choice if isinstance(choice, str) else "named"


def check_tools(
    tools: list[ToolDef] | None, choice: Any, mode: str, structured: tuple | None
) -> None:
    """ParamError for tools that cannot be served as asked."""
    names = [t.function.name for t in tools or []]
    if len(set(names)) < len(names):
        raise ParamError("tools", "tools must have distinct function names")
    if choice not in (None, "none") and not names:
        raise ParamError("tool_choice", "tool_choice needs tools")
    if mode == "named" and choice.function.name not in names:
        raise ParamError(
            "tool_choice", f"tool_choice names {choice.function.name!r}, which is not in tools"
        )
    if mode in ("required", "named") and structured is not None:
        raise ParamError(
            "tool_choice",
            f"tool_choice required or a named function cannot be combined with {structured[0]}",
        )


def template_tool_call(call: ToolCallIn) -> dict[str, Any]:
    try:
        arguments: Any = json.loads(call.function.arguments)
    except ValueError:
        raise ParamError(
            "messages", f"tool call arguments must be JSON text (got {call.function.arguments!r})"
        ) from None
    out: dict[str, Any] = {"type": "function"}
    out["function"] = {"name": call.function.name, "arguments": arguments}
    if call.id is not None:
        out["id"] = call.id
    return out


def structured_spec(fields: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """(the field used, StructuredOutputs keyword arguments) from a request's structured-output
    fields, or None; ParamError when more than one constrains."""
    given = [f for f in STRUCTURED_FIELDS if constrains(f, fields.get(f))]
    if len(given) > 1:
        raise ParamError(given[1], f"give at most one of {', '.join(given)}")
    if not given:
        return None
    name, v = given[0], fields[given[0]]
    if name == "response_format":
        if v.type == "json_object":
            return name, {"json_object": True}
        return name, {"json": v.json_schema.schema_}
    if name == "structured_outputs":
        kw = v.model_dump(by_alias=True, exclude_none=True)
        if kw.get("json_object") is False:
            kw.pop("json_object")
        return name, kw
    return name, {name.removeprefix("guided_"): v}
