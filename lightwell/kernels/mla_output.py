"""MLA decode's output through ``W_UV``: the latent output ``[T, H, L]`` becomes ``[T, H * V]``,
``o @ W_UV^T`` per head, ``W_UV`` read in place from ``kv_b_proj``'s weight ``[H * (N + V), L]``.

Up to ``FEW_TOKENS`` tokens (batch-1 decode): grid (heads, 16-wide value chunks); each
program loads its whole ``[16, L]`` slice of ``W_UV`` (no kernel's output) before its PDL wait,
so the slice streams while the attention finishes, then per token multiplies on the CUDA cores
in fp32. It may instead take the split-KV decode's partial outputs and log-sum-exps and combine
them as it reads them (every program of a head repeats its head's combine: a few KB from L2),
which saves the combine's launch. More tokens: tl.dot on 16- or 64-token tiles, grid (heads,
token tiles, 32-wide value chunks), the first weight chunk loaded before the wait.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lightwell.kernels import pdl as _pdl
from lightwell.kernels.mla_decode import combine_splits
from lightwell.kernels.pdl_sync import wait_then_signal

BLOCK_V = 32  # value dims a program
BLOCK_R = 128  # latent values a step of the product
FEW_TOKENS = 1  # up to this many tokens: _absorb_few_kernel
FEW_BLOCK_V = 16  # value dims a program of _absorb_few_kernel


# (per-step integers are not specialised: no variant compiles in the middle of serving)
@triton.jit(do_not_specialize=["T"])
def _absorb_output_kernel(
    o_ptr,  # [T, H, L]
    w_ptr,  # [H * (N + V), L]
    out_ptr,  # [T, H * V]
    T,
    stride_ot,
    stride_oh,
    stride_y,
    NOPE: tl.constexpr,
    VDIM: tl.constexpr,
    LATENT: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PREC: tl.constexpr,
    GDC: tl.constexpr,  # launched with PDL: the first weight chunk loads before the wait
):
    h, tile, chunk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < T
    v = chunk * BLOCK_V + tl.arange(0, BLOCK_V)
    v_ok = v < VDIM
    o_rows = o_ptr + t.to(tl.int64)[:, None] * stride_ot + h * stride_oh
    w_head = w_ptr + (h * (NOPE + VDIM) + NOPE) * LATENT
    acc = tl.zeros((BLOCK_T, BLOCK_V), tl.float32)
    # W_UV is no kernel's output: its first chunk streams while the kernel before finishes
    r = tl.arange(0, BLOCK_R)
    w_first = tl.load(w_head + v[:, None] * LATENT + r[None, :],
                      mask=v_ok[:, None] & (r < LATENT)[None, :], other=0.0)  # fmt: skip
    wait_then_signal(GDC)
    for r0 in tl.static_range(0, LATENT, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        r_ok = r < LATENT
        o = tl.load(o_rows + r[None, :], mask=t_ok[:, None] & r_ok[None, :], other=0.0)
        if r0 == 0:
            w = w_first
        else:
            w_ok = v_ok[:, None] & r_ok[None, :]
            w = tl.load(w_head + v[:, None] * LATENT + r[None, :], mask=w_ok, other=0.0)
        acc = tl.dot(o, tl.trans(w), acc, input_precision=PREC)  # [BT, BV]
    y = out_ptr + t.to(tl.int64)[:, None] * stride_y + h * VDIM + v[None, :]
    tl.store(y, acc.to(out_ptr.dtype.element_ty), mask=t_ok[:, None] & v_ok[None, :])


@triton.jit(do_not_specialize=["T", "num_splits"])
def _absorb_few_kernel(
    o_ptr,  # [T, H, L]; COMBINE: [T, S, H, L] float32, the decode splits' partial outputs
    lse_ptr,  # COMBINE: [T, S, H] float32, their log-sum-exps (-inf: an empty split)
    w_ptr,  # [H * (N + V), L]
    out_ptr,  # [T, H * V]
    T,
    num_splits,
    stride_ot,
    stride_oh,
    stride_y,
    NOPE: tl.constexpr,
    VDIM: tl.constexpr,
    LATENT: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_V: tl.constexpr,
    COMBINE: tl.constexpr,
    BLOCK_SPLITS: tl.constexpr,
    GDC: tl.constexpr,  # launched with PDL: the W_UV slice loads before the wait
):
    h, chunk = tl.program_id(0), tl.program_id(1)
    v = chunk * BLOCK_V + tl.arange(0, BLOCK_V)
    v_ok = v < VDIM
    r = tl.arange(0, BLOCK_L)
    r_ok = r < LATENT
    w_rows = w_ptr + (h * (NOPE + VDIM) + NOPE + v)[:, None] * LATENT
    w = tl.load(w_rows + r[None, :], mask=v_ok[:, None] & r_ok[None, :], other=0.0)
    wait_then_signal(GDC)
    w = w.to(tl.float32)
    for t in range(T):
        if COMBINE:  # the decode's combine (a program row per head)
            o = combine_splits(o_ptr, lse_ptr, t, h, tl.num_programs(0), num_splits, r, LATENT,
                               BLOCK_SPLITS)  # fmt: skip
        else:
            o = tl.load(o_ptr + t * stride_ot + h * stride_oh + r, mask=r_ok, other=0.0)
        y = tl.sum(w * o.to(tl.float32)[None, :], axis=1)  # [BV]
        tl.store(out_ptr + t * stride_y + h * VDIM + v, y.to(out_ptr.dtype.element_ty), mask=v_ok)


def absorb_output(
    o: torch.Tensor,  # [T, H, L] (rows contiguous in L); with lse: [T, S, H, L] float32
    kv_b_weight: torch.Tensor,  # [H * (N + V), L]
    dims: tuple[int, int],  # (N, V)
    lse: torch.Tensor | None = None,  # [T, S, H] float32
) -> torch.Tensor:  # [T, H * V] in o's dtype; with lse, in the weight's
    """With ``lse``, ``o`` holds the split-KV decode's partial outputs
    (kernels/mla_decode.py's ``mla_decode_split``), combined as they are read: up to
    ``FEW_TOKENS`` tokens only."""
    nope, vdim = dims
    if lse is not None:
        num_tokens, num_splits, heads, latent = o.shape
        if lse.shape != (num_tokens, num_splits, heads) or not 0 < num_tokens <= FEW_TOKENS:
            raise ValueError(f"absorb_output: partials {tuple(o.shape)}, lse {tuple(lse.shape)}")
        if not (o.is_contiguous() and lse.is_contiguous()):
            raise ValueError("absorb_output: partials and lse must be contiguous")
    else:
        (num_tokens, heads, latent), num_splits = o.shape, 1
    if o.stride(-1) != 1 or kv_b_weight.shape != (heads * (nope + vdim), latent):
        raise ValueError(f"absorb_output: o {tuple(o.shape)} does not fit kv_b_proj's weight")
    out = o.new_empty(num_tokens, heads * vdim, dtype=o.dtype if lse is None else kv_b_weight.dtype)
    if lse is not None or 0 < num_tokens <= FEW_TOKENS:
        _absorb_few_kernel[(heads, triton.cdiv(vdim, FEW_BLOCK_V))](
            o, o if lse is None else lse, kv_b_weight, out, num_tokens, num_splits,
            o.stride(0), o.stride(-2), out.stride(0), NOPE=nope, VDIM=vdim, LATENT=latent,
            BLOCK_L=max(16, triton.next_power_of_2(latent)), BLOCK_V=FEW_BLOCK_V,
            COMBINE=lse is not None, BLOCK_SPLITS=triton.next_power_of_2(num_splits),
            num_warps=4, **_pdl.kernel_args(o.device),
        )  # fmt: skip
    elif num_tokens:
        block_v = min(BLOCK_V, max(16, triton.next_power_of_2(vdim)))
        block_t = 16 if num_tokens <= 16 else 64
        grid = (heads, triton.cdiv(num_tokens, block_t), triton.cdiv(vdim, block_v))
        _absorb_output_kernel[grid](
            o, kv_b_weight, out, num_tokens, o.stride(0), o.stride(1), out.stride(0),
            NOPE=nope, VDIM=vdim, LATENT=latent, BLOCK_V=block_v, BLOCK_T=block_t,
            BLOCK_R=min(BLOCK_R, max(16, triton.next_power_of_2(latent))),
            PREC="ieee" if out.dtype == torch.float32 else "tf32",
            **_pdl.kernel_args(o.device),
        )  # fmt: skip
    return out
