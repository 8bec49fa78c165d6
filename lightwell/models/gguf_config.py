"""A transformers config built from a GGUF file's metadata (no config.json needed).

To support another llama.cpp architecture: add a row to ``GGUF_ARCHS`` (its transformers
config class, HF architecture name, whether llama.cpp permuted its q/k rows) and, if its
hyper-parameter keys differ, to ``_HPARAMS``. Qwen2/Qwen3 use the same keys as llama and no
q/k permutation (they are NeoX-style RoPE in llama.cpp too). MoE: qwen2moe / qwen3moe, and
Mixtral, which llama.cpp writes as "llama" with ``expert_count`` set; the expert keys
(``expert_count``, ``expert_used_count``, ``expert_feed_forward_length`` ...) map to the HF
fields.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GGUFArch:
    config_class: str  # transformers config class name
    architecture: str  # HF architecture (the model registry key)
    permute_qk: bool  # llama.cpp's converter permuted q/k rows for interleaved RoPE
    optional_biases: bool = False  # set attention_bias / mlp_bias from the tensors present
    experts_field: str = "num_experts"  # the config field that takes {arch}.expert_count
    fixed: dict[str, Any] = dataclasses.field(default_factory=dict)  # fields llama.cpp implies


GGUF_ARCHS: dict[str, GGUFArch] = {
    "llama": GGUFArch("LlamaConfig", "LlamaForCausalLM", permute_qk=True, optional_biases=True),
    # q/k/v biases are implied by the Qwen2 architecture; Qwen3's q/k norms map in gguf_loader.
    "qwen2": GGUFArch("Qwen2Config", "Qwen2ForCausalLM", permute_qk=False),
    "qwen3": GGUFArch("Qwen3Config", "Qwen3ForCausalLM", permute_qk=False),
    # llama.cpp renormalises the top-k weights of qwen3moe, not of qwen2moe
    "qwen2moe": GGUFArch(
        "Qwen2MoeConfig", "Qwen2MoeForCausalLM", False, fixed={"norm_topk_prob": False}
    ),
    "qwen3moe": GGUFArch(
        "Qwen3MoeConfig", "Qwen3MoeForCausalLM", False, fixed={"norm_topk_prob": True}
    ),
}
# llama.cpp writes Mixtral as "llama" with {arch}.expert_count set
MIXTRAL = GGUFArch("MixtralConfig", "MixtralForCausalLM", True, experts_field="num_local_experts")

# "{arch}.<key>" -> HF config field
_HPARAMS: dict[str, str] = {
    "block_count": "num_hidden_layers",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.key_length": "head_dim",
    "context_length": "max_position_embeddings",
    "vocab_size": "vocab_size",
    "rope.freq_base": "rope_theta",
    "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
    "expert_weights_norm": "norm_topk_prob",  # when the file says (else the arch's default)
}

_TOKEN_IDS = {
    "tokenizer.ggml.bos_token_id": "bos_token_id",
    "tokenizer.ggml.eos_token_id": "eos_token_id",
    "tokenizer.ggml.padding_token_id": "pad_token_id",
}

ROPE_FREQS_TENSOR = "rope_freqs.weight"

# A llama file's config is a PretrainedConfig of model_type "llama" (saved, it reads back as a
# LlamaConfig) with LlamaConfig's defaults for the fields the file may leave out: importing
# transformers' LlamaConfig imports much of transformers (and sympy, through torch's
# distributed tensors), about 60 MB of resident memory a CPU process serving a small GGUF
# model does not otherwise need.
_LLAMA_DEFAULTS: dict[str, Any] = {
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "mlp_bias": False,
}


def open_gguf(path: str) -> Any:
    """A ``GGUFFile`` (``lightwell.models.gguf_file``) for ``path``, shared between config and
    weight loading."""
    st = os.stat(path)
    return _open_gguf(os.path.abspath(path), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=2)
def _open_gguf(path: str, mtime_ns: int, size: int) -> Any:
    from lightwell.models.gguf_file import GGUFFile

    return GGUFFile(path)


def field_value(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_arch(reader: Any, path: str) -> tuple[str, GGUFArch]:
    arch = field_value(reader, "general.architecture")
    if arch not in GGUF_ARCHS:
        raise ValueError(
            f"{path}: GGUF architecture {arch!r} is not supported (supported: "
            f"{', '.join(sorted(GGUF_ARCHS))})"
        )
    return arch, GGUF_ARCHS[arch]


def gguf_hf_config(path: str) -> Any:
    """Read ``path``'s metadata into a transformers config of the matching class."""
    import transformers

    reader = open_gguf(path)
    arch, spec = gguf_arch(reader, path)
    experts = field_value(reader, f"{arch}.expert_count")
    if arch == "llama" and experts:
        spec = MIXTRAL
    kw: dict[str, Any] = {"architectures": [spec.architecture], **spec.fixed}
    if experts:
        kw[spec.experts_field] = int(experts)
    for key, field in _HPARAMS.items():
        value = field_value(reader, f"{arch}.{key}")
        if isinstance(value, list):
            if len(set(value)) != 1:
                raise ValueError(f"{path}: per-layer {arch}.{key} values are not supported")
            value = value[0]
        if value is not None:
            kw[field] = value
    kw.update(_vocab_and_tokens(reader))
    kw.update(_rope_settings(reader, arch, kw))
    names = {t.name for t in reader.tensors}
    kw["tie_word_embeddings"] = "output.weight" not in names
    if experts and not any(n.endswith(".ffn_gate_shexp.weight") for n in names):
        kw["shared_expert_intermediate_size"] = 0
    if spec.optional_biases:
        kw["attention_bias"] = any(n.endswith(".attn_q.bias") for n in names)
        kw["mlp_bias"] = any(n.endswith(".ffn_up.bias") for n in names)
    if spec is GGUF_ARCHS["llama"]:
        config = _llama_config_class()(**{**_LLAMA_DEFAULTS, **kw})
    else:
        config = getattr(transformers, spec.config_class)(**kw)
    if ROPE_FREQS_TENSOR in names:
        config.rope_freq_factors = _rope_freq_factors(reader)
    return config


