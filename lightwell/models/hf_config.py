"""The model's HF config: from config.json, from GGUF metadata, or from a shape preset.

``load_hf_config`` returns a ``transformers`` config object in every case, so model code reads
one vocabulary of fields (``hidden_size``, ``num_key_value_heads``, ``rope_parameters`` ...).
Overrides (``--hf-config-json``) are a dict, a JSON string, or a preset name; presets give the
shapes of models whose weights we do not have, for dummy-weight benchmarks.
"""

from __future__ import annotations

import json
import numbers
import os
from dataclasses import dataclass
from typing import Any

from lightwell.model_files import ModelFiles

_LLAMA3 = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "tie_word_embeddings": False,
}

_DEEPSEEK = {  # MLA shapes and YaRN of DeepSeek-V2-Lite and V3 alike
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
_DEEPSEEK_V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "vocab_size": 102400,
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "num_experts_per_tok": 6,
    "first_k_dense_replace": 1,
    "q_lora_rank": None,
    "topk_method": "greedy",
    "norm_topk_prob": False,
    "routed_scaling_factor": 1.0,
    "rope_theta": 10000.0,
    "rope_scaling": {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                     "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1},
    "bos_token_id": 100000,
    "eos_token_id": 100001,
}  # fmt: skip
_DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "n_group": 8,
    "topk_group": 4,
    "first_k_dense_replace": 3,
    "q_lora_rank": 1536,
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "rope_theta": 10000.0,
    "rope_scaling": {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                     "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1},
    "bos_token_id": 0,
    "eos_token_id": 1,
}  # fmt: skip

PRESETS: dict[str, dict[str, Any]] = {
    "llama-3-8b": {
        **_LLAMA3,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
    },
    "llama-3-70b": {
        **_LLAMA3,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
    },
    "mixtral-8x7b": {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-5,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
    },
    "deepseek-v2-lite": {**_DEEPSEEK, **_DEEPSEEK_V2_LITE},
    "deepseek-v3": {**_DEEPSEEK, **_DEEPSEEK_V3},
    # Qwen2 architecture (QKV bias is implied by the architecture).
    "qwen2.5-7b": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "tie_word_embeddings": False,
    },
}


def parse_overrides(overrides: dict[str, Any] | str | None) -> dict[str, Any]:
    """A dict, a JSON object string, or a preset name -> a dict (``{"preset": name}`` ...)."""
    if overrides is None:
        return {}
    if isinstance(overrides, str):
        if overrides in PRESETS:
            return {"preset": overrides}
        try:
            overrides = json.loads(overrides)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"HF config overrides must be a JSON object or a preset name "
                f"({', '.join(PRESETS)}), got {overrides!r}"
            ) from e
    if not isinstance(overrides, dict):
        raise ValueError(f"HF config overrides must be a JSON object, got {overrides!r}")
    return dict(overrides)


def load_hf_config(files: ModelFiles | None, overrides: dict[str, Any] | str | None = None) -> Any:
    """The model's ``transformers.PretrainedConfig``, with ``overrides`` applied."""
    from transformers import AutoConfig

    ov = parse_overrides(overrides)
    preset = ov.pop("preset", None)
    if preset is not None:
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; presets: {', '.join(PRESETS)}")
        spec = dict(PRESETS[preset])
        config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    elif files is None:
        raise ValueError("no model files and no preset: nothing to read a config from")
    elif files.kind == "hf":
        config = _folder_config(files.path)
    elif files.kind == "gguf":
        from lightwell.models.gguf_config import gguf_hf_config

        config = gguf_hf_config(files.path)
    else:
        raise ValueError(f"unknown model file kind {files.kind!r}")
    source = files.path if files is not None else f"preset {preset!r}"
    if ov:
        _check_size_values(ov, f"{source} with overrides")
        config = apply_overrides(config, ov)
    check_sizes(config, source)
    return config


# sizes a model cannot be built without (> 0), and sizes that may be 0 where a model has none
_POSITIVE_SIZES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
_SIZES = (
    "intermediate_size", "num_key_value_heads", "head_dim", "max_position_embeddings",
    "moe_intermediate_size", "shared_expert_intermediate_size", "num_experts",
    "num_local_experts", "n_routed_experts", "n_shared_experts", "num_experts_per_tok",
    "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
)  # fmt: skip


def check_sizes(config: Any, source: str) -> None:
    """One-line ValueError for a size a model cannot be built with (a negative or fractional
    dimension; outside latent attention, query heads not a multiple of the KV heads), before any
    tensor is made."""
    _check_size_values({n: getattr(config, n, None) for n in _POSITIVE_SIZES + _SIZES}, source)
    if getattr(config, "kv_lora_rank", None):
        return  # (latent attention: heads share one latent; no KV heads, no hidden / heads)
    heads, kv = config.num_attention_heads, getattr(config, "num_key_value_heads", None)
    if kv and heads % kv:
        raise ValueError(
            f"{source}: num_attention_heads ({heads}) is not a multiple of num_key_value_heads "
            f"({kv})"
        )
    if getattr(config, "head_dim", None) is None and config.hidden_size % heads:
        raise ValueError(
            f"{source}: hidden_size ({config.hidden_size}) is not a multiple of "
            f"num_attention_heads ({heads}) and the config gives no head_dim"
        )


