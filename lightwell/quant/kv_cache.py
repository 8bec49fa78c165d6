"""KV-cache dtypes (``--kv-cache-dtype``): how keys and values are stored in the paged cache.

- ``auto``: the model dtype.
- ``fp8`` (e4m3) and ``int8``: one scale per token and KV head (``max|x| / 448`` or
  ``max|x| / 127`` over the head's D values). The cache stays one tensor
  [2, N, B, Hkv, D + 4] (bf16 holds 2D bytes: 1.88x the tokens at D = 64, 1.94x at D = 128),
  but a block's ``B * Hkv * (D + 4)`` bytes hold first its ``B * Hkv`` rows of D values
  (token, then head, as a model-dtype block) and then the ``Hkv * B`` fp32 scales (head, then
  token): rows of D bytes stay as aligned as D, and a head's scales within a block are
  contiguous. ``split_blocks`` gives both as views.

Both attention backends read and write every dtype: the torch one (CPU) through the functions
below, the Triton one (GPU) in its kernels (``kernels/kv_quant.py``: the store quantizes bit
for bit as ``quantize_kv``; attention loads the 8-bit tiles and their scales). A latent (MLA)
cache is one "head" of D = kv_lora_rank + rope_dim values a token (576 for DeepSeek: 580 bytes
against bf16's 1,152), one scale over the latent and RoPE parts together.
"""

from __future__ import annotations

import torch

from lightwell.config import KV_CACHE_DTYPES

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
SCALE_BYTES = 4  # an fp32 scale per token and head, in-band


def cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype {name!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
    return {"auto": model_dtype, "fp8": FP8, "int8": torch.int8}[name]


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in (FP8, torch.int8)


def stored_head_size(dtype: torch.dtype, head_dim: int) -> int:
    """The cache tensor's last dim for ``dtype`` (8-bit blocks also carry the scales)."""
    return head_dim + SCALE_BYTES if is_quantized(dtype) else head_dim


def cache_head_dim(cache: torch.Tensor) -> int:
    """D of a cache tensor [..., D] or, 8-bit, [..., D + 4]."""
    return cache.shape[-1] - (SCALE_BYTES if is_quantized(cache.dtype) else 0)


def check_head_dim(head_dim: int, dtype: torch.dtype) -> None:
    """An 8-bit cache's fp32 scales follow rows of ``head_dim`` bytes: 4-byte aligned only if
    ``head_dim % 4 == 0``."""
    if is_quantized(dtype) and head_dim % SCALE_BYTES:
        raise ValueError(
            f"an 8-bit KV cache (--kv-cache-dtype fp8 / int8) needs head_dim % 4 == 0 (fp32 "
            f"scales), got {head_dim}"
        )


def split_blocks(
    cache: torch.Tensor,  # [..., B, Hkv, D + 4] 8-bit, each block's last three dims contiguous
) -> tuple[torch.Tensor, torch.Tensor]:  # ([..., B, Hkv, D] values, [..., Hkv, B] fp32 scales)
    """Views of an 8-bit cache's values and scales (the layout in this module's docstring)."""
    *lead, block, heads, row = cache.shape
    dim = row - SCALE_BYTES
    check_head_dim(dim, cache.dtype)
    if cache.stride(-1) != 1 or cache.stride(-2) != row or cache.stride(-3) != heads * row:
        raise ValueError(f"8-bit KV blocks must be contiguous; got strides {cache.stride()}")
    flat = cache.flatten(-3)  # [..., B * Hkv * (D + 4)]
    values = flat[..., : block * heads * dim].unflatten(-1, (block, heads, dim))
    scales = flat[..., block * heads * dim :].view(torch.float32).unflatten(-1, (heads, block))
    return values, scales


def quantize_kv(
    x: torch.Tensor,  # [..., D]
    dtype: torch.dtype,  # the cache dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:  # ([..., D] in dtype, [...] fp32 scales or None)
    if not is_quantized(dtype):
        return x.to(dtype), None
    qmax = FP8_MAX if dtype == FP8 else 127.0
    amax = x.float().abs().amax(-1, keepdim=True)  # [..., 1]
    # a tensor divisor: IEEE division on CUDA too (as the Triton store's div_rn)
    scale = torch.where(amax > 0, amax / torch.full_like(amax, qmax), torch.ones_like(amax))
    y = (x.float() / scale).clamp(-qmax, qmax)
    q = y.to(FP8) if dtype == FP8 else torch.round(y).to(torch.int8)
    return q, scale.squeeze(-1)


def dequantize_kv(
    q: torch.Tensor,  # [..., D]
    scale: torch.Tensor | None,  # [...] fp32, None for a model-dtype cache
    out_dtype: torch.dtype,
) -> torch.Tensor:  # [..., D] in out_dtype
    if scale is None:
        return q.to(out_dtype)
    return (q.float() * scale[..., None]).to(out_dtype)


def quantize_blocks(
    x: torch.Tensor,  # [..., B, Hkv, D]
    dtype: torch.dtype,
) -> torch.Tensor:  # [..., B, Hkv, stored_head_size(D)] in dtype: cache blocks
    """Whole blocks in the cache's layout (tests, benchmarks and the round trip below)."""
    q, scale = quantize_kv(x, dtype)
    if scale is None:
        return q
    out = torch.empty((*x.shape[:-1], x.shape[-1] + SCALE_BYTES), dtype=dtype, device=x.device)
    values, scales = split_blocks(out)
    _raw(values).copy_(_raw(q))
    scales.copy_(scale.transpose(-1, -2))
    return out


def dequantize_blocks(
    cache: torch.Tensor,  # [..., B, Hkv, stored_head_size(D)]
    out_dtype: torch.dtype,
) -> torch.Tensor:  # [..., B, Hkv, D]
    if not is_quantized(cache.dtype):
        return cache.to(out_dtype)
    values, scales = split_blocks(cache)
    return dequantize_kv(values, scales.transpose(-1, -2), out_dtype)


def write_rows(
    cache: torch.Tensor,  # [N, B, Hkv, stored_head_size(D)] one of K / V
    x: torch.Tensor,  # [T, Hkv, D]
    slots: torch.Tensor,  # [T] int >= 0: block_id * B + offset
) -> None:
    """Store ``x`` quantized (or cast) at ``slots``, as the Triton store does."""
    q, scale = quantize_kv(x, cache.dtype)
    slots = slots.long()
    block = cache.shape[1]
    if scale is None:
        _raw(cache).flatten(0, 1).index_copy_(0, slots, _raw(q))
        return
    values, scales = split_blocks(cache)
    blk, off = slots // block, slots % block
    _raw(values)[blk, off] = _raw(q)
    scales[blk, :, off] = scale


def _raw(t: torch.Tensor) -> torch.Tensor:
    """fp8 as its bytes (index_copy_ / indexing have no fp8 kernels on CPU)."""
    return t.view(torch.uint8) if t.dtype == FP8 else t
