"""OpenAI-compatible request and response schemas: the only pydantic in Lightwell.

Requests are strict (no type coercion: ``"0.5"`` is not a number) and closed: an unknown field
is a 400 naming it, never silently ignored. OpenAI fields that Lightwell does not implement are
declared only so that they can be refused with a precise message unless they hold their
harmless default (``tools: []``, ``audio: null`` ...). A few fields that
cannot change the generated tokens are accepted and ignored: ``user``, ``metadata``,
``service_tier``, ``safety_identifier``, ``prompt_cache_key``, ``parallel_tool_calls``,
``stream_options.include_obfuscation``. docs/serving.md lists every field.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from lightwell.server.protocol_tools import (
    STRUCTURED_FIELDS,
    DeltaToolCall,
    ParamError,
    ResponseFormat,
    StructuredOutputsRequest,
    ToolCall,
    ToolCallIn,
    ToolChoice,
    ToolDef,
    _Request,
    check_tools,
    structured_spec,
    template_tool_call,
    tool_mode,
)

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _refuse(name: str, why: str = "") -> ParamError:
    return ParamError(name, f"'{name}' is not supported by this server{why}")


class StreamOptions(_Request):
    include_usage: bool | None = False
    include_obfuscation: bool | None = None  # accepted, ignored: padding only, no effect on text


class SamplingRequest(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    n: int | None = Field(1, ge=1, le=128)  # OpenAI's own limit
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # Structured output: OpenAI's response_format, and vLLM's fields.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # Accepted and ignored: none of these can change the generated tokens.
    user: str | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    cache_salt: str | None = None  # prefix-cache isolation (vLLM)

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key in v or {}:
            digits = key.strip().lstrip("-")
            if not (digits.isascii() and digits.isdigit()):
                shown = repr(key) if len(repr(key)) <= 40 else repr(key)[:37] + "..."
                raise ParamError("logit_bias", f"logit_bias keys must be token ids (got {shown})")
        return v

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise ParamError("stream_options", "stream_options is only allowed with stream=true")
        self.structured_spec()  # at most one constraining field
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def structured_spec(self) -> tuple[str, dict[str, Any]] | None:
        """(the field used, StructuredOutputs keyword arguments), or None when the output is
        free. More than one constraining field is a 400."""
        return structured_spec({f: getattr(self, f) for f in STRUCTURED_FIELDS})


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise _refuse("suffix", " (no fill-in-the-middle)")
        return v

    @model_validator(mode="after")
    def _best_of_is_n(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of < (self.n or 1):
            raise ParamError("best_of", "best_of must be >= n")
        if self.best_of is not None and self.best_of > (self.n or 1) and self.stream:
            raise ParamError("best_of", "best_of > n cannot be streamed")
        if self.best_of is not None and self.best_of > 128:
            raise ParamError("best_of", "best_of must be <= 128")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ParamError("prompt", "prompt must not be an empty list")
        return self

    def prompt_list(self) -> list[str | list[int]]:
        """The prompts as a list of texts and token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(t, int) for t in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class TextContentPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: the call this message answers

    @model_validator(mode="after")
    def _tool_fields(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ParamError("messages", "only assistant messages carry tool_calls")
        if self.role == "tool" and self.tool_call_id is None:
            raise ParamError("messages", "a tool message needs tool_call_id")
        for call in self.tool_calls or []:
            template_tool_call(call)  # arguments that are not JSON text: a 400 here
        return self

    def to_template(self) -> dict[str, Any]:
        """The message as the chat template sees it (developer is the system role)."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        msg: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": content or "",
        }
        if self.name is not None:
            msg["name"] = self.name
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        if self.tool_calls:  # templates read the arguments as an object (as vLLM passes them)
            msg["tool_calls"] = [template_tool_call(c) for c in self.tool_calls]
        return msg


# Chat fields that Lightwell refuses unless they hold a value that changes nothing.
_CHAT_HARMLESS: dict[str, Any] = {
    "functions": lambda v: not v,
    "function_call": lambda v: v in (None, "none"),
    "modalities": lambda v: v is None or v == ["text"],
    "audio": lambda v: v is None,
    "prediction": lambda v: v is None,
    "reasoning_effort": lambda v: v is None,
    "verbosity": lambda v: v is None,
    "web_search_options": lambda v: v is None,
    "store": lambda v: not v,
}


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    parallel_tool_calls: bool | None = None  # False: at most one tool call
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    functions: Any = None
    function_call: Any = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    store: Any = None

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        for name, harmless in _CHAT_HARMLESS.items():
            if not harmless(getattr(self, name)):
                raise _refuse(name)
        if self.top_logprobs is not None and not self.logprobs:
            raise ParamError("top_logprobs", "top_logprobs needs logprobs=true")
        check_tools(self.tools, self.tool_choice, self.tool_mode, self.structured_spec())
        return self

    @property
    def tool_mode(self) -> str:
        """none (no tools), auto, required or named (a function's name in tool_choice)."""
        return tool_mode(self.tools, self.tool_choice)

    @property
    def max_output_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ParamError("prompt", "give exactly one of 'prompt' and 'messages'")
        return self


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


# ---- responses (plain models: never validated from client input) -----------------------------
def _now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None
    refusal: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "lightwell"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
