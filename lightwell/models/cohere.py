"""Cohere Command-R (``CohereForCausalLM``: Command-R v01, Command R+, Aya 23).

How it differs from Llama:
  - LayerNorm with a weight and no bias (mean subtracted), not RMSNorm;
  - a parallel block: attention and MLP both read the same normed input and their sum joins the
    residual (``x + attn(norm(x)) + mlp(norm(x))``; one norm per layer); under tensor
    parallelism the two partial outputs are summed before a single all-reduce;
  - GPT-J style (interleaved pairs) RoPE;
  - logits multiplied by ``logit_scale``; embeddings tied by default;
  - Command R+ (``use_qk_norm``): a per-head LayerNorm on q and k before RoPE, with one weight
    row per head (sharded by head under tensor parallelism).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightwell.distributed.parallel_state import tp_all_reduce
from lightwell.layers.linear import _load_sharded
from lightwell.layers.norm import LayerNorm, pre_norm
from lightwell.layers.rotary import RotaryEmbedding
from lightwell.models.llama import (
    LlamaAttention,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
)
from lightwell.quant.base import QuantMethod, set_weight_attrs


def _head_norm(total_heads: int, first: int, count: int, head_dim: int, eps: float) -> LayerNorm:
    """A per-head LayerNorm holding rows ``first:first + count`` of the checkpoint's
    [total_heads, head_dim] weight."""
    norm = LayerNorm((count, head_dim), eps)

    def load(param: torch.Tensor, loaded: torch.Tensor) -> None:
        _load_sharded(param, loaded, 0, 0, count, first, total_heads)

    set_weight_attrs(norm.weight, {"weight_loader": load})
    return norm


class CohereAttention(LlamaAttention):
    def __init__(
        self,
        config: Any,
        layer_idx: int,
        rotary_emb: RotaryEmbedding,
        quant_method: QuantMethod | None,
    ):
        super().__init__(config, layer_idx, rotary_emb, quant_method, reduce_results=False)
        self.use_qk_norm = bool(getattr(config, "use_qk_norm", False))
        if self.use_qk_norm:
            qkv, eps, d = self.qkv_proj, config.layer_norm_eps, self.head_dim
            hq, hkv = qkv.num_heads, qkv.num_kv_heads
            self.q_norm = _head_norm(qkv.total_num_heads, qkv.q_head_start, hq, d, eps)
            self.k_norm = _head_norm(qkv.total_num_kv_heads, qkv.kv_head_start, hkv, d, eps)

    def norm_qk(
        self,
        q: torch.Tensor,  # [T, Hq * D / tp]
        k: torch.Tensor,  # [T, Hkv * D / tp]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.use_qk_norm:
            return q, k
        t, d = q.shape[0], self.head_dim
        q = self.q_norm(q.reshape(t, -1, d)).reshape(t, -1)  # via [T, Hq / tp, D]
        k = self.k_norm(k.reshape(t, -1, d)).reshape(t, -1)
        return q, k


class CohereDecoderLayer(nn.Module):
    def __init__(
        self,
        config: Any,
        layer_idx: int,
        rotary_emb: RotaryEmbedding,
        quant_method: QuantMethod | None,
        attention_cls: type[nn.Module] | None = None,  # LlamaModel's hook; Cohere has its own
    ):
        super().__init__()
        self.input_layernorm = LayerNorm(config.hidden_size, config.layer_norm_eps)
        self.self_attn = CohereAttention(config, layer_idx, rotary_emb, quant_method)
        self.mlp = LlamaMLP(config, quant_method, reduce_results=False)

    def forward(
        self,
        positions: torch.Tensor,  # [T]
        hidden: torch.Tensor,  # [T, H]: the previous layer's output, not yet added
        residual: torch.Tensor | None,  # [T, H]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, H] attn + mlp; [T, H] residual)
        hidden, residual = pre_norm(self.input_layernorm, hidden, residual)
        out = self.self_attn(positions, hidden) + self.mlp(hidden)  # partial sums under TP
        return tp_all_reduce(out), residual


class CohereModel(LlamaModel):
    """LlamaModel's embedding/layers/final-norm loop with Cohere's layers, LayerNorm and
    GPT-J-style (interleaved) RoPE."""

    is_neox_style = False

    def __init__(self, config: Any, quant_method: QuantMethod | None):
        super().__init__(config, quant_method, layer_cls=CohereDecoderLayer)

    def make_norm(self, config: Any) -> nn.Module:
        return LayerNorm(config.hidden_size, config.layer_norm_eps)


class CohereForCausalLM(LlamaForCausalLM):
    def __init__(self, hf_config: Any, quant_method: QuantMethod | None = None):
        super().__init__(hf_config, quant_method)
        scale = getattr(hf_config, "logit_scale", None)
        self.logit_scale = 1.0 if scale is None else float(scale)

    def build_model(self, hf_config: Any, quant_method: QuantMethod | None) -> nn.Module:
        return CohereModel(hf_config, quant_method)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, V] fp32
        return self.lm_head.compute_logits(hidden).float() * self.logit_scale
