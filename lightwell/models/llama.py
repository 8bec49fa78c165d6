"""Llama (and Llama-shaped: SmolLM2, TinyLlama, Llama 2/3.x) decoder-only models.

Also the common blocks of the other dense families (mistral, qwen2, qwen3, minicpm, cohere):
``LlamaAttention`` (biases, per-layer sliding window from the config, a ``norm_qk`` hook run
before RoPE), ``LlamaMLP``, ``LlamaDecoderLayer`` and ``LlamaModel`` (which build the attention
and layer classes they are given), and ``LlamaForCausalLM`` (``build_model`` and
``compute_logits`` are the hooks a family overrides).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from lightwell.distributed.pipeline import is_last_stage
from lightwell.layers.activation import SiluAndMul
from lightwell.layers.attention import Attention
from lightwell.layers.embedding import ParallelLMHead
from lightwell.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from lightwell.layers.norm import RMSNorm, pre_norm, reduce_norm
from lightwell.layers.rotary import RotaryEmbedding, get_rope
from lightwell.models.hf_config import get_rope_config
from lightwell.models.pipeline import make_layers, on_stage, stage_embedding
from lightwell.models.weight_utils import load_packed_weights
from lightwell.quant.base import QuantMethod, input_quant


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def sliding_window_of(config: Any, layer_idx: int) -> int | None:
    """Layer ``layer_idx``'s sliding window: from ``layer_types`` when the config lists them
    (Qwen2/3: "sliding_attention" layers only), else ``sliding_window`` for every layer
    (Mistral; None means full attention)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if layer_types[layer_idx] == "sliding_attention" else None
    return window


def build_rope(config: Any, is_neox_style: bool = True) -> RotaryEmbedding:
    """The model's rotary table (shared by every layer) from its config's RoPE settings."""
    rope = get_rope_config(config)
    head_dim = head_dim_of(config)
    return get_rope(
        head_dim,
        int(head_dim * rope.partial_rotary_factor),
        config.max_position_embeddings,
        rope.theta,
        rope.scaling,
        is_neox_style,
    )


class LlamaMLP(nn.Module):
    def __init__(self, config: Any, quant_method: QuantMethod | None, reduce_results: bool = True):
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(
                f"Llama MLP supports hidden_act 'silu' only, not {config.hidden_act!r}"
            )
        bias = bool(getattr(config, "mlp_bias", False))
        inter = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [inter, inter], bias=bias, quant_method=quant_method
        )
        self.down_proj = RowParallelLinear(
            inter, config.hidden_size, bias, reduce_results, quant_method=quant_method
        )
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        gate_up = self.gate_up_proj(x)
        out = self.down_proj.fused_silu_mul(gate_up, reduce=True)  # where the method fuses it
        return out if out is not None else self.down_proj(self.act_fn(gate_up))

    def partial(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H], not all-reduced
        gate_up = self.gate_up_proj(x)
        out = self.down_proj.fused_silu_mul(gate_up, reduce=False)
        return out if out is not None else self.down_proj.partial(self.act_fn(gate_up))


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: Any,
        layer_idx: int,
        rotary_emb: RotaryEmbedding,
        quant_method: QuantMethod | None,
        *,
        qkv_bias: bool | None = None,  # None: config.attention_bias (as o_bias)
        o_bias: bool | None = None,
        reduce_results: bool = True,
    ):
        super().__init__()
        head_dim = self.head_dim = head_dim_of(config)
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        bias = bool(getattr(config, "attention_bias", False))
        qkv_bias = bias if qkv_bias is None else qkv_bias
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, head_dim, heads, kv_heads, qkv_bias, quant_method
        )
        self.o_proj = RowParallelLinear(
            heads * head_dim,
            config.hidden_size,
            bias if o_bias is None else o_bias,
            reduce_results,
            quant_method=quant_method,
            input_partition=self.qkv_proj.q_partition,
        )
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.rotary_emb = rotary_emb
        self.attn = Attention(
            self.qkv_proj.num_heads,
            head_dim,
            head_dim**-0.5,
            self.qkv_proj.num_kv_heads,
            sliding_window=sliding_window_of(config, layer_idx),
        )

    def norm_qk(
        self,
        q: torch.Tensor,  # [T, Hq * D / tp]
        k: torch.Tensor,  # [T, Hkv * D / tp]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head q/k normalisation before RoPE (Qwen3, Command R+); none for Llama."""
        return q, k

    def attend(
        self,
        positions: torch.Tensor,  # [T]
        hidden: torch.Tensor,  # [T, H]
    ) -> torch.Tensor:  # [T, Hq * D / tp]: the attention output, before o_proj
        qkv = self.qkv_proj(hidden)  # [T, (Hq + 2 * Hkv) * D / tp]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.norm_qk(q, k)
        return self.attn(q, k, v, rope=(self.rotary_emb, positions))

    def forward(
        self,
        positions: torch.Tensor,  # [T]
        hidden: torch.Tensor,  # [T, H]
    ) -> torch.Tensor:  # [T, H]
        return self.o_proj(self.attend(positions, hidden))

    def partial(
        self,
        positions: torch.Tensor,  # [T]
        hidden: torch.Tensor,  # [T, H]
    ) -> torch.Tensor:  # [T, H]: this rank's o_proj partial sum, not all-reduced
        return self.o_proj.partial(self.attend(positions, hidden))


_ATTN_ENTRIES = ("attend", "partial", "forward")  # where an attention module reads its input


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: Any,
        layer_idx: int,
        rotary_emb: RotaryEmbedding,
        quant_method: QuantMethod | None,
        attention_cls: type[LlamaAttention] = LlamaAttention,
    ):
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.self_attn = attention_cls(config, layer_idx, rotary_emb, quant_method)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.mlp = LlamaMLP(config, quant_method)

    @property
    def partial_output(self) -> bool:
        """Whether ``forward`` returns the MLP's partial sum, not all-reduced: whatever consumes
        it (the next layer's input norm, the model's final norm) all-reduces it, fused with its
        residual add + norm where the all-reduce strategy can (``reduce_norm``). True of this
        class's ``forward``; a subclass that overrides ``forward`` returns a reduced output
        (MiniCPM scales it after the all-reduce) unless it overrides this too."""
        return type(self).forward is LlamaDecoderLayer.forward

    def forward(
        self,
        positions: torch.Tensor,  # [T]
        hidden: torch.Tensor,  # [T, H]: the embedding, or the previous layer's partial sum
        residual: torch.Tensor | None,  # [T, H]; None before the first layer
    ) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, H] MLP partial sum, [T, H] residual)
        attn_quant, mlp_quant = self.norm_output_quant()
        hidden, residual = pre_norm(
            self.input_layernorm, hidden, residual, partial=True, quant=attn_quant
        )
        hidden = self.self_attn.partial(positions, hidden)
        hidden, residual = reduce_norm(
            self.post_attention_layernorm, hidden, residual, quant=mlp_quant
        )
        return self.mlp.partial(hidden), residual

    def norm_output_quant(self) -> tuple[Any, Any]:
        """What the two norms may write their output quantized as (quant/base.py's
        ``input_quant``): the qkv projection's when the attention's ``attend``, ``partial``
        and ``forward`` are ``LlamaAttention``'s (the normalised rows feed that projection
        alone), the gate/up projection's when the MLP is ``LlamaMLP``; None elsewhere (16-bit
        and weight-only methods, MoE blocks)."""
        attn = mlp = None
        cls = type(self.self_attn)
        if all(getattr(cls, f) is getattr(LlamaAttention, f) for f in _ATTN_ENTRIES):
            attn = input_quant(self.self_attn.qkv_proj.quant_method, self.self_attn.qkv_proj)
        if type(self.mlp) is LlamaMLP:
            mlp = input_quant(self.mlp.gate_up_proj.quant_method, self.mlp.gate_up_proj)
        return attn, mlp


