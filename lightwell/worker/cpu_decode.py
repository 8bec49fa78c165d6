"""Decode steps of a Llama-shaped GGUF model on the CPU as one C call (``--fused-cpu-decode``).

``CpuDecode.build`` takes a model whose every layer is the plain Llama block (``LlamaAttention``
without sliding window, output or MLP biases; or Qwen2's, with its q/k/v bias, or Qwen3's, with
its per-head q/k RMSNorms; ``LlamaMLP``; RMSNorms) with all four linears on
GGUF blocks the CPU kernels read (``quant/gguf_cpu.py``'s segments: a fused linear whose parts
have different types, as q, k and v often do in a K-quant file, is up to ``MAX_SEGMENTS`` runs
of rows), neox RoPE over the whole head, a float32
KV cache, one rank; anything else keeps the layer-by-layer forward (``build`` returns None).
A step of 1..``MAX_ROWS`` requests that each bring one token then runs through
``kernels/cpu/llama_decode``: the token embeddings, then every layer and the final norm in one
call, and in the same call the LM head with each row's argmax where the model's LM head is a
block table of a type the kernels read whose logits the model does not transform (the runner then
samples from those logits, or takes the argmax where every row is plain greedy).
"""

from __future__ import annotations

import torch
from torch import nn

from lightwell.attention.metadata import AttentionMetadata
from lightwell.distributed.parallel_state import get_tp_size
from lightwell.kernels.cpu import gguf_cpu
from lightwell.kernels.cpu.llama_decode import (
    MAX_GROUP,
    MAX_ROWS,
    MAX_SEGMENTS,
    LayerWeights,
    LlamaDecoder,
    Segments,
    Shape,
)
from lightwell.layers.norm import RMSNorm
from lightwell.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
)
from lightwell.models.qwen2 import Qwen2Attention
from lightwell.models.qwen3 import Qwen3Attention
from lightwell.quant.gguf_cpu import GGUFLMHead

ATTENTIONS = (LlamaAttention, Qwen2Attention, Qwen3Attention)  # the attention blocks it runs


class CpuDecode:
    def __init__(self, inner: LlamaModel, decoder: LlamaDecoder):
        self.inner = inner  # the model's LlamaModel (its embedding)
        self.decoder = decoder

    @classmethod
    def build(cls, model: nn.Module, dtype: torch.dtype) -> CpuDecode | None:
        """The fused decode for ``model`` (activations in ``dtype``, its KV caches bound), or
        None where it does not apply."""
        inner = getattr(model, "model", None)
        if type(inner) is not LlamaModel or get_tp_size() != 1 or dtype != torch.float32:
            return None
        if not gguf_cpu.available():
            return None
        layers = list(inner.layers)
        if not layers or not all(_plain(layer) for layer in layers):
            return None
        if type(inner.norm) is not RMSNorm or not _f32(inner.norm.weight):
            return None
        attn = layers[0].self_attn
        rotary = attn.rotary_emb
        if not rotary.is_neox_style or rotary.rotary_dim != attn.head_dim:
            return None
        if not all(layer.self_attn.rotary_emb is rotary for layer in layers):
            return None
        inner_attn, mlp = attn.attn, layers[0].mlp
        shape = Shape(
            hidden=layers[0].input_layernorm.hidden_size,
            heads=inner_attn.num_heads,
            kv_heads=inner_attn.num_kv_heads,
            head_dim=attn.head_dim,
            inter=mlp.gate_up_proj.gguf_out // 2,
            eps=layers[0].input_layernorm.eps,
            scale=inner_attn.scale,
            qk_eps=_qk_eps(attn),
        )
        if any(_shape_of(layer) != shape for layer in layers) or inner.norm.eps != shape.eps:
            return None
        if shape.heads % shape.kv_heads or shape.heads // shape.kv_heads > MAX_GROUP:
            return None
        cos_sin = rotary.cos_sin_cache.float().contiguous()
        weights = [_weights(layer) for layer in layers]
        int8 = layers[0].self_attn.qkv_proj.quant_method.int8_act  # --cpu-int8-activations
        if int8 and shape.head_dim % 32:
            return None
        head = _lm_head(model)
        decoder = LlamaDecoder(weights, inner.norm.weight, cos_sin, shape, int8, head)
        return cls(inner, decoder)

    @staticmethod
    def applies(meta: AttentionMetadata) -> bool:
        """A step of 1..MAX_ROWS requests, one token each."""
        one_each = meta.max_query_len == 1 and meta.num_tokens == meta.num_reqs
        return one_each and 1 <= meta.num_tokens <= MAX_ROWS and meta.cp_slot_mapping is None

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The final norm's output [T, H] float32; with the LM head fused, the logits [T, V]
        float32 and their argmax [T] int64 (else None, None)."""
        x = self.inner.embed(input_ids).float().contiguous()  # [T, H]
        return self.decoder(x, positions, meta.slot_mapping, meta.block_table, meta.seq_lens)


def _f32(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.device.type == "cpu"


def _lm_head(model: nn.Module) -> Segments | None:
    """[(ggml type, blocks [V, bytes])] of an LM head the fused call runs: a block table of a
    type it reads, on a model that takes its logits as the head gives them."""
    head = getattr(model, "lm_head", None)
    if type(head) is not GGUFLMHead or not isinstance(model, LlamaForCausalLM):
        return None
    if type(model).compute_logits is not LlamaForCausalLM.compute_logits:
        return None
    qtype, blocks = head.weight.gguf_type, head.weight.data
    ok = qtype in gguf_cpu.SUPPORTED and blocks.is_contiguous()
    return [(qtype, blocks)] if ok and blocks.shape[0] == head.org_vocab_size else None


def _qk_eps(attn: nn.Module) -> float:
    """The eps of the layer's q / k head norms (Qwen3's), else Shape's default."""
    return attn.q_norm.eps if isinstance(attn, Qwen3Attention) else Shape.qk_eps


