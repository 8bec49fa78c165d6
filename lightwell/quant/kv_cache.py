"""KV-cache dtypes (``--kv-cache-dtype``): how keys and values are stored in the paged cache.

- ``auto``: the model dtype.
- ``fp8`` (e4m3) and ``int8``: one scale per token and KV head (``max|x| / 448`` or
  ``max|x| / 127`` over the head's D values), kept in-band: each head's row is ``D + 4`` bytes,
  the last four the fp32 scale's bytes, so the cache stays one tensor [2, N, B, Hkv, D + 4]
  (bf16 holds 2D bytes: 1.88x the tokens at D = 64, 1.94x at D = 128).

Both attention backends read and write every dtype: the torch one (CPU) through
``quantize_kv`` / ``dequantize_kv`` below, the Triton one (GPU) in its kernels
(``kernels/kv_quant.py``: the store quantizes bit for bit as ``quantize_kv``; attention loads
the 8-bit tiles and their scales). Latent (MLA) caches stay in the model dtype.
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


def stored_head_size(dtype: torch.dtype, head_dim: int) -> int:
    """Elements per token and head in a cache of ``dtype`` (8-bit caches carry a scale)."""
    return head_dim + SCALE_BYTES if dtype in (FP8, torch.int8) else head_dim


def quantize_kv(
    x: torch.Tensor,  # [T, Hkv, D]
    dtype: torch.dtype,  # the cache dtype
) -> torch.Tensor:  # [T, Hkv, stored_head_size(D)] in dtype
    if dtype not in (FP8, torch.int8):
        return x.to(dtype)
    qmax = FP8_MAX if dtype == FP8 else 127.0
    amax = x.float().abs().amax(-1, keepdim=True)  # [T, Hkv, 1]
    # a tensor divisor: IEEE division on CUDA too (as the Triton store's div_rn)
    scale = torch.where(amax > 0, amax / torch.full_like(amax, qmax), torch.ones_like(amax))
    y = (x.float() / scale).clamp(-qmax, qmax)
    q = y.to(FP8) if dtype == FP8 else torch.round(y).to(torch.int8)
    rows = torch.cat([q.view(torch.uint8), scale.view(torch.uint8)], dim=-1)
    return rows.view(dtype)


def dequantize_kv(
    stored: torch.Tensor,  # [..., stored_head_size(D)] as in the cache
    out_dtype: torch.dtype,
) -> torch.Tensor:  # [..., D] in out_dtype
    if stored.dtype not in (FP8, torch.int8):
        return stored.to(out_dtype)
    q, scale_bytes = stored[..., :-SCALE_BYTES], stored[..., -SCALE_BYTES:]
    scale = scale_bytes.contiguous().view(torch.uint8).view(torch.float32)  # [..., 1]
    return (q.float() * scale).to(out_dtype)
