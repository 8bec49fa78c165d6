"""DeepSeek-V2 / V2-Lite (``DeepseekV2ForCausalLM``) and DeepSeek-V3 / R1
(``DeepseekV3ForCausalLM``): multi-head latent attention (``lightwell/layers/mla.py``) and
mixture-of-experts MLPs with shared experts.

The first ``first_k_dense_replace`` layers have a dense MLP of ``intermediate_size``; the
others (every ``moe_layer_freq``-th) route to ``num_experts_per_tok`` of ``n_routed_experts``
experts of ``moe_intermediate_size`` plus ``n_shared_experts`` always-on ones (one MLP of
``n_shared_experts * moe_intermediate_size``; unquantized, stacked after the routed experts as
weight-1 choices of every token: ``lightwell/models/moe_blocks.py``), routed weights times
``routed_scaling_factor``.
Routing: V2 softmax, ``topk_method`` "greedy" or "group_limited_greedy" (the ``topk_group``
best of ``n_group`` groups by their best expert); V3 ("noaux_tc") sigmoid scores plus
``e_score_correction_bias`` for the choice, groups ranked by their two best, weights
renormalised when ``norm_topk_prob``. RoPE on interleaved pairs (V3's ``rope_interleave``
False: on halves), YaRN with DeepSeek's mscale. V3's multi-token-prediction layers (stored
after the last layer) are skipped at load.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from lightwell.distributed.pipeline import is_last_stage
from lightwell.layers.mla import MLAttention
from lightwell.layers.moe import FusedMoE, RouterConfig
from lightwell.layers.rotary import get_rope
from lightwell.models.hf_config import get_rope_config
from lightwell.models.llama import LlamaForCausalLM, LlamaModel
from lightwell.models.moe_blocks import (
    MoEBlock,
    MoEDecoderLayer,
    dequantized_8bit,
    gated_mlp,
    hf_skip,
    load_moe_weights,
)
from lightwell.models.pipeline import make_layers, on_stage, stage_embedding
from lightwell.quant.base import QuantMethod

logger = logging.getLogger(__name__)
EXPERT_NAMES = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def router_of(config: Any) -> RouterConfig:
    v3 = getattr(config, "model_type", "") == "deepseek_v3"  # V3's config class has no field
    method = getattr(config, "topk_method", None) or ("noaux_tc" if v3 else "greedy")
    if method not in ("greedy", "group_limited_greedy", "noaux_tc"):
        raise ValueError(f"DeepSeek topk_method {method!r} is not supported")
    grouped = method != "greedy"
    return RouterConfig(
        config.num_experts_per_tok,
        renormalize=bool(getattr(config, "norm_topk_prob", False))
        and config.num_experts_per_tok > 1,
        scoring="sigmoid" if method == "noaux_tc" else "softmax",
        num_groups=(getattr(config, "n_group", None) or 1) if grouped else 1,
        topk_groups=(getattr(config, "topk_group", None) or 1) if grouped else 1,
        group_score="top2" if method == "noaux_tc" else "max",
        scaling=float(getattr(config, "routed_scaling_factor", 1.0) or 1.0),
    )


_SHARED = re.compile(r"^(.*)\.shared_experts\.(gate_proj|up_proj|down_proj)\.weight$")


def shared_as_experts(
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """DeepSeek's ``...mlp.shared_experts.{proj}.weight`` ([S * I, H]; down [H, S * I]) as S
    per-expert tensors ``...mlp.experts.{E + s}.{proj}.weight`` where that block stacks its
    shared experts (``FusedMoE.num_shared``); other tensors unchanged."""
    stacked = {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, FusedMoE) and module.num_shared
    }
    for name, tensor in weights:
        match = _SHARED.match(name)
        experts = stacked.get(f"{match.group(1)}.experts") if match else None
        if experts is None:
            yield name, tensor
            continue
        prefix, proj = match.group(1), match.group(2)
        dim = 1 if proj == "down_proj" else 0
        for s, part in enumerate(tensor.chunk(experts.num_shared, dim)):
            yield f"{prefix}.experts.{experts.num_experts + s}.{proj}.weight", part


class DeepseekV2DecoderLayer(MoEDecoderLayer):
    def make_mlp(self, config: Any, layer_idx: int, quant_method: QuantMethod | None) -> nn.Module:
        freq = getattr(config, "moe_layer_freq", 1) or 1
        if layer_idx < config.first_k_dense_replace or layer_idx % freq:
            return gated_mlp(config, config.intermediate_size, quant_method)
        shared = getattr(config, "n_shared_experts", 0) or 0
        return MoEBlock(
            config,
            router_of(config),
            config.moe_intermediate_size,
            quant_method,
            shared=("shared_experts", shared * config.moe_intermediate_size) if shared else None,
            shared_experts=shared,
            correction_bias=router_of(config).scoring == "sigmoid",
            router_fp32=True,
        )


class DeepseekV2Model(LlamaModel):
    def __init__(self, config: Any, quant_method: QuantMethod | None):
        nn.Module.__init__(self)  # LlamaModel's layout, with RoPE over qk_rope_head_dim only
        self.embed_tokens = stage_embedding(config)
        rope = get_rope_config(config)
        dim = config.qk_rope_head_dim
        neox = not getattr(config, "rope_interleave", True)
        rotary = get_rope(dim, dim, config.max_position_embeddings, rope.theta, rope.scaling, neox)
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers,
            lambda i: DeepseekV2DecoderLayer(config, i, rotary, quant_method, MLAttention),
        )
        self.norm = on_stage(is_last_stage(), lambda: self.make_norm(config))


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    def build_model(self, hf_config: Any, quant_method: QuantMethod | None) -> nn.Module:
        self.linear_method = quant_method  # (its block size dequantizes an 8-bit kv_b_proj)
        return DeepseekV2Model(hf_config, quant_method)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_moe_weights(
            self,
            shared_as_experts(self, self._kv_b_dequantized(self._without_mtp(weights))),
            {"gate_up_proj": ["gate_proj", "up_proj"], **self._packed_attention()},
            EXPERT_NAMES,
            hf_skip(self),
        )

    def _packed_attention(self) -> dict[str, list[str]]:
        """The attention's fused projections (``MLAttention.packed_names``: every layer alike)."""
        attn = next((m for m in self.modules() if isinstance(m, MLAttention)), None)
        return attn.packed_names if attn is not None else {}

    def _without_mtp(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Drop the multi-token-prediction layers (numbered from ``num_hidden_layers``)."""
        num_layers, skipped = self.config.num_hidden_layers, 0
        for name, tensor in weights:
            match = _LAYER.match(name)
            if match is not None and int(match.group(1)) >= num_layers:
                skipped += 1
                continue
            yield name, tensor
        if skipped:
            logger.info(
                "skipped %d tensors of the multi-token-prediction layer(s) (for speculative "
                "decoding, not loaded)",
                skipped,
            )

    def _kv_b_dequantized(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """An 8-bit ``kv_b_proj`` in the model dtype: MLA absorbs it into the queries and the
        output (``lightwell/layers/mla.py``), so it is kept as a plain weight
        (``moe_blocks.dequantized_8bit``: block FP8 as DeepSeek-V3/R1 publish it, or
        compressed-tensors int8 / fp8 with a scale per row or per tensor)."""
        block = getattr(self.linear_method, "block", (128, 128))
        return dequantized_8bit(weights, lambda module: module.endswith(".kv_b_proj"), block)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    pass