class LlamaModel(nn.Module):
    is_neox_style = True  # RoPE on rotated halves; False: GPT-J style (interleaved pairs)

    def __init__(
        self,
        config: Any,
        quant_method: QuantMethod | None,
        attention_cls: type[LlamaAttention] = LlamaAttention,
        layer_cls: type[nn.Module] = LlamaDecoderLayer,
    ):
        super().__init__()
        self.embed_tokens = stage_embedding(config)
        rotary_emb = build_rope(config, self.is_neox_style)
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers,
            lambda i: layer_cls(config, i, rotary_emb, quant_method, attention_cls),
        )
        self.norm = on_stage(is_last_stage(), lambda: self.make_norm(config))

    def make_norm(self, config: Any) -> nn.Module:
        """The final norm (families with another norm override this)."""
        return RMSNorm(config.hidden_size, config.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,  # the previous stage's
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # [T, H]; ([T, H], [T, H]) mid-pipe
        if intermediate is None:
            hidden, residual = self.embed(input_ids), None
        else:  # a later pipeline stage: (hidden, residual) as the previous stage's last layer
            hidden, residual = intermediate  # left them (hidden possibly a partial sum)
        for layer in self.layers[self.start_layer : self.end_layer]:
            hidden, residual = layer(positions, hidden, residual)
        if not is_last_stage():
            return hidden, residual
        partial = getattr(self.layers[self.start_layer], "partial_output", False)
        return pre_norm(self.norm, hidden, residual, partial)[0]


class LlamaForCausalLM(nn.Module):
    packed_modules_mapping = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }

    def __init__(self, hf_config: Any, quant_method: QuantMethod | None = None):
        super().__init__()
        self.config = hf_config
        self.model = self.build_model(hf_config, quant_method)
        self.lm_head = on_stage(
            is_last_stage(), lambda: ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size)
        )
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        if self.tie_word_embeddings and is_last_stage():
            self.lm_head.tie_weights(self.model.embed_tokens)

    def build_model(self, hf_config: Any, quant_method: QuantMethod | None) -> nn.Module:
        return LlamaModel(hf_config, quant_method)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,  # a later stage's input
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # [T, H], or a stage's activations
        return self.model(input_ids, positions, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, V] fp32
        return self.lm_head.compute_logits(hidden).float()

    @property
    def sharded_greedy(self) -> bool:
        """Whether ``greedy_tokens`` applies: not for families that transform their logits
        (their own ``compute_logits``, or an LM head's)."""
        return (
            type(self).compute_logits is LlamaForCausalLM.compute_logits
            and type(self.lm_head).compute_logits is ParallelLMHead.compute_logits
        )

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N] int64
        """``compute_logits(hidden).argmax(-1)`` without gathering the vocab-sharded logits
        (``ParallelLMHead.greedy_tokens``); only where ``sharded_greedy``."""
        return self.lm_head.greedy_tokens(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors; returns the names of the parameters fully loaded."""

        def skip(name: str) -> bool:
            if "rotary_emb.inv_freq" in name or "rotary_emb.cos_cached" in name:
                return True
            return self.tie_word_embeddings and name.startswith("lm_head.")

        return load_packed_weights(self, weights, self.packed_modules_mapping, skip)
