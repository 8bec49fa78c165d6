"""Tiny random checkpoints of the dense families beyond Llama, with HF transformers' model as the
reference, and a word-level tokenizer saved alongside so ``LLM(model=folder)`` loads them.

Each ``Family`` builds (reference model, HF folder). Sizes are odd on purpose (vocab 300 is no
multiple of the 64-row padding, intermediate 100, head_dim 24 where the config allows one), and
every family turns on its features: sliding windows shorter than the prompts, rope scalings whose
original length the contexts pass, biases, q/k norms, tied embeddings, logit scales.

MiniCPM 1/2 is not in transformers (it shipped as remote code), so its reference is HF's
``LlamaForCausalLM`` with MiniCPM's scalings folded into the weights: embeddings times
``scale_emb``, o_proj and down_proj times ``scale_depth / sqrt(num_layers)``, and an untied LM
head equal to the embeddings divided by ``hidden_size / dim_model_base``. The folder we load
holds the unfolded weights under a MiniCPM config.json (model_type "minicpm", remote-code auto_map).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from tests.models.tiny import randomize

COMMON = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=100,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    bos_token_id=1,
    eos_token_id=2,
)
WINDOW = 8  # sliding window of the Mistral and Qwen2 variants
ORIGINAL_MAX = 32  # yarn's original_max_position_embeddings; dynamic NTK's max_position
MINICPM = dict(scale_emb=12.0, scale_depth=1.4, dim_model_base=16)


@dataclass(frozen=True)
class Family:
    cls_name: str  # our model class
    build: Callable[[str, int], Any]  # (folder, seed) -> HF reference model; writes the folder
    prefill_lens: list[int] = field(default_factory=lambda: [7, 45, 4])
    llm_options: dict[str, Any] = field(default_factory=dict)


def _hf_model(config, seed: int):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    randomize(model, seed)
    return model


def _saved(config, folder: str, seed: int):
    model = _hf_model(config, seed)
    model.save_pretrained(folder)
    save_tokenizer(folder)
    return model


def mistral(folder: str, seed: int):
    from transformers import MistralConfig

    cfg = MistralConfig(**COMMON, head_dim=24, sliding_window=WINDOW)
    return _saved(cfg, folder, seed)


def qwen2(folder: str, seed: int):
    """Tied, q/k/v biases, YaRN x4 over 32 positions, sliding window on layers 1 and 2."""
    from transformers import Qwen2Config

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL_MAX}
    cfg = Qwen2Config(
        **{**COMMON, "num_hidden_layers": 3},
        tie_word_embeddings=True,
        use_sliding_window=True,
        sliding_window=WINDOW,
        max_window_layers=1,
        rope_scaling=yarn,
    )
    return _saved(cfg, folder, seed)


def qwen3(folder: str, seed: int):
    """q/k norms, head_dim 24 != 64 / 4, GQA 4:1, dynamic NTK x2 over 32 positions."""
    from transformers import Qwen3Config

    cfg = Qwen3Config(
        **{**COMMON, "num_key_value_heads": 1, "max_position_embeddings": ORIGINAL_MAX},
        head_dim=24,
        rope_scaling={"rope_type": "dynamic", "factor": 2.0},
    )
    return _saved(cfg, folder, seed)


def cohere(folder: str, seed: int, **overrides):
    """Command R+ shape: per-head q/k LayerNorm, biases, tied, logit_scale."""
    from transformers import CohereConfig

    kw = {k: v for k, v in COMMON.items() if k != "rms_norm_eps"}
    kw.update(overrides)
    cfg = CohereConfig(**kw, layer_norm_eps=1e-5, logit_scale=0.25, use_qk_norm=True)
    cfg.attention_bias = True
    return _saved(cfg, folder, seed)


def minicpm(folder: str, seed: int):
    """Our folder: MiniCPM config + its weights; returned: the folded HF Llama reference."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    rope = {"type": "linear", "factor": 2.0}  # the old key, as MiniCPM's configs spell it
    base = {**COMMON, "num_hidden_layers": 3, "rope_scaling": rope}
    weights = dict(_hf_model(LlamaConfig(**base, tie_word_embeddings=True), seed).state_dict())
    del weights["lm_head.weight"]  # tied
    # muP-style small embeddings (else embedding * scale_emb drowns the layers out and greedy
    # decoding repeats the last token)
    weights["model.embed_tokens.weight"] = (
        weights["model.embed_tokens.weight"] / MINICPM["scale_emb"]
    )
    save_file(weights, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    config = {
        **base,
        **MINICPM,
        "architectures": ["MiniCPMForCausalLM"],
        "model_type": "minicpm",
        "auto_map": {"AutoConfig": "configuration_minicpm.MiniCPMConfig"},
        "torch_dtype": "float32",
    }  # tie_word_embeddings left out: MiniCPM's config class defaults it to True
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    save_tokenizer(folder)

    ref = LlamaForCausalLM(LlamaConfig(**base, tie_word_embeddings=False)).eval()
    depth = MINICPM["scale_depth"] / math.sqrt(base["num_hidden_layers"])
    width = COMMON["hidden_size"] / MINICPM["dim_model_base"]
    folded = {
        k: v * depth if ("o_proj" in k or "down_proj" in k) else v for k, v in weights.items()
    }
    folded["model.embed_tokens.weight"] = (
        weights["model.embed_tokens.weight"] * MINICPM["scale_emb"]
    )
    folded["lm_head.weight"] = weights["model.embed_tokens.weight"] / width
    ref.load_state_dict(folded)
    return ref


MOE = dict(intermediate_size=48, num_experts_per_tok=2)


def mixtral(folder: str, seed: int, **overrides):
    """4 experts, top-2 renormalised, a sliding window shorter than the prompts."""
    from transformers import MixtralConfig

    cfg = MixtralConfig(
        **{**COMMON, **MOE, **overrides}, num_local_experts=4, sliding_window=WINDOW
    )
    return _saved(cfg, folder, seed)


def qwen2_moe(folder: str, seed: int, **overrides):
    """4 experts top-2 (not renormalised), a sigmoid-gated shared expert, layer 1 of 3 dense
    (``mlp_only_layers``), q/k/v biases."""
    from transformers import Qwen2MoeConfig

    own = dict(num_experts=4, moe_intermediate_size=40, shared_expert_intermediate_size=56,
               mlp_only_layers=[1], norm_topk_prob=False)  # fmt: skip
    cfg = Qwen2MoeConfig(**{**COMMON, **MOE, "num_hidden_layers": 3, **own, **overrides})
    return _saved(cfg, folder, seed)


def qwen3_moe(folder: str, seed: int, **overrides):
    """q/k norms, head_dim 24, 4 experts top-2 renormalised, every second layer sparse."""
    from transformers import Qwen3MoeConfig

    own = dict(head_dim=24, num_experts=4, moe_intermediate_size=40, decoder_sparse_step=2,
               norm_topk_prob=True)  # fmt: skip
    cfg = Qwen3MoeConfig(**{**COMMON, **MOE, "num_hidden_layers": 3, **own, **overrides})
    return _saved(cfg, folder, seed)


MLA = dict(
    kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=20,
    moe_intermediate_size=40, first_k_dense_replace=1, num_key_value_heads=4,
)  # fmt: skip


def deepseek_v2(folder: str, seed: int, **overrides):
    """Plain q, group-limited greedy routing (2 of 4 groups of 2 experts), 2 shared experts,
    YaRN x4 over 32 positions, layer 0 dense. ``mscale`` and ``mscale_all_dim`` differ (the
    published configs give both 0.707) so that each reaches the logits: their ratio scales
    RoPE's cos/sin, ``mscale_all_dim``'s factor squared the softmax scale."""
    from transformers import DeepseekV2Config

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL_MAX,
            "mscale": 1.0, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}  # fmt: skip
    kw = {**COMMON, **MOE, **MLA, "num_hidden_layers": 3, **overrides}
    cfg = DeepseekV2Config(
        **kw, q_lora_rank=None, n_routed_experts=8, n_shared_experts=2,
        topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=1.5,
        norm_topk_prob=False, rope_scaling=yarn,
    )  # fmt: skip
    return _saved(cfg, folder, seed)


