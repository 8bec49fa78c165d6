"""8-bit KV-cache rows in the Triton kernels (the layout of ``lightwell/quant/kv_cache.py``).

A cache of ``float8_e4m3fn`` or ``int8`` holds, per token and KV head, ``D`` 8-bit values and
then the 4 bytes of their fp32 scale (``max|x| / 448`` or ``max|x| / 127``; 1 for an all-zero
row): rows of ``D + 4`` elements, the scale read and written through a float32 pointer.

``store_rows`` (the KV store, alone or fused with RoPE) quantizes like ``quantize_kv``, bit for
bit on CPU and on CUDA, for the reasons act_quant.py gives: both divisions are ``div_rn``, the
amax and clamps are exact, int8 rounds half to even (``rint``), fp8 is the round-to-nearest-even
conversion (the interpreter first rounds to the e4m3 grid itself). ``load_scales`` gives
paged attention a tile's per-key scales; it applies them to the scores and the probabilities.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from lightwell.kernels.act_quant import _rint, _round_e4m3

SCALE_BYTES = 4  # an fp32 scale per token and head, after its D values
QMAX = {torch.float8_e4m3fn: 448.0, torch.int8: 127.0}


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in QMAX


def head_dim_of(cache: torch.Tensor) -> int:
    """D of a cache [..., D] or, 8-bit, [..., D + 4]."""
    return cache.shape[-1] - (SCALE_BYTES if is_quantized(cache.dtype) else 0)


def quant_mode(dtype: torch.dtype) -> int:
    """The kernels' ``KV_QUANT``: 0 the model dtype, 1 fp8 e4m3, 2 int8."""
    return {torch.float8_e4m3fn: 1, torch.int8: 2}.get(dtype, 0)


@triton.jit
def store_rows(
    rows,  # [BLOCK_H] pointers: each head's row in the cache
    d,  # [BLOCK_D] element offsets in a row
    mask,  # [BLOCK_H, BLOCK_D]
    x,  # [BLOCK_H, BLOCK_D] the keys or values
    HEAD_DIM: tl.constexpr,
    KV_QUANT: tl.constexpr,  # quant_mode of the cache dtype
    INTERPRET: tl.constexpr,
):
    ptrs = rows[:, None] + d[None, :]
    if KV_QUANT == 0:
        tl.store(ptrs, x.to(rows.dtype.element_ty), mask=mask)
    else:
        qmax = 448.0 if KV_QUANT == 1 else 127.0
        xf = tl.where(mask, x.to(tl.float32), 0.0)
        amax = tl.max(tl.abs(xf), axis=1)  # [BLOCK_H]
        scale = tl.where(amax > 0, tl.math.div_rn(amax, tl.zeros_like(amax) + qmax), 1.0)
        y = tl.math.div_rn(xf, tl.zeros_like(xf) + scale[:, None])
        y = tl.minimum(tl.maximum(y, -qmax), qmax)
        if KV_QUANT == 2:
            if INTERPRET:
                y = _rint(y)
            else:
                y = libdevice.rint(y)
            q = y.to(tl.int8)  # exact: an integer in range
        else:
            if INTERPRET:
                y = _round_e4m3(y)
            q = y.to(tl.float8e4nv)
        tl.store(ptrs, q, mask=mask)
        row_ok = tl.max(mask.to(tl.int32), axis=1) > 0
        tl.store((rows + HEAD_DIM).to(tl.pointer_type(tl.float32)), scale, mask=row_ok)


@triton.jit
def load_scales(rows, ok, MASKED: tl.constexpr, HEAD_DIM: tl.constexpr):
    """[BLOCK_N] fp32 scales of the rows at ``rows`` (8-bit pointers); 0 where not ``ok``."""
    ptrs = (rows + HEAD_DIM).to(tl.pointer_type(tl.float32))
    if MASKED:
        s = tl.load(ptrs, mask=ok, other=0.0)
    else:
        s = tl.load(ptrs)
    return s
