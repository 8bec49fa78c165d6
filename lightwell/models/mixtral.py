"""Mixtral (8x7B, 8x22B): a Mistral whose MLP is a sparse mixture of experts.

Each layer's ``block_sparse_moe`` routes a token to ``num_experts_per_tok`` of
``num_local_experts`` silu-gated experts (softmax over the router logits, top-k, renormalised
to sum to one). Checkpoint names: ``block_sparse_moe.gate`` (router) and
``block_sparse_moe.experts.{e}.w1`` (gate) / ``w3`` (up) / ``w2`` (down); they load into
``mlp.gate`` and the stacked ``mlp.experts`` (``lightwell/layers/moe.py``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from lightwell.layers.moe import RouterConfig
from lightwell.models.llama import LlamaAttention, LlamaForCausalLM, LlamaModel
from lightwell.models.moe_blocks import MoEBlock, MoEDecoderLayer, hf_skip, load_moe_weights
from lightwell.quant.base import QuantMethod

# HF's names, and the GGUF loader's (it names llama.cpp's stacked experts like Qwen's)
EXPERT_NAMES = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up",
                "down_proj": "down"}  # fmt: skip


class MixtralDecoderLayer(MoEDecoderLayer):
    def make_mlp(self, config: Any, layer_idx: int, quant_method: QuantMethod | None) -> nn.Module:
        router = RouterConfig(config.num_experts_per_tok, renormalize=True)
        return MoEBlock(config, router, config.intermediate_size, quant_method)


class MixtralForCausalLM(LlamaForCausalLM):
    def build_model(self, hf_config: Any, quant_method: QuantMethod | None) -> nn.Module:
        return LlamaModel(hf_config, quant_method, LlamaAttention, MixtralDecoderLayer)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        renamed = ((n.replace(".block_sparse_moe.", ".mlp."), t) for n, t in weights)
        return load_moe_weights(
            self, renamed, self.packed_modules_mapping, EXPERT_NAMES, hf_skip(self)
        )