def deepseek_v3(folder: str, seed: int, **overrides):
    """q LoRA, noaux_tc routing (sigmoid scores, a random correction bias, experts from the
    best of 2 groups), renormalised, scaled by 2.5, interleaved RoPE, layer 0 dense."""
    from transformers import DeepseekV3Config

    kw = {**COMMON, **MOE, **MLA, "num_hidden_layers": 3, **overrides}
    cfg = DeepseekV3Config(
        **kw, q_lora_rank=24, n_routed_experts=4, n_shared_experts=1, n_group=2, topk_group=1,
        routed_scaling_factor=2.5, norm_topk_prob=True,
    )  # fmt: skip
    model = _hf_model(cfg, seed)
    gen = torch.Generator().manual_seed(seed)
    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias"):  # a buffer: randomize() leaves it at 0
            buf.copy_(0.3 * torch.randn(buf.shape, generator=gen))
    model.save_pretrained(folder)
    save_tokenizer(folder)
    return model


FAMILIES: dict[str, Family] = {
    "mistral_window": Family("MistralForCausalLM", mistral),
    "qwen2_yarn_window": Family("Qwen2ForCausalLM", qwen2),
    # Dynamic NTK matches HF's decoding while the prompt fits in max_position (32), so prefill
    # prompts stay within it; decoding runs past it. The engine needs max_model_len past it too.
    "qwen3_dynamic": Family(
        "Qwen3ForCausalLM", qwen3, prefill_lens=[7, 31, 4], llm_options={"max_model_len": 64}
    ),
    "minicpm_linear": Family("MiniCPMForCausalLM", minicpm),
    "cohere_qk_norm": Family("CohereForCausalLM", cohere),
    "mixtral_window": Family("MixtralForCausalLM", mixtral),
    "qwen2_moe_shared": Family("Qwen2MoeForCausalLM", qwen2_moe),
    "qwen3_moe_step2": Family("Qwen3MoeForCausalLM", qwen3_moe),
    "deepseek_v2_yarn": Family("DeepseekV2ForCausalLM", deepseek_v2),
    "deepseek_v3_qlora": Family("DeepseekV3ForCausalLM", deepseek_v3),
}


def save_tokenizer(folder: str, vocab_size: int = COMMON["vocab_size"]) -> None:
    """A word-level tokenizer over ``w0 .. w{vocab_size - 1}`` (id i is "wi")."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="w0", bos_token="w1", eos_token="w2"
    )
    fast.save_pretrained(folder)


@torch.no_grad()
def hf_decode_logits(model, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """HF's logits the way ``generate`` computes them: the prompt in one forward, then one token
    at a time through its KV cache. [1 + len(continuation), V]: the prompt's last position,
    then each continuation token's."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    out = model(torch.tensor([prompt]), cache=cache, use_cache=True)
    rows = [out.logits[0, -1]]
    for token in continuation:
        out = model(torch.tensor([[token]]), cache=cache, use_cache=True)
        rows.append(out.logits[0, -1])
    return torch.stack(rows).float()


@torch.no_grad()
def hf_generate(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """HF ``generate``, greedy, one prompt at a time, never stopping early."""
    model.generation_config.eos_token_id = None
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()
