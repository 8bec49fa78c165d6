"""8-bit KV-cache rows in the Triton kernels (the layout of ``lightwell/quant/kv_cache.py``).

A cache of ``float8_e4m3fn`` or ``int8`` holds, per token and KV head, ``D`` 8-bit values and
an fp32 scale (``max|x| / 448`` or ``max|x| / 127``; 1 for an all-zero row). A block of B
tokens is ``B * Hkv * (D + 4)`` bytes: the ``B * Hkv`` rows of values (token-major, as in a
model-dtype block: ``row_ptrs``), then the ``Hkv * B`` scales (head-major: ``scale_ptrs``), so
that rows start at multiples of D bytes and a head's scales in a block are contiguous.

``store_rows`` (the KV store, alone or fused with RoPE) quantizes like ``quantize_kv``, bit for
bit on CPU and on CUDA, for the reasons act_quant.py gives: both divisions are ``div_rn``, the
amax and clamps are exact, int8 rounds half to even (``rint``), fp8 is the round-to-nearest-even
conversion (the interpreter first rounds to the e4m3 grid itself). Paged attention loads a
tile's per-key scales through ``scale_ptrs`` and applies them to the scores and probabilities.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from lightwell.kernels.act_quant import _rint, _round_e4m3

SCALE_BYTES = 4  # an fp32 scale per token and head, after the block's values
QMAX = {torch.float8_e4m3fn: 448.0, torch.int8: 127.0}


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in QMAX


def scales_offset(block_size: int, num_kv_heads: int, head_dim: int) -> int:
    """Bytes from a block's start to its scales."""
    return block_size * num_kv_heads * head_dim


def head_dim_of(cache: torch.Tensor) -> int:
    """D of a cache [..., D] or, 8-bit, [..., D + 4]."""
    return cache.shape[-1] - (SCALE_BYTES if is_quantized(cache.dtype) else 0)


def quant_mode(dtype: torch.dtype) -> int:
    """The kernels' ``KV_QUANT``: 0 the model dtype, 1 fp8 e4m3, 2 int8."""
    return {torch.float8_e4m3fn: 1, torch.int8: 2}.get(dtype, 0)


@triton.jit
def block_ptr(cache_ptr, block, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
              BLOCK_SIZE: tl.constexpr, KV_QUANT: tl.constexpr):  # fmt: skip
    """The start of block ``block`` (any int tensor) of the cache at ``cache_ptr``."""
    ROW: tl.constexpr = HEAD_DIM + 4 if KV_QUANT else HEAD_DIM  # (4: SCALE_BYTES)
    return cache_ptr + block.to(tl.int64) * (BLOCK_SIZE * NUM_KV_HEADS * ROW)


@triton.jit
def row_ptrs(block, tok, h, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Pointers to the value rows of token ``tok`` (in its block) and heads ``h``, in the block
    at ``block``: the same for a model-dtype and an 8-bit block."""
    return block + (tok * NUM_KV_HEADS + h) * HEAD_DIM


@triton.jit
def scale_ptrs(
    block,
    tok,
    h,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """fp32 pointers to the scales of token ``tok`` and heads ``h`` in the 8-bit block at
    ``block`` (either may be a tensor)."""
    first = (block + BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM).to(tl.pointer_type(tl.float32))
    return first + h * BLOCK_SIZE + tok


@triton.jit
def row_scale(amax, KV_QUANT: tl.constexpr):
    """The fp32 scale of rows whose largest magnitude is ``amax`` (1 for an all-zero row)."""
    qmax = 448.0 if KV_QUANT == 1 else 127.0
    return tl.where(amax > 0, tl.math.div_rn(amax, tl.zeros_like(amax) + qmax), 1.0)


@triton.jit
def to_8bit(xf, scale, KV_QUANT: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 ``xf`` divided by ``scale`` (broadcast to it), saturated, in the cache's 8 bits."""
    qmax = 448.0 if KV_QUANT == 1 else 127.0
    y = tl.math.div_rn(xf, tl.zeros_like(xf) + scale)
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
    return q


@triton.jit
def store_rows(
    rows,  # [BLOCK_H] pointers: each head's row of values in the cache
    scales,  # [BLOCK_H] fp32 pointers: each head's scale (8-bit caches)
    d,  # [BLOCK_D] element offsets in a row
    mask,  # [BLOCK_H, BLOCK_D]
    x,  # [BLOCK_H, BLOCK_D] the keys or values
    KV_QUANT: tl.constexpr,  # quant_mode of the cache dtype
    INTERPRET: tl.constexpr,
):
    ptrs = rows[:, None] + d[None, :]
    if KV_QUANT == 0:
        tl.store(ptrs, x.to(rows.dtype.element_ty), mask=mask)
    else:
        xf = tl.where(mask, x.to(tl.float32), 0.0)
        scale = row_scale(tl.max(tl.abs(xf), axis=1), KV_QUANT)  # [BLOCK_H]
        tl.store(ptrs, to_8bit(xf, scale[:, None], KV_QUANT, INTERPRET), mask=mask)
        row_ok = tl.max(mask.to(tl.int32), axis=1) > 0
        tl.store(scales, scale, mask=row_ok)


@triton.jit
def load_scales(ptrs, ok, MASKED: tl.constexpr):
    """[BLOCK_N] fp32 scales at ``ptrs``; 0 where not ``ok``."""
    if MASKED:
        s = tl.load(ptrs, mask=ok, other=0.0)
    else:
        s = tl.load(ptrs)
    return s


@triton.constexpr_function
def to_f16_ptx(fp8):
    """Inline PTX turning four 8-bit values of one register ($2) into fp16 in two ($0: values
    0-1, $1: 2-3): fp8 e4m3 by the hardware's pair conversion; int8 by placing each byte + 128
    in the low byte of an fp16 1024 (0x64nn = 1024 + n), minus 1152."""
    if fp8:
        return (
            "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; "
            "cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }"
        )
    return (
        "{ .reg .b32 u, c; xor.b32 u, $2, 0x80808080; mov.b32 c, 0x64806480; "
        "prmt.b32 $0, u, 0x64646464, 0x5140; prmt.b32 $1, u, 0x64646464, 0x7362; "
        "sub.rn.f16x2 $0, $0, c; sub.rn.f16x2 $1, $1, c; }"
    )


@triton.jit
def tile_to_f16(x, ASM: tl.constexpr):
    """An 8-bit (fp8 e4m3 or int8) tile in fp16, exactly. ``ASM`` (a GPU): by inline PTX that
    Triton keeps in x's own layout (not pure, so it is neither moved nor duplicated); a plain
    conversion lets Triton carry the 8-bit bytes into a product's transposed operand layout one
    shared-memory load each, where the fp16 tile would take transposing ldmatrix."""
    if ASM:
        code: tl.constexpr = to_f16_ptx(x.dtype == tl.float8e4nv)
        y = tl.inline_asm_elementwise(code, "=r,=r,r", [x.to(tl.uint8, bitcast=True)],
                                      dtype=tl.float16, is_pure=False, pack=4)  # fmt: skip
    else:
        y = x.to(tl.float16)
    return y
