"""Rotary position embeddings (RoPE) with a precomputed cos/sin cache.

``get_rope`` picks the class by ``rope_scaling["rope_type"]`` (or the older ``"type"`` key).
A scaling family plugs in by subclassing ``RotaryEmbedding`` and overriding one of its hooks,
then adding itself to ``_ROPE_CLASSES``:
  ``_compute_inv_freq``: the per-pair inverse frequencies [rotary_dim / 2] (llama3, NTK ...),
  ``_cache_length``: how many positions the cache holds (linear / dynamic scaling extend it),
  ``_attention_scaling``: a factor on cos and sin (yarn's mscale),
or, when the rotation depends on more than position times frequency, ``_compute_cos_sin_cache``
itself (dynamic NTK). Every variant is a cache indexed by position, so the CUDA kernel
(``kernels/rotary.py``) serves them all unchanged.
The cache is kept in float32 and the rotation computed in float32, then cast back.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        rotary_dim: int,
        max_position: int,
        base: float,
        is_neox_style: bool = True,
        scaling: dict[str, Any] | None = None,
    ):
        super().__init__()
        if rotary_dim > head_dim or rotary_dim % 2:
            raise ValueError(f"rotary_dim {rotary_dim} must be even and <= head_dim {head_dim}")
        self.head_dim, self.rotary_dim = head_dim, rotary_dim
        self.max_position, self.base = max_position, float(base)
        self.is_neox_style = is_neox_style
        self.scaling = dict(scaling or {})
        self.register_buffer("cos_sin_cache", self._compute_cos_sin_cache(), persistent=False)
        # (positions, cos, sin) of the last forward. Step inputs are fresh tensors each step
        # (never refilled in place on this path: CUDA graphs use the Triton kernel instead).
        self._last: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    # ---- hooks for scaling families ----
    def _compute_inv_freq(self) -> torch.Tensor:  # [rotary_dim / 2] float32
        exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.int64).float()
        return 1.0 / (self.base ** (exponents / self.rotary_dim))

    def _cache_length(self) -> int:
        return self.max_position

    def _attention_scaling(self) -> float:
        return 1.0

    # ---- shared machinery ----
    def _compute_cos_sin_cache(self) -> torch.Tensor:  # [max_pos, rotary_dim] float32
        inv_freq = self._compute_inv_freq()
        t = torch.arange(self._cache_length(), dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        mscale = self._attention_scaling()
        return torch.cat((freqs.cos() * mscale, freqs.sin() * mscale), dim=-1)

    def forward(
        self,
        positions: torch.Tensor,  # [T]
        query: torch.Tensor,  # [T, Hq * D]
        key: torch.Tensor,  # [T, Hkv * D]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if query.is_cuda:
            from lightwell.kernels.rotary import rotary_embedding

            return rotary_embedding(
                positions, query, key, self.cos_sin_cache, self.head_dim, self.is_neox_style
            )
        cos, sin = self._cos_sin(positions)
        return self._rotate(query, cos, sin), self._rotate(key, cos, sin)

    def rotate_and_store(
        self,
        positions: torch.Tensor,  # [T]
        query: torch.Tensor,  # [T, Hq * D], rotated in place
        key: torch.Tensor,  # [T, Hkv * D], rotated in place
        value: torch.Tensor,  # [T, Hkv * D]
        kv_cache: torch.Tensor,  # [2, N, B, Hkv, D]
        slot_mapping: torch.Tensor,  # [T]; < 0 = skip
    ) -> None:
        """Rotate q and k in place and write the rotated keys and the values into the paged
        KV cache, in one Triton launch (where the Triton attention backend runs: CUDA, or
        the CPU under ``TRITON_INTERPRET=1``)."""
        from lightwell.kernels.rotary import rotary_embedding

        rotary_embedding(
            positions, query, key, self.cos_sin_cache, self.head_dim, self.is_neox_style,
            v=value, kv_cache=kv_cache, slot_mapping=slot_mapping,
        )  # fmt: skip

    def _cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, 1, rotary_dim / 2] cos and sin, gathered once per forward: every layer shares
        this module and receives the same ``positions`` tensor object."""
        last = self._last
        if last is None or last[0] is not positions:
            cos, sin = self.cos_sin_cache[positions].chunk(2, dim=-1)
            last = self._last = (positions, cos.unsqueeze(1), sin.unsqueeze(1))
        return last[1], last[2]

    def _rotate(
        self,
        x: torch.Tensor,  # [T, H * D]
        cos: torch.Tensor,  # [T, 1, rotary_dim / 2]
        sin: torch.Tensor,  # [T, 1, rotary_dim / 2]
    ) -> torch.Tensor:  # [T, H * D]
        shape, dtype = x.shape, x.dtype
        x = x.reshape(shape[0], -1, self.head_dim)
        rot = x[..., : self.rotary_dim].float()
        if self.is_neox_style:
            x1, x2 = rot.chunk(2, dim=-1)
            rot = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        else:  # GPT-J style: interleaved pairs (x0, x1), (x2, x3) ...
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            rot = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        if self.rotary_dim < self.head_dim:
            rot = torch.cat((rot.to(dtype), x[..., self.rotary_dim :]), dim=-1)
        return rot.to(dtype).reshape(shape)

    def extra_repr(self) -> str:
        kind = self.scaling.get("rope_type", "default")
        return f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, base={self.base}, {kind}"


