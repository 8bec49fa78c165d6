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
    stride_q,
    stride_k,
    stride_cache,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROT_DIM: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    IS_NEOX: tl.constexpr,
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


def rotary_embedding(
    positions: torch.Tensor,  # [T] int
    q: torch.Tensor,  # [T, Hq * D], rotated in place
    k: torch.Tensor,  # [T, Hkv * D], rotated in place
    cos_sin_cache: torch.Tensor,  # [max_pos, rotary_dim]
    head_dim: int,
    is_neox_style: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:  # (q, k), the same tensors
    """Rotate q and k in place at ``positions``; returns them for chaining."""
    _check(positions, q, k, cos_sin_cache, head_dim)
    num_tokens = q.shape[0]
    if num_tokens == 0:
        return q, k
    rot_dim = cos_sin_cache.shape[1]
    hq, hkv = q.shape[1] // head_dim, k.shape[1] // head_dim
    half_pad = triton.next_power_of_2(rot_dim // 2)
    block_hq = triton.next_power_of_2(hq)
    _rotary_kernel[(num_tokens,)](
        positions, q, k, cos_sin_cache,
        q.stride(0), k.stride(0), cos_sin_cache.stride(0),
        NUM_Q_HEADS=hq, NUM_KV_HEADS=hkv, HEAD_DIM=head_dim, ROT_DIM=rot_dim,
        HALF_PAD=half_pad, BLOCK_HQ=block_hq, BLOCK_HK=triton.next_power_of_2(hkv),
        IS_NEOX=is_neox_style, num_warps=4 if block_hq * half_pad >= 2048 else 1,
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
