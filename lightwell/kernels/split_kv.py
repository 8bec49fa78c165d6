"""Flash-decoding support: how many KV splits to use, their partial buffers, and the combine.

Split s of a (token, head) row holds ``m_s`` (running max of the base-2 scaled scores),
``l_s = sum 2^(score - m_s)`` and the unnormalised ``acc_s = sum 2^(score - m_s) v``; an empty
split has ``m_s = -1e30``, ``l_s = 0``, ``acc_s = 0``. The combined output is
``sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s`` with ``M = max_s m_s`` (0 if all are empty).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MAX_SPLITS = 64
MIN_KEYS_PER_SPLIT = 256
_NEG_BIG = tl.constexpr(-1.0e30)


@dataclass
class SplitPartials:
    acc: torch.Tensor  # [T_sub, Hq, S, D_pad] fp32
    row_max: torch.Tensor  # [T_sub, Hq, S] fp32
    row_sum: torch.Tensor  # [T_sub, Hq, S] fp32

    @classmethod
    def empty(
        cls, num_tokens: int, num_heads: int, splits: int, d_pad: int, device
    ) -> SplitPartials:
        f32 = torch.float32
        m = torch.empty((num_tokens, num_heads, splits), dtype=f32, device=device)
        acc = torch.empty((num_tokens, num_heads, splits, d_pad), dtype=f32, device=device)
        return cls(acc, m, torch.empty_like(m))


@functools.cache
def num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def device_sms(device: torch.device) -> int | None:
    """The SMs of a CUDA device (its index, or the current device's); None off CUDA."""
    if device.type != "cuda":
        return None
    return num_sms(device.index if device.index is not None else torch.cuda.current_device())


def auto_num_splits(num_programs: int, max_seq_len: int, device: torch.device) -> int:
    """Split only when the unsplit grid leaves SMs idle and contexts are long (at least
    ``MIN_KEYS_PER_SPLIT`` keys per split); aims at about two programs per SM."""
    sms = device_sms(device)
    if sms is None:
        return 1
    if num_programs > sms:
        return 1
    by_len = max_seq_len // MIN_KEYS_PER_SPLIT
    return max(1, min(triton.cdiv(2 * sms, num_programs), by_len, MAX_SPLITS))


@triton.jit
def store_partials(
    acc_ptr, m_ptr, l_ptr, row, split, acc, l_i, m_i, row_ok, offs_d, HEAD_DIM_PAD: tl.constexpr
):
    """One program's per-split partial results (acc, running max, running sum)."""
    idx = row * tl.num_programs(2) + split  # [BLOCK_M] into [T_sub, Hq, S]
    tl.store(acc_ptr + idx[:, None] * HEAD_DIM_PAD + offs_d[None, :], acc, mask=row_ok[:, None])
    tl.store(m_ptr + idx, m_i, mask=row_ok)
    tl.store(l_ptr + idx, l_i, mask=row_ok)


@triton.jit(do_not_specialize=["covered_index", "tok_base", "num_splits"])
def _reduce_splits_kernel(
    part_acc_ptr,  # [T_sub, Hq, S, HEAD_DIM_PAD] fp32
    part_m_ptr,  # [T_sub, Hq, S] fp32
    part_l_ptr,  # [T_sub, Hq, S] fp32
    out_ptr,  # [T, Hq, D]
    num_covered_ptr,  # int32: tokens tok_base .. num_covered_ptr[covered_index] are real
    covered_index,  # (the rest get zeros)
    tok_base,
    num_splits,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    t = tl.program_id(0)  # token, relative to tok_base
    h = tl.program_id(1)
    covered = t < tl.load(num_covered_ptr + covered_index) - tok_base
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    s_ok = offs_s < tl.where(covered, num_splits, 0)
    part = (t.to(tl.int64) * tl.num_programs(1) + h) * num_splits + offs_s  # [SPLITS_PAD]
    m = tl.load(part_m_ptr + part, mask=s_ok, other=_NEG_BIG)
    ls = tl.load(part_l_ptr + part, mask=s_ok, other=0.0)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM_PAD + offs_d[None, :], mask=s_ok[:, None])
    w = tl.exp2(m - tl.max(m, 0))  # [SPLITS_PAD]
    denom = tl.sum(w * ls, 0)
    out = tl.sum(tl.where(s_ok[:, None], acc, 0.0) * w[:, None], 0)
    out = out / tl.where(denom > 0, denom, 1.0)
    o_ptrs = out_ptr + (t + tok_base).to(tl.int64) * stride_ot + h * stride_oh + offs_d
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


def reduce_splits(
    parts: SplitPartials,
    out: torch.Tensor,  # [T, Hq, D]: rows tok_base .. tok_base + T_sub are written
    num_covered: torch.Tensor,  # int32 on device: element covered_index = end of real tokens
    tok_base: int = 0,
    covered_index: int = 0,
) -> torch.Tensor:
    """Combine the splits of tokens ``tok_base:tok_base + T_sub`` into ``out``. The partials
    hold up to ``MAX_SPLITS`` splits, all through one compiled kernel (its split axis is
    padded to ``MAX_SPLITS``, not to the next power of two of this launch's count)."""
    num_tokens, num_heads, splits, d_pad = parts.acc.shape
    if out.shape[1] != num_heads or out.shape[2] > d_pad or out.stride(2) != 1:
        raise ValueError(f"out {tuple(out.shape)} does not fit partials {tuple(parts.acc.shape)}")
    if num_tokens == 0:
        return out
    _reduce_splits_kernel[(num_tokens, num_heads)](
        parts.acc, parts.row_max, parts.row_sum, out, num_covered, covered_index, tok_base,
        splits, out.stride(0), out.stride(1),
        HEAD_DIM=out.shape[2], HEAD_DIM_PAD=d_pad,
        SPLITS_PAD=MAX_SPLITS, num_warps=4 if d_pad >= 128 else 2,
    )  # fmt: skip
    return out


def reduce_splits_ref(parts: SplitPartials, head_dim: int) -> torch.Tensor:  # [T_sub, Hq, D]
    """fp32; every token counts as covered."""
    w = torch.exp2(parts.row_max - parts.row_max.amax(-1, keepdim=True))  # [T_sub, Hq, S]
    denom = (w * parts.row_sum).sum(-1)
    out = (w[..., None] * parts.acc).sum(-2) / torch.where(denom > 0, denom, 1.0)[..., None]
    return out[..., :head_dim]