class LinearScalingRotaryEmbedding(RotaryEmbedding):
    """Position interpolation: frequencies divided by ``factor``; the cache covers
    ``max_position * factor`` positions."""

    def _compute_inv_freq(self) -> torch.Tensor:
        return super()._compute_inv_freq() / float(self.scaling["factor"])

    def _cache_length(self) -> int:
        return int(self.max_position * float(self.scaling["factor"]))


class Llama3RotaryEmbedding(RotaryEmbedding):
    """Llama 3.1 scaling: long wavelengths divided by ``factor``, short ones kept, a smooth
    blend between ``original_max_position_embeddings / low_freq_factor`` and ``/ high``."""

    def _compute_inv_freq(self) -> torch.Tensor:
        inv_freq = super()._compute_inv_freq()
        s = self.scaling
        factor, low, high = (
            float(s["factor"]),
            float(s["low_freq_factor"]),
            float(s["high_freq_factor"]),
        )
        old_len = int(s["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, blended, scaled)


class FreqFactorsRotaryEmbedding(RotaryEmbedding):
    """Per-frequency divisors given explicitly (GGUF's ``rope_freqs`` tensor, as llama.cpp
    stores Llama 3 scaling): ``inv_freq / factors``."""

    def _compute_inv_freq(self) -> torch.Tensor:
        factors = torch.tensor(self.scaling["factors"], dtype=torch.float32)
        inv_freq = super()._compute_inv_freq()
        if factors.shape != inv_freq.shape:
            raise ValueError(
                f"rope frequency factors have shape {tuple(factors.shape)}, expected "
                f"{tuple(inv_freq.shape)}"
            )
        return inv_freq / factors


class DynamicNTKScalingRotaryEmbedding(RotaryEmbedding):
    """Dynamic NTK scaling, position by position: position ``p`` is rotated with the base that
    HF transformers uses for a sequence of ``n = max(p + 1, max_position)`` tokens,
    ``base * (factor * n / max_position - (factor - 1)) ** (d / (d - 2))``.

    HF recomputes one base per forward from the longest sequence in it, so its KV cache holds
    keys rotated under older bases; a cache row per position reproduces exactly what HF's
    token-by-token decoding computes once the prompt fits in ``max_position``, keeps a key's
    rotation independent of the batch (prefix caching, paged blocks) and of the step, and keeps
    short contexts on the unscaled base. (vLLM instead uses the base of ``max_position * factor``
    for every position.) The cache covers ``max_position * factor`` positions."""

    def _cache_length(self) -> int:
        return int(self.max_position * float(self.scaling["factor"]))

    def _compute_cos_sin_cache(self) -> torch.Tensor:  # [max_pos * factor, rotary_dim] float32
        factor, d = float(self.scaling["factor"]), self.rotary_dim
        t = torch.arange(self._cache_length(), dtype=torch.float32)
        n = torch.clamp(t + 1, min=self.max_position)
        bases = self.base * ((factor * n / self.max_position) - (factor - 1)) ** (d / (d - 2))
        exponents = torch.arange(0, d, 2, dtype=torch.int64).float() / d
        inv_freq = 1.0 / (bases[:, None] ** exponents[None, :])  # [max_pos * factor, d / 2]
        freqs = t[:, None] * inv_freq
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


class YaRNScalingRotaryEmbedding(RotaryEmbedding):
    """YaRN: per frequency, a linear ramp between interpolation (``inv_freq / factor``) for
    wavelengths longer than ``original_max_position_embeddings / beta_slow`` rotations and
    extrapolation (unchanged) above ``beta_fast`` rotations; cos and sin are multiplied by the
    attention factor (``0.1 * ln(factor) + 1`` unless given, or DeepSeek's mscale ratio).
    The cache covers ``max(max_position, original * factor)`` positions."""

    def _params(self) -> tuple[float, int]:
        orig = int(self.scaling.get("original_max_position_embeddings") or self.max_position)
        factor = self.scaling.get("factor") or self.max_position / orig
        return float(factor), orig

    def _compute_inv_freq(self) -> torch.Tensor:
        factor, orig = self._params()
        d, base = self.rotary_dim, self.base
        beta_fast = self.scaling.get("beta_fast") or 32
        beta_slow = self.scaling.get("beta_slow") or 1

        def dim_of(rotations: float) -> float:  # the dimension that turns ``rotations`` times
            return d * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low, high = dim_of(beta_fast), dim_of(beta_slow)
        if self.scaling.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, d - 1)
        if low == high:
            high += 0.001  # avoid a zero-width ramp
        ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        inv_freq = super()._compute_inv_freq()
        extrapolate = 1 - ramp
        return inv_freq / factor * (1 - extrapolate) + inv_freq * extrapolate

    def _cache_length(self) -> int:
        factor, orig = self._params()
        return max(self.max_position, int(orig * factor))

    def _attention_scaling(self) -> float:
        given = self.scaling.get("attention_factor")
        if given is not None:
            return float(given)
        factor, _ = self._params()

        def mscale(m: float) -> float:
            return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

        m, m_all = self.scaling.get("mscale"), self.scaling.get("mscale_all_dim")
        return mscale(m) / mscale(m_all) if m and m_all else mscale(1.0)


_ROPE_CLASSES: dict[str, type[RotaryEmbedding]] = {
    "default": RotaryEmbedding,
    "linear": LinearScalingRotaryEmbedding,
    "dynamic": DynamicNTKScalingRotaryEmbedding,
    "yarn": YaRNScalingRotaryEmbedding,
    "llama3": Llama3RotaryEmbedding,
    "freq_factors": FreqFactorsRotaryEmbedding,
    # "longrope" (Phi-3, MiniCPM4): to add (override the hooks above).
}


def get_rope(
    head_dim: int,
    rotary_dim: int,
    max_position: int,
    base: float,
    rope_scaling: dict[str, Any] | None = None,
    is_neox_style: bool = True,
) -> RotaryEmbedding:
    """Build the rotary embedding for ``rope_scaling`` (None or rope_type "default": plain)."""
    scaling = dict(rope_scaling or {})
    rope_type = scaling.get("rope_type", scaling.get("type")) or "default"
    cls = _ROPE_CLASSES.get(rope_type)
    if cls is None:
        raise ValueError(
            f"RoPE scaling type {rope_type!r} is not supported (supported: "
            f"{', '.join(sorted(_ROPE_CLASSES))})"
        )
    scaling["rope_type"] = rope_type
    return cls(head_dim, rotary_dim, max_position, base, is_neox_style, scaling)


def rope_table_length(model: nn.Module) -> int | None:
    """Rows of the shortest RoPE table in ``model`` (the positions it can take, scaling
    included); None for a model without RoPE."""
    lengths = [m.cos_sin_cache.shape[0] for m in model.modules() if isinstance(m, RotaryEmbedding)]
    return min(lengths, default=None)
