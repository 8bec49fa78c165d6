"""Tensors of a GGUF file, renamed to HF names: dequantized to torch, or (``keep_quantized``)
the linear layers' weights as the file's quantized blocks.

Quantized tensors are dequantized with the ``gguf`` package (F32/F16/BF16/Q8_0/Q4_0/Q4_1/
K-quants ... whatever it implements). llama.cpp's converter permutes the rows of llama q/k
weights from HF's half-split RoPE layout into its interleaved layout; ``unpermute_qk`` undoes it.
MoE experts stored stacked (``blk.N.ffn_{gate,up,down}_exps`` [E, ...]) are yielded one expert at
a time under HF's per-expert names.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from lightwell.models.gguf_config import ROPE_FREQS_TENSOR, gguf_arch, open_gguf

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",  # qwen3
    "attn_k_norm": "self_attn.k_norm",  # qwen3
    "ffn_gate_inp": "mlp.gate",  # MoE router
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",  # qwen2moe
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# Experts stacked in one tensor [E, ...]: yielded one expert at a time under HF's names.
_EXPERT_NAMES = {
    "ffn_gate_exps": "gate_proj",
    "ffn_up_exps": "up_proj",
    "ffn_down_exps": "down_proj",
}
# Read into the config instead (see gguf_config), never loaded as weights.
_SKIP = {ROPE_FREQS_TENSOR}


def gguf_to_hf_name(name: str, path: str = "") -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``."""
    base, _, suffix = name.rpartition(".")
    hf_base = None
    if base.startswith("blk."):
        parts = base.split(".", 2)
        if len(parts) == 3 and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
            hf_base = f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    else:
        hf_base = _GLOBAL_NAMES.get(base)
    if hf_base is None or suffix not in ("weight", "bias"):
        raise ValueError(f"{path}: unknown GGUF tensor {name!r}")
    return f"{hf_base}.{suffix}"


def unpermute_qk(w: torch.Tensor, num_heads: int) -> torch.Tensor:  # [H*D, ...] -> same
    """Inverse of llama.cpp's q/k row permutation: per head, rows (d/2, 2) -> (2, d/2)."""
    rows = w.shape[0]
    if rows % (2 * num_heads):
        raise ValueError(f"{rows} rows cannot hold {num_heads} heads of even size")
    head = w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])
    return head.transpose(1, 2).reshape(w.shape)


def gguf_tensor_to_torch(tensor: Any, path: str = "") -> torch.Tensor:
    """One GGUF tensor as a CPU torch tensor in [rows, cols] (HF) order: float16 for F16,
    float32 otherwise."""
    from gguf import GGMLQuantizationType, dequantize

    qtype = tensor.tensor_type
    if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        return torch.from_numpy(np.array(tensor.data))
    try:
        return torch.from_numpy(np.ascontiguousarray(dequantize(tensor.data, qtype)))
    except NotImplementedError as e:
        raise ValueError(
            f"{path}: tensor {tensor.name!r} has type {qtype.name}, which the installed gguf "
            f"package cannot dequantize ({e})"
        ) from e


# the linear layers' weights, which ``keep_quantized`` hands over as the file's blocks
_LINEARS = {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"}


def _read(tensor: Any) -> np.ndarray:
    """A tensor's data in memory of its own (read, not mapped: no file pages stay resident)."""
    return tensor.read() if hasattr(tensor, "read") else np.array(tensor.data)


_EMBEDDINGS = ("token_embd.weight", "output.weight")


def _is_quantized_linear(tensor: Any) -> bool:
    from gguf import GGMLQuantizationType as Q

    if tensor.tensor_type in (Q.F32, Q.F16, Q.BF16) or not tensor.name.endswith(".weight"):
        return False
    parts = tensor.name.split(".")
    return len(parts) == 4 and parts[0] == "blk" and parts[2] in _LINEARS


class GGUFCheckpoint:
    """Iterate ``(source, hf_name, tensor)`` over a GGUF file's weights. With
    ``keep_quantized`` the linear layers' quantized weights come as their stored blocks
    (``lightwell.quant.gguf.raw_tensor``), everything else dequantized."""

    def __init__(
        self,
        path: str,
        hf_config: Any,
        keep_quantized: bool = False,
        raw_embeddings: bool = False,
    ):
        self.path, self.keep_quantized = path, keep_quantized
        self.raw_embeddings = raw_embeddings
        self.reader = open_gguf(path)
        _, self.arch = gguf_arch(self.reader, path)
        self.num_heads = hf_config.num_attention_heads
        self.num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or self.num_heads
        self.tensors = [t for t in self.reader.tensors if t.name not in _SKIP]

    def _raw_embedding(self, tensor: Any) -> bool:
        """The token table or LM head as its blocks, for ``quant.gguf_cpu``'s modules."""
        from lightwell.quant.gguf_cpu import supported

        name = tensor.name
        return self.raw_embeddings and name in _EMBEDDINGS and supported(tensor.tensor_type)

    def __len__(self) -> int:
        return len(self.tensors)

    def __iter__(self) -> Iterator[tuple[str, str, torch.Tensor]]:
        for t in self.tensors:
            source = f"{self.path} (GGUF tensor {t.name!r})"
            parts = t.name.split(".")
            if len(parts) == 4 and parts[0] == "blk" and parts[2] in _EXPERT_NAMES:
                stacked = gguf_tensor_to_torch(t, self.path)  # [E, rows, cols]
                proj = _EXPERT_NAMES[parts[2]]
                for e, w in enumerate(stacked):
                    yield source, f"model.layers.{parts[1]}.mlp.experts.{e}.{proj}.weight", w
                continue
            name = gguf_to_hf_name(t.name, self.path)
            if self.keep_quantized and _is_quantized_linear(t) or self._raw_embedding(t):
                from lightwell.quant.gguf import raw_tensor

                w = raw_tensor(_read(t), t.tensor_type)  # [rows, bytes per row]
            else:
                w = gguf_tensor_to_torch(t, self.path)
            qtype = getattr(w, "gguf_type", None)
            if name.endswith("shared_expert_gate.weight") and w.ndim == 1:
                w = w[None, :]  # llama.cpp stores the [1, H] gate as [H]
            if self.arch.permute_qk and ".attn_q." in t.name:
                w = unpermute_qk(w, self.num_heads)
            elif self.arch.permute_qk and ".attn_k." in t.name:
                w = unpermute_qk(w, self.num_kv_heads)
            if qtype is not None:  # rows moved whole: still the file's blocks
                w.gguf_type = qtype
            yield source, name, w
