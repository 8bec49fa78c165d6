"""/v1/embeddings request and response schemas (pydantic, with protocol.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, model_validator

from lightwell.server.protocol_tools import ParamError, _Request


class EmbeddingRequest(_Request):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] | None = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None  # accepted, ignored

    @model_validator(mode="after")
    def _not_empty(self) -> EmbeddingRequest:
        if isinstance(self.input, list) and not self.input:
            raise ParamError("input", "input must not be an empty list")
        return self

    def input_list(self) -> list[str | list[int]]:
        """The inputs as a list of texts and token-id lists."""
        x = self.input
        if isinstance(x, str):
            return [x]
        if all(isinstance(t, int) for t in x):
            return [list(x)]  # type: ignore[arg-type]
        return list(x)  # type: ignore[arg-type]


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # base64: the little-endian float32 bytes


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage
