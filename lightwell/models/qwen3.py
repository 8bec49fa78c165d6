"""Qwen3 (dense): a Llama with per-head RMSNorm on q and k before RoPE.

``q_norm`` / ``k_norm`` have one weight of ``head_dim`` shared by every head (so tensor
parallelism leaves them whole); ``head_dim`` is explicit in the config and usually not
``hidden_size / num_attention_heads`` (Qwen3-0.6B: 1024 / 16 heads, head_dim 128). Biases follow
``attention_bias`` (off in the released models); sliding windows as in Qwen2 (``layer_types``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from lightwell.layers.norm import RMSNorm
from lightwell.layers.rotary import RotaryEmbedding
from lightwell.models.llama import LlamaAttention, LlamaForCausalLM, LlamaModel
from lightwell.quant.base import QuantMethod


class Qwen3Attention(LlamaAttention):
    def __init__(
        self,
        config: Any,
        layer_idx: int,
        rotary_emb: RotaryEmbedding,
        quant_method: QuantMethod | None,
    ):
        super().__init__(config, layer_idx, rotary_emb, quant_method)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def norm_qk(
        self,
        q: torch.Tensor,  # [T, Hq * D / tp]
        k: torch.Tensor,  # [T, Hkv * D / tp]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.head_dim
        q = self.q_norm(q.reshape(-1, d)).view(q.shape)  # [T * Hq / tp, D] -> back
        k = self.k_norm(k.reshape(-1, d)).view(k.shape)
        return q, k


class Qwen3ForCausalLM(LlamaForCausalLM):
    def build_model(self, hf_config: Any, quant_method: QuantMethod | None) -> nn.Module:
        return LlamaModel(hf_config, quant_method, attention_cls=Qwen3Attention)


class Qwen3Model(Qwen3ForCausalLM):
    """The bare Qwen3 transformer (Qwen3-Embedding's architecture): no LM head in the
    checkpoint, tensor names without the ``model.`` prefix. Served with --task embed; the head
    is tied to the embedding so that the class stays a Qwen3ForCausalLM (never sampled from)."""

    def __init__(self, hf_config: Any, quant_method: QuantMethod | None = None):
        hf_config.tie_word_embeddings = True
        super().__init__(hf_config, quant_method)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        prefixed = ((n if n.startswith("model.") else f"model.{n}", w) for n, w in weights)
        return super().load_weights(prefixed)
