"""Lightwell: an LLM inference and serving engine."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightwell.config import EngineConfig
from lightwell.types import CompletionOutput, FinishReason, RequestOutput, SamplingParams

__version__ = "0.1.0"
__all__ = [
    "LLM",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "FinishReason",
    "EngineConfig",
    "__version__",
]

if TYPE_CHECKING:
    from lightwell.engine.llm import LLM


def __getattr__(name: str) -> Any:
    # LLM pulls in torch; import it only when asked for.
    if name == "LLM":
        from lightwell.engine.llm import LLM

        return LLM
    raise AttributeError(name)