@functools.cache
def _llama_config_class() -> type:
    import transformers

    class GGUFLlamaConfig(transformers.PretrainedConfig):
        model_type = "llama"

    return GGUFLlamaConfig


def _vocab_and_tokens(reader: Any) -> dict[str, Any]:
    kw = {name: field_value(reader, key) for key, name in _TOKEN_IDS.items()}
    kw = {k: int(v) for k, v in kw.items() if v is not None}
    arch = field_value(reader, "general.architecture")
    if field_value(reader, f"{arch}.vocab_size") is None:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        if tokens is not None:
            kw["vocab_size"] = len(tokens)
        else:
            embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
            kw["vocab_size"] = int(embd.shape[-1])
    return kw


def _rope_settings(reader: Any, arch: str, kw: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    head_dim = kw.get("head_dim") or kw["hidden_size"] // kw["num_attention_heads"]
    rotary_dim = field_value(reader, f"{arch}.rope.dimension_count")
    if rotary_dim is not None and rotary_dim != head_dim:
        out["partial_rotary_factor"] = rotary_dim / head_dim
    kind = field_value(reader, f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return out
    scaling: dict[str, Any] = {"rope_type": kind}
    factor = field_value(reader, f"{arch}.rope.scaling.factor")
    if factor is not None:
        scaling["factor"] = float(factor)
    orig = field_value(reader, f"{arch}.rope.scaling.original_context_length")
    if orig is not None:
        scaling["original_max_position_embeddings"] = int(orig)
    out["rope_scaling"] = scaling
    return out


def _rope_freq_factors(reader: Any) -> list[float]:
    import numpy as np

    tensor = next(t for t in reader.tensors if t.name == ROPE_FREQS_TENSOR)
    return [float(x) for x in np.asarray(tensor.data, dtype=np.float32).reshape(-1)]
