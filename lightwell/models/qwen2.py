"""Qwen2 (and Qwen1.5, Qwen2.5: the same ``Qwen2ForCausalLM`` architecture).

A Llama with a bias on the q/k/v projections (always: the architecture implies it; none on
o_proj), tied embeddings on the small sizes, and optional sliding-window attention on the layers
that ``layer_types`` marks "sliding_attention" (HF derives those from ``use_sliding_window`` and
``max_window_layers``). Qwen2.5's long-context configs add YaRN rope scaling.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lightwell.layers.rotary import RotaryEmbedding
from lightwell.models.llama import LlamaAttention, LlamaForCausalLM, LlamaModel
from lightwell.quant.base import QuantMethod


class Qwen2Attention(LlamaAttention):
    def __init__(
        self,
        config: Any,
        layer_idx: int,
        rotary_emb: RotaryEmbedding,
        quant_method: QuantMethod | None,
    ):
        super().__init__(config, layer_idx, rotary_emb, quant_method, qkv_bias=True, o_bias=False)


class Qwen2ForCausalLM(LlamaForCausalLM):
    def build_model(self, hf_config: Any, quant_method: QuantMethod | None) -> nn.Module:
        return LlamaModel(hf_config, quant_method, attention_cls=Qwen2Attention)
