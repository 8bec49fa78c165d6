"""RoPE scaling tables vs HF transformers' own (``ROPE_INIT_FUNCTIONS``): YaRN's frequencies and
attention factor, and dynamic NTK's per-position base against HF's base for that length."""

from __future__ import annotations

import pytest
import torch

from lightwell.layers.rotary import get_rope
from lightwell.models.hf_config import get_rope_config

HEAD_DIM, MAX_POS = 32, 64


def _hf(rope_scaling: dict, seq_len: int | None = None, partial: float = 1.0):
    """(inv_freq [d/2], attention factor) from HF for a Llama config with ``rope_scaling``."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(
        hidden_size=4 * HEAD_DIM,
        num_attention_heads=4,
        max_position_embeddings=MAX_POS,
        rope_scaling=dict(rope_scaling),
        partial_rotary_factor=partial,
    )
    kw = {} if seq_len is None else {"seq_len": seq_len}
    return ROPE_INIT_FUNCTIONS[config.rope_parameters["rope_type"]](config, "cpu", **kw), config


def _ours(config):
    rope = get_rope_config(config)
    rot = int(HEAD_DIM * rope.partial_rotary_factor)
    return get_rope(HEAD_DIM, rot, MAX_POS, rope.theta, rope.scaling)


def _angles(freqs: torch.Tensor, positions: torch.Tensor, scale: float) -> torch.Tensor:
    f = positions[:, None].float() * freqs[None, :]
    return torch.cat((f.cos() * scale, f.sin() * scale), dim=-1)


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}


@pytest.mark.parametrize(
    "scaling, partial",
    [
        (YARN, 1.0),
        ({**YARN, "beta_fast": 16, "beta_slow": 2, "truncate": False}, 1.0),
        ({**YARN, "mscale": 0.707, "mscale_all_dim": 1.0}, 1.0),  # DeepSeek style
        ({**YARN, "attention_factor": 0.9}, 0.5),
    ],
)
def test_yarn_matches_hf(scaling, partial):
    (inv_freq, attention_factor), config = _hf(scaling, partial=partial)
    ours = _ours(config)
    assert ours.cos_sin_cache.shape == (MAX_POS, int(HEAD_DIM * partial))  # max(64, 16 * 4)
    positions = torch.arange(MAX_POS)
    want = _angles(inv_freq, positions, attention_factor)
    torch.testing.assert_close(ours.cos_sin_cache, want, atol=2e-5, rtol=1e-5)


def test_dynamic_ntk_row_per_position_is_hf_base_for_that_length():
    """Row p uses the base HF computes for a sequence of max(p + 1, max_position) tokens, so
    rows within max_position are the plain table; the cache covers max_position * factor."""
    scaling = {"rope_type": "dynamic", "factor": 2.0}
    plain = 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    ours = _ours(_hf(scaling)[1])
    assert ours.cos_sin_cache.shape == (2 * MAX_POS, HEAD_DIM)
    within = torch.arange(MAX_POS)
    torch.testing.assert_close(ours.cos_sin_cache[:MAX_POS], _angles(plain, within, 1.0))
    for p in (MAX_POS, MAX_POS + 1, 100, 2 * MAX_POS - 1):
        (inv_freq, _), _ = _hf(scaling, seq_len=p + 1)
        want = _angles(inv_freq, torch.tensor([p]), 1.0)[0]
        torch.testing.assert_close(ours.cos_sin_cache[p], want, atol=2e-5, rtol=1e-5)
        assert not torch.allclose(ours.cos_sin_cache[p], _angles(plain, torch.tensor([p]), 1.0))