def _check_size_values(values: dict[str, Any], source: str) -> None:
    """The sizes among ``values`` (a config's, or the overrides given): positive integers, or
    integers >= 0 (None: absent) for those a model may lack."""
    for name in _POSITIVE_SIZES + _SIZES:
        if name not in values or (values[name] is None and name not in _POSITIVE_SIZES):
            continue
        v, low = values[name], 1 if name in _POSITIVE_SIZES else 0
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < low:
            what = "a positive integer" if low else "an integer >= 0"
            raise ValueError(f"{source}: config field {name} must be {what} (got {v!r})")


# model_type -> (transformers config class with the same field names, defaults of the model's
# own config class): architectures that shipped as remote code transformers does not include.
# Their config.json is read into that class (extra fields such as MiniCPM's scale_emb stay as
# attributes); remote code is never run.
OWN_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "minicpm": (
        "LlamaConfig",
        {"tie_word_embeddings": True, "scale_emb": 1, "scale_depth": 1, "dim_model_base": 1},
    ),
}


def _folder_config(path: str) -> Any:
    """config.json of an HF folder as a transformers config (never running remote code)."""
    import transformers

    with open(os.path.join(path, "config.json")) as f:
        try:
            raw = json.load(f)
        except ValueError as e:
            raise ValueError(f"{path}/config.json is not valid JSON: {e}") from None
    own = OWN_CONFIGS.get(raw.get("model_type"))
    if own is not None:
        cls, defaults = own
        skip = {"model_type", "auto_map", "transformers_version"}
        return getattr(transformers, cls)(
            **{**defaults, **{k: v for k, v in raw.items() if k not in skip}}
        )
    try:
        return transformers.AutoConfig.from_pretrained(
            path, local_files_only=True, trust_remote_code=False
        )
    except Exception as e:  # noqa: BLE001 - transformers' own and its strict dataclasses' errors
        from lightwell.models.registry import supported_architectures

        supported = supported_architectures()
        listed = raw.get("architectures") or []
        archs = ", ".join(listed or [repr(raw.get("model_type"))])
        if not any(a in supported for a in listed):
            raise ValueError(
                f"{path}: architecture {archs} is not supported; Lightwell supports: "
                + ", ".join(supported)
            ) from None
        reason = " ".join(str(e).split()).split(". ")[0]  # transformers' first sentence
        raise ValueError(f"{path}: transformers cannot read this config ({archs}): {reason}") from e


def apply_overrides(config: Any, overrides: dict[str, Any]) -> Any:
    """A new config of the same class with ``overrides`` set (head_dim re-derived when the
    hidden size or head count changes and head_dim is not given)."""
    d = config.to_dict()
    ov = dict(overrides)
    if ({"hidden_size", "num_attention_heads"} & ov.keys()) and "head_dim" not in ov:
        d.pop("head_dim", None)
    if "num_hidden_layers" in ov and "layer_types" not in ov:  # one a layer: derived again
        d.pop("layer_types", None)
    if isinstance(d.get("rope_parameters"), dict):  # transformers 5 folds rope_* in here
        rope = dict(d["rope_parameters"])
        if "rope_scaling" in ov:
            rope = {"rope_theta": rope.get("rope_theta"), **(ov.pop("rope_scaling") or {})}
        if "rope_theta" in ov:
            rope["rope_theta"] = ov.pop("rope_theta")
        d["rope_parameters"] = rope
    d.update(ov)
    return type(config).from_dict(d)


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    scaling: dict[str, Any] | None  # None: plain RoPE; else has "rope_type"
    partial_rotary_factor: float = 1.0


def get_rope_config(config: Any) -> RopeConfig:
    """RoPE settings from either transformers 5 (``rope_parameters``) or 4.x (``rope_theta`` +
    ``rope_scaling``) configs; GGUF's per-frequency factors become rope_type "freq_factors"."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        params = dict(params)
        theta = float(params.pop("rope_theta", getattr(config, "rope_theta", 10000.0)))
    else:
        theta = float(getattr(config, "rope_theta", None) or 10000.0)
        params = dict(getattr(config, "rope_scaling", None) or {})
    partial = float(
        params.pop("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0) or 1.0)
    )
    rope_type = params.get("rope_type", params.get("type")) or "default"
    scaling = None if rope_type == "default" else params
    factors = getattr(config, "rope_freq_factors", None)
    if factors is not None:
        if scaling is not None:
            raise ValueError(f"rope frequency factors cannot combine with {rope_type!r} scaling")
        scaling = {"rope_type": "freq_factors", "factors": list(factors)}
    return RopeConfig(theta, scaling, partial)