def _segments(linear: nn.Module, bias: bool = False) -> Segments | None:
    """[(ggml type, blocks)] of a linear held as GGUF blocks of types the fused kernel reads,
    its output rows in order, in at most MAX_SEGMENTS runs; without a bias, or (``bias``) with
    a float32 one."""
    parts = getattr(linear, "gguf_cpu", None)
    b = getattr(linear, "bias", None)
    if not parts or len(parts) > MAX_SEGMENTS or (b is not None and not (bias and _f32(b))):
        return None
    if not all(qtype in gguf_cpu.SUPPORTED for qtype, _, _ in parts):
        return None
    return [(qtype, blocks) for qtype, blocks, _ in sorted(parts, key=lambda p: p[2])]


def _plain(layer: nn.Module) -> bool:
    """The plain Llama block, on GGUF blocks, with a float32 cache."""
    if type(layer) is not LlamaDecoderLayer:
        return False
    attn, mlp = layer.self_attn, layer.mlp
    if type(attn) not in ATTENTIONS or type(mlp) is not LlamaMLP:
        return False
    if attn.attn.sliding_window is not None:
        return False
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if not all(type(n) is RMSNorm and _f32(n.weight) and n.eps == norms[0].eps for n in norms):
        return False
    if isinstance(attn, Qwen3Attention):  # per-head norms over the whole head
        qk = (attn.q_norm, attn.k_norm)
        if not all(type(n) is RMSNorm and _f32(n.weight) and n.eps == qk[0].eps for n in qk):
            return False
    linears = (attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    if _segments(attn.qkv_proj, bias=True) is None:
        return False
    cache = attn.attn.kv_cache
    return all(_segments(x) is not None for x in linears) and cache is not None and _f32(cache)


def _shape_of(layer: LlamaDecoderLayer) -> Shape:
    attn = layer.self_attn
    return Shape(
        hidden=layer.input_layernorm.hidden_size,
        heads=attn.attn.num_heads,
        kv_heads=attn.attn.num_kv_heads,
        head_dim=attn.head_dim,
        inter=layer.mlp.gate_up_proj.gguf_out // 2,
        eps=layer.input_layernorm.eps,
        scale=attn.attn.scale,
        qk_eps=_qk_eps(attn),
    )


def _weights(layer: LlamaDecoderLayer) -> LayerWeights:
    attn, mlp = layer.self_attn, layer.mlp
    return LayerWeights(
        in_norm=layer.input_layernorm.weight.data,
        post_norm=layer.post_attention_layernorm.weight.data,
        qkv=_segments(attn.qkv_proj, bias=True),
        o=_segments(attn.o_proj),
        gate_up=_segments(mlp.gate_up_proj),
        down=_segments(mlp.down_proj),
        kv_cache=attn.attn.kv_cache,
        qkv_bias=None if attn.qkv_proj.bias is None else attn.qkv_proj.bias.data,
        q_norm=attn.q_norm.weight.data if isinstance(attn, Qwen3Attention) else None,
        k_norm=attn.k_norm.weight.data if isinstance(attn, Qwen3Attention) else None,
    )
