"""Qwen1.5-MoE / Qwen2-MoE (``Qwen2MoeForCausalLM``) and Qwen3-MoE (``Qwen3MoeForCausalLM``).

Both: softmax top-k routing, renormalised when ``norm_topk_prob``; sparse layers are those
with ``(i + 1) % decoder_sparse_step == 0`` and not in ``mlp_only_layers`` (the others have a
dense MLP of ``intermediate_size``); experts of ``moe_intermediate_size``.
Qwen2-MoE: Qwen2's attention (q/k/v biases) and a shared expert of
``shared_expert_intermediate_size`` scaled per token by ``sigmoid(shared_expert_gate(x))``.
Qwen3-MoE: Qwen3's attention (per-head q/k RMSNorm), no shared expert.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from lightwell.layers.moe import RouterConfig
from lightwell.models.llama import LlamaForCausalLM, LlamaModel
from lightwell.models.moe_blocks import (
    MoEBlock,
    MoEDecoderLayer,
    gated_mlp,
    hf_skip,
    load_moe_weights,
    num_experts_of,
)
from lightwell.models.qwen2 import Qwen2Attention
from lightwell.models.qwen3 import Qwen3Attention
from lightwell.quant.base import QuantMethod

EXPERT_NAMES = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


def is_sparse_layer(config: Any, layer_idx: int) -> bool:
    step = getattr(config, "decoder_sparse_step", 1) or 1
    dense = getattr(config, "mlp_only_layers", None) or []
    return num_experts_of(config) > 0 and layer_idx not in dense and (layer_idx + 1) % step == 0


class Qwen2MoeDecoderLayer(MoEDecoderLayer):
    shared_expert = True

    def make_mlp(self, config: Any, layer_idx: int, quant_method: QuantMethod | None) -> nn.Module:
        if not is_sparse_layer(config, layer_idx):
            return gated_mlp(config, config.intermediate_size, quant_method)
        router = RouterConfig(
            config.num_experts_per_tok, renormalize=bool(getattr(config, "norm_topk_prob", False))
        )
        shared = None
        if self.shared_expert and getattr(config, "shared_expert_intermediate_size", 0):
            shared = ("shared_expert", config.shared_expert_intermediate_size)
        return MoEBlock(
            config,
            router,
            config.moe_intermediate_size,
            quant_method,
            shared=shared,
            shared_gate=shared is not None,
        )


class Qwen3MoeDecoderLayer(Qwen2MoeDecoderLayer):
    shared_expert = False


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    attention_cls: type[nn.Module] = Qwen2Attention
    layer_cls: type[nn.Module] = Qwen2MoeDecoderLayer

    def build_model(self, hf_config: Any, quant_method: QuantMethod | None) -> nn.Module:
        return LlamaModel(hf_config, quant_method, self.attention_cls, self.layer_cls)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_moe_weights(
            self, weights, self.packed_modules_mapping, EXPERT_NAMES, hf_skip(self)
        )


class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    attention_cls = Qwen3Attention
    layer_cls = Qwen3MoeDecoderLayer
