"""/v1/responses (basic text generation) request and response schemas (pydantic)."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from lightwell.server.protocol_tools import ParamError, _Request


class InputText(_Request):
    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: list[Any] | None = None  # an earlier output_text's, ignored


class InputMessage(_Request):
    type: Literal["message"] | None = None
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[InputText]
    id: str | None = None  # an earlier output message's, ignored
    status: str | None = None

    def to_template(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class ResponsesRequest(_Request):
    model: str | None = None
    input: str | list[InputMessage]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False
    store: bool | None = None  # nothing is stored: only false (or unset) is accepted
    user: str | None = None
    metadata: dict[str, str] | None = None

    @model_validator(mode="after")
    def _supported(self) -> ResponsesRequest:
        if self.stream:
            raise ParamError("stream", "'stream' is not supported on /v1/responses yet")
        if self.store:
            raise ParamError("store", "'store' is not supported: responses are not stored")
        if isinstance(self.input, list) and not self.input:
            raise ParamError("input", "input must not be an empty list")
        return self

    def messages(self) -> list[dict[str, Any]]:
        """The conversation for the chat template: instructions first, as a system message."""
        msgs = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            return [*msgs, {"role": "user", "content": self.input}]
        return [*msgs, *(m.to_template() for m in self.input)]


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class ResponseUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: dict[str, int] = Field(default_factory=lambda: {"cached_tokens": 0})
    output_tokens_details: dict[str, int] = Field(default_factory=lambda: {"reasoning_tokens": 0})


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["completed", "incomplete"]
    incomplete_details: IncompleteDetails | None = None
    model: str
    output: list[OutputMessage]
    usage: ResponseUsage
    parallel_tool_calls: bool = False
    tool_choice: str = "none"
    tools: list[Any] = Field(default_factory=list)
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    instructions: str | None = None
    error: Any = None
