"""In-place rotary position embedding (RoPE) of q and k from a precomputed cos/sin cache.

The cache is the rotary layer's ``cos_sin_cache`` ``[max_pos, rotary_dim]``: cos of the
``rotary_dim / 2`` frequencies, then their sin (scaling such as llama3 lives in the cache, so it
needs no kernel change). Neox style (HF Llama) rotates the halves ``x[:r/2]``, ``x[r/2:r]`` of each
head; GPT-J style rotates interleaved pairs. Dims past ``rotary_dim`` are left as they are. The
rotation is computed in fp32 and rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lightwell import envs
from lightwell.kernels.kv_quant import quant_mode, row_ptrs, scale_ptrs, store_rows
from lightwell.kernels.kv_store import check_store


@triton.jit
def _rotate_heads(
    x_ptr,  # [T, H * D]
    row,
    stride_t,
    cos,  # [HALF_PAD] fp32
    sin,  # [HALF_PAD] fp32
    off1,  # [HALF_PAD] first element of each rotated pair within a head
    off2,  # [HALF_PAD] second element
    j_ok,  # [HALF_PAD]
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    offs_h = tl.arange(0, BLOCK_H)
    base = x_ptr + row * stride_t + offs_h[:, None] * HEAD_DIM  # [BLOCK_H, 1]
    mask = (offs_h[:, None] < NUM_HEADS) & j_ok[None, :]
    x1 = tl.load(base + off1[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + off2[None, :], mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * cos[None, :] - x2 * sin[None, :]
    o2 = x2 * cos[None, :] + x1 * sin[None, :]
    tl.store(base + off1[None, :], o1.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(base + off2[None, :], o2.to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    pos_ptr,  # [T]
    q_ptr,  # [T, Hq * D]
    k_ptr,  # [T, Hkv * D]
    cache_ptr,  # [max_pos, ROT_DIM] fp32: cos | sin
    v_ptr,  # [T, Hkv * D] (STORE_KV)
    kvc_ptr,  # [2, N, BLOCK_SIZE, Hkv, D] (8-bit: D + 4) the layer's KV cache (STORE_KV)
    slot_ptr,  # [T] int; < 0: not stored (STORE_KV)
    stride_q,
    stride_k,
    stride_v,
    stride_cache,
    stride_c_kv,
    stride_c_blk,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROT_DIM: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    IS_NEOX: tl.constexpr,
    STORE_KV: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KV_QUANT: tl.constexpr,  # kv_quant.quant_mode of the cache dtype
    INTERPRET: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + row).to(tl.int64)
    j = tl.arange(0, HALF_PAD)
    j_ok = j < ROT_DIM // 2
    cos = tl.load(cache_ptr + pos * stride_cache + j, mask=j_ok, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * stride_cache + ROT_DIM // 2 + j, mask=j_ok, other=0.0)
    sin = sin.to(tl.float32)
    if IS_NEOX:
        off1 = j
        off2 = j + ROT_DIM // 2
    else:
        off1 = 2 * j
        off2 = 2 * j + 1
    _rotate_heads(q_ptr, row, stride_q, cos, sin, off1, off2, j_ok, NUM_Q_HEADS, HEAD_DIM, BLOCK_HQ)
    _rotate_heads(
        k_ptr, row, stride_k, cos, sin, off1, off2, j_ok, NUM_KV_HEADS, HEAD_DIM, BLOCK_HK
    )
    if STORE_KV:  # the rotated key and the value into the paged cache, at the token's slot
        tl.debug_barrier()  # the block's rotated k (global writes) visible to every thread
        slot = tl.load(slot_ptr + row).to(tl.int64)
        if slot >= 0:
            h = tl.arange(0, BLOCK_HK)
            d = tl.arange(0, BLOCK_D)
            mask = (h[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_DIM)
            src = h[:, None] * HEAD_DIM + d[None, :]  # [BLOCK_HK, BLOCK_D]
            key = tl.load(k_ptr + row * stride_k + src, mask=mask)
            val = tl.load(v_ptr + row * stride_v + src, mask=mask)
            block = kvc_ptr + (slot // BLOCK_SIZE) * stride_c_blk
            tok = slot % BLOCK_SIZE
            rows = row_ptrs(block, tok, h, NUM_KV_HEADS, HEAD_DIM)  # [BLOCK_HK]
            if KV_QUANT == 0:
                dst = rows[:, None] + d[None, :]
                tl.store(dst, key.to(kvc_ptr.dtype.element_ty), mask=mask)
                tl.store(dst + stride_c_kv, val.to(kvc_ptr.dtype.element_ty), mask=mask)
            else:  # 8-bit blocks: values, then their scales (kernels/kv_quant.py)
                k_s = scale_ptrs(block, tok, h, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE)
                v_s = scale_ptrs(block + stride_c_kv, tok, h, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE)
                store_rows(rows, k_s, d, mask, key, KV_QUANT, INTERPRET)
                store_rows(rows + stride_c_kv, v_s, d, mask, val, KV_QUANT, INTERPRET)


def rotary_embedding(
    positions: torch.Tensor,  # [T] int
    q: torch.Tensor,  # [T, Hq * D], rotated in place
    k: torch.Tensor,  # [T, Hkv * D], rotated in place
    cos_sin_cache: torch.Tensor,  # [max_pos, rotary_dim]
    head_dim: int,
    is_neox_style: bool = True,
    *,
    v: torch.Tensor | None = None,  # [T, Hkv * D]
    kv_cache: torch.Tensor | None = None,  # [2, N, B, Hkv, D] (8-bit: D + 4)
    slot_mapping: torch.Tensor | None = None,  # [T] int; < 0 = skip
) -> tuple[torch.Tensor, torch.Tensor]:  # (q, k), the same tensors
    """Rotate q and k in place at ``positions``; returns them for chaining. With ``kv_cache``
    (and ``v``, ``slot_mapping``), the same launch also does ``kv_store``'s work: the rotated
    key and ``v`` go into the cache at each token's slot (one kernel a layer instead of two)."""
    _check(positions, q, k, cos_sin_cache, head_dim)
    num_tokens = q.shape[0]
    hq, hkv = q.shape[1] // head_dim, k.shape[1] // head_dim
    store = kv_cache is not None
    if store:
        if v is None or slot_mapping is None:
            raise ValueError("storing into kv_cache needs v and slot_mapping")
        if v.shape != k.shape:
            raise ValueError(f"v {tuple(v.shape)} must be shaped like k {tuple(k.shape)}")
        as_heads = (num_tokens, hkv, head_dim)
        check_store(k.view(as_heads), v.view(as_heads), kv_cache, slot_mapping)
    if num_tokens == 0:
        return q, k
    rot_dim = cos_sin_cache.shape[1]
    half_pad = triton.next_power_of_2(rot_dim // 2)
    block_hq = triton.next_power_of_2(hq)
    dummy = q  # pointer arguments the kernel does not read when it does not store
    _rotary_kernel[(num_tokens,)](
        positions, q, k, cos_sin_cache,
        v if store else dummy, kv_cache if store else dummy,
        slot_mapping if store else positions,
        q.stride(0), k.stride(0), v.stride(0) if store else 0, cos_sin_cache.stride(0),
        kv_cache.stride(0) if store else 0, kv_cache.stride(1) if store else 0,
        NUM_Q_HEADS=hq, NUM_KV_HEADS=hkv, HEAD_DIM=head_dim, ROT_DIM=rot_dim,
        HALF_PAD=half_pad, BLOCK_HQ=block_hq, BLOCK_HK=triton.next_power_of_2(hkv),
        IS_NEOX=is_neox_style, STORE_KV=store,
        BLOCK_SIZE=kv_cache.shape[2] if store else 1,
        BLOCK_D=triton.next_power_of_2(head_dim),
        KV_QUANT=quant_mode(kv_cache.dtype) if store else 0, INTERPRET=envs.triton_interpret(),
        num_warps=4 if block_hq * half_pad >= 2048 else 1,
    )  # fmt: skip
    return q, k


def rotary_embedding_ref(
    positions: torch.Tensor,  # [T] int
    q: torch.Tensor,  # [T, Hq * D]
    k: torch.Tensor,  # [T, Hkv * D]
    cos_sin_cache: torch.Tensor,  # [max_pos, rotary_dim]
    head_dim: int,
    is_neox_style: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:  # new tensors ([T, Hq * D], [T, Hkv * D])
    cos, sin = cos_sin_cache[positions].float().chunk(2, dim=-1)  # [T, rotary_dim / 2] each
    cos, sin = cos[:, None, :], sin[:, None, :]
    rot_dim = cos_sin_cache.shape[1]

    def rotate(x: torch.Tensor) -> torch.Tensor:  # [T, H * D]
        y = x.reshape(x.shape[0], -1, head_dim).clone()  # [T, H, D]
        r = y[..., :rot_dim].float()
        if is_neox_style:
            x1, x2 = r.chunk(2, dim=-1)
            r = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        else:
            x1, x2 = r[..., 0::2], r[..., 1::2]
            r = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        y[..., :rot_dim] = r.to(x.dtype)
        return y.reshape(x.shape)

    return rotate(q), rotate(k)


def _check(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cache: torch.Tensor,
    head_dim: int,
) -> None:
    if q.dim() != 2 or k.dim() != 2 or q.shape[0] != k.shape[0] or positions.shape != q.shape[:1]:
        raise ValueError(
            f"want positions [T], q [T, Hq*D], k [T, Hkv*D]; got {tuple(positions.shape)}, "
            f"{tuple(q.shape)}, {tuple(k.shape)}"
        )
    if q.shape[1] % head_dim or k.shape[1] % head_dim:
        raise ValueError(f"q/k widths {q.shape[1]}, {k.shape[1]} are not multiples of {head_dim}")
    rot_dim = cache.shape[-1] if cache.dim() == 2 else -1
    if rot_dim <= 0 or rot_dim % 2 or rot_dim > head_dim:
        raise ValueError(f"cos_sin_cache must be [max_pos, rotary_dim <= {head_dim}], even dim")
    if q.stride(1) != 1 or k.stride(1) != 1 or cache.stride(1) != 1:
        raise ValueError("q, k and cos_sin_cache need a contiguous last dim")
    if positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions must be int32/int64, got {positions.dtype}")
