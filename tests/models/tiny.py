"""Tiny random Llama checkpoints for model tests (HF transformers as the reference)."""

from __future__ import annotations

import os

import torch

from lightwell.model_files import resolve_model
from lightwell.models.hf_config import load_hf_config
from lightwell.models.loader import load_model

BASE = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=100,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    architectures=["LlamaForCausalLM"],
)
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
VARIANTS = {
    "base": {},
    "llama3": {"num_hidden_layers": 3, "rope_scaling": LLAMA3_SCALING},
    # tied LM head, q/k/v/o and MLP biases, head_dim not hidden / heads
    "tied_bias": {
        "tie_word_embeddings": True,
        "attention_bias": True,
        "mlp_bias": True,
        "head_dim": 24,
    },
}


def tiny_config(variant: str = "base", **extra):
    from transformers import LlamaConfig

    return LlamaConfig(**{**BASE, **VARIANTS[variant], **extra})


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int = 0, std: float = 0.1) -> None:
    """Weights with real signal: matrices and biases N(0, std), norm weights 1 + N(0, 0.2)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        if "norm" in name:
            p.copy_(1.0 + 0.2 * noise)
        else:
            p.copy_(std * noise)


def hf_tiny_model(config, seed: int = 0):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    randomize(model, seed)
    return model


def save_hf(model, folder: str, max_shard_size: str | None = None) -> str:
    kw = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(folder, **kw)
    return folder


def load_ours(
    path: str,
    dtype: torch.dtype = torch.float32,
    overrides=None,
    load_format="auto",
    quantization="auto",
    cpu_int8_activations=False,
):
    files = resolve_model(path)
    config = load_hf_config(files, overrides)
    cpu = torch.device("cpu")
    return load_model(
        files, config, dtype, cpu, load_format=load_format, quantization=quantization,
        cpu_int8_activations=cpu_int8_activations,
    )  # fmt: skip


@torch.no_grad()
def hf_logits(model, token_ids: list[int]) -> torch.Tensor:  # [L, V]
    return model(torch.tensor([token_ids])).logits[0].float()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def has_files(folder: str, suffix: str) -> int:
    return sum(f.endswith(suffix) for f in os.listdir(folder))
