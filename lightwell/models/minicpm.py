"""MiniCPM 1/2 (``MiniCPMForCausalLM``, e.g. MiniCPM-1B/2B): a Llama with muP-style scalings.

  embeddings  ``embed_tokens(ids) * scale_emb``,
  residuals   every attention and MLP output times ``scale_depth / sqrt(num_hidden_layers)``
              before it joins the residual stream,
  logits      ``lm_head(hidden / (hidden_size / dim_model_base))``.
Weights carry Llama's names (embeddings usually tied). MiniCPM shipped as remote code that
transformers does not include (nor do we run it): ``hf_config`` reads its config.json into a
``LlamaConfig`` that keeps the extra fields. MiniCPM-MoE and MiniCPM3/4 (MLA, longrope) are
other architectures and are refused.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from lightwell.layers.norm import pre_norm
from lightwell.layers.rotary import RotaryEmbedding
from lightwell.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
)
from lightwell.quant.base import QuantMethod


class MiniCPMDecoderLayer(LlamaDecoderLayer):
    def __init__(
        self,
        config: Any,
        layer_idx: int,
        rotary_emb: RotaryEmbedding,
        quant_method: QuantMethod | None,
        attention_cls: type[LlamaAttention] = LlamaAttention,
    ):
        super().__init__(config, layer_idx, rotary_emb, quant_method, attention_cls)
        self.residual_scale = _scale(config, "scale_depth") / math.sqrt(config.num_hidden_layers)

    def forward(
        self,
        positions: torch.Tensor,  # [T]
        hidden: torch.Tensor,  # [T, H]: the previous layer's scaled output
        residual: torch.Tensor | None,  # [T, H]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, H] scaled, not yet added; [T, H])
        hidden, residual = pre_norm(self.input_layernorm, hidden, residual)
        hidden = self.self_attn(positions, hidden) * self.residual_scale
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden) * self.residual_scale, residual


class MiniCPMModel(LlamaModel):
    def __init__(self, config: Any, quant_method: QuantMethod | None):
        super().__init__(config, quant_method, layer_cls=MiniCPMDecoderLayer)
        self.scale_emb = _scale(config, "scale_emb")

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        return self.embed_tokens(input_ids) * self.scale_emb


class MiniCPMForCausalLM(LlamaForCausalLM):
    def __init__(self, hf_config: Any, quant_method: QuantMethod | None = None):
        _check_config(hf_config)
        super().__init__(hf_config, quant_method)
        self.scale_width = hf_config.hidden_size / _scale(hf_config, "dim_model_base")

    def build_model(self, hf_config: Any, quant_method: QuantMethod | None) -> nn.Module:
        return MiniCPMModel(hf_config, quant_method)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, V] fp32
        return self.lm_head.compute_logits(hidden / self.scale_width).float()


def _check_config(config: Any) -> None:
    if getattr(config, "num_experts", None):
        raise ValueError("MiniCPM-MoE (num_experts in the config) is not supported yet")


def _scale(config: Any, key: str) -> float:
    return float(getattr(config, key, 1))  # MiniCPM's own config class defaults them to 1
