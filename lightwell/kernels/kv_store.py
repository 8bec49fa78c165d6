"""Write new keys/values into the paged KV cache at their slots.

Cache layout per layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (K then V);
token t goes to ``slot_mapping[t] = block_id * block_size + offset``. A negative slot means
"skip this token" (the padding rows of a CUDA-graph batch). An 8-bit cache (fp8 e4m3 or int8)
has a last dim of ``head_dim + 4``: each block holds the quantized values, then their fp32
scales (kernels/kv_quant.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lightwell import envs
from lightwell.kernels.act_quant import act_quant_ref
from lightwell.kernels.kv_quant import (
    QMAX,
    SCALE_BYTES,
    head_dim_of,
    quant_mode,
    row_ptrs,
    scale_ptrs,
    store_rows,
)


@triton.jit
def _kv_store_kernel(
    k_ptr,  # [T, Hkv, D]
    v_ptr,  # [T, Hkv, D]
    cache_ptr,  # [2, N, B, Hkv, D] (8-bit: D + 4)
    slot_ptr,  # [T] int64
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_c_kv,
    stride_c_blk,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_QUANT: tl.constexpr,  # kv_quant.quant_mode of the cache dtype
    INTERPRET: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_DIM)  # [BLOCK_H, BLOCK_D]
    src_k = k_ptr + t.to(tl.int64) * stride_kt + h[:, None] * stride_kh + d[None, :]
    src_v = v_ptr + t.to(tl.int64) * stride_vt + h[:, None] * stride_vh + d[None, :]
    block = cache_ptr + blk * stride_c_blk
    rows = row_ptrs(block, off, h, NUM_KV_HEADS, HEAD_DIM)  # [BLOCK_H]
    if KV_QUANT:
        scales = scale_ptrs(block, off, h, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE)
        v_scales = scale_ptrs(block + stride_c_kv, off, h, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE)
    else:  # (not read)
        scales = rows
        v_scales = rows
    k = tl.load(src_k, mask=mask)
    v = tl.load(src_v, mask=mask)
    store_rows(rows, scales, d, mask, k, KV_QUANT, INTERPRET)
    store_rows(rows + stride_c_kv, v_scales, d, mask, v, KV_QUANT, INTERPRET)


def kv_store(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [2, N, B, Hkv, D] (8-bit: D + 4)
    slot_mapping: torch.Tensor,  # [T] int64; < 0 = skip
) -> None:
    """Write ``k``/``v`` into ``kv_cache`` in place (cast to the cache dtype; an fp8 or int8
    cache gets each row quantized with its scale, as ``quant/kv_cache.py``'s ``quantize_kv``)."""
    check_store(k, v, kv_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    block_h = triton.next_power_of_2(num_kv_heads)
    block_d = triton.next_power_of_2(head_dim)
    _kv_store_kernel[(num_tokens,)](
        k,
        v,
        kv_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        BLOCK_SIZE=kv_cache.shape[2],
        KV_QUANT=quant_mode(kv_cache.dtype),
        INTERPRET=envs.triton_interpret(),
        num_warps=4 if block_h * block_d >= 1024 else 1,
    )


def kv_store_ref(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [2, N, B, Hkv, D] (8-bit: D + 4)
    slot_mapping: torch.Tensor,  # [T] int64; < 0 = skip
) -> None:
    """The store in torch, written from the layout's description (kernels/kv_quant.py)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    num_blocks, block, heads, width = kv_cache.shape[1:]
    blk, off = slots // block, slots % block
    for i, x in enumerate((k, v)):
        raw = _raw(kv_cache[i])
        if kv_cache.dtype not in QMAX:
            raw.view(-1, heads, width)[slots] = _raw(x[keep].to(kv_cache.dtype))
            continue
        dim = width - SCALE_BYTES
        q, scale = act_quant_ref(x[keep].reshape(-1, dim), kv_cache.dtype)  # a row per head
        per_block = raw.view(num_blocks, -1).view(torch.uint8)  # a block's bytes
        values = per_block[:, : block * heads * dim].view(num_blocks, block, heads, dim)
        scales = per_block[:, block * heads * dim :].view(num_blocks, heads, block, SCALE_BYTES)
        values[blk, off] = _raw(q).view(torch.uint8).view(-1, heads, dim)
        scales[blk, :, off] = scale.view(torch.uint8).view(-1, heads, SCALE_BYTES)


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t  # (no fp8 indexing)


def check_store(k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    if k.dim() != 3 or k.shape != v.shape:
        raise ValueError(
            f"k and v must both be [T, Hkv, D]; got {tuple(k.shape)}, {tuple(v.shape)}"
        )
    shape_ok = cache.dim() == 5 and cache.shape[0] == 2 and cache.shape[3] == k.shape[1]
    if not shape_ok or head_dim_of(cache) != k.shape[2]:
        raise ValueError(f"kv_cache {tuple(cache.shape)} does not match k/v {tuple(k.shape)}")
    if quant_mode(cache.dtype) and k.shape[2] % SCALE_BYTES:
        raise ValueError(f"an 8-bit KV cache needs head_dim % 4 == 0, got {k.shape[2]}")
    if k.stride(2) != 1 or v.stride(2) != 1 or not cache.is_contiguous():
        raise ValueError("k/v need a contiguous last dim and kv_cache must be contiguous")
    if slots.shape != (k.shape[0],) or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be [T] int32/int64; got {tuple(slots.shape)}")
    if not (k.device == v.device == cache.device == slots.device):
        raise ValueError("k, v, kv_cache and slot_mapping must be on one device")
