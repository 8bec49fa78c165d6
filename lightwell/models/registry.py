"""HF architecture name -> model class, imported only when that architecture is loaded."""

from __future__ import annotations

import importlib
from typing import Any

from torch import nn

# architecture (config.json "architectures") -> (module, class)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("lightwell.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("lightwell.models.mistral", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("lightwell.models.qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("lightwell.models.qwen3", "Qwen3ForCausalLM"),
    "Qwen3Model": ("lightwell.models.qwen3", "Qwen3Model"),  # embeddings (Qwen3-Embedding)
    "MiniCPMForCausalLM": ("lightwell.models.minicpm", "MiniCPMForCausalLM"),
    "CohereForCausalLM": ("lightwell.models.cohere", "CohereForCausalLM"),
    "MixtralForCausalLM": ("lightwell.models.mixtral", "MixtralForCausalLM"),
    "Qwen2MoeForCausalLM": ("lightwell.models.qwen_moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("lightwell.models.qwen_moe", "Qwen3MoeForCausalLM"),
    "DeepseekV2ForCausalLM": ("lightwell.models.deepseek_v2", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("lightwell.models.deepseek_v2", "DeepseekV3ForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(hf_config: Any) -> type[nn.Module]:
    """The class for the first architecture listed in ``hf_config`` that Lightwell supports."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    if not archs:
        raise ValueError(
            "the model config names no architecture (config.json 'architectures'); supported: "
            + ", ".join(supported_architectures())
        )
    for arch in archs:
        if arch in _MODELS:
            module, cls = _MODELS[arch]
            return getattr(importlib.import_module(module), cls)
    raise ValueError(
        f"model architecture {', '.join(archs)} is not supported; supported: "
        + ", ".join(supported_architectures())
    )
