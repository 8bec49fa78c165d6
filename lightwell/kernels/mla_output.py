"""MLA decode's output through ``W_UV``: the latent output ``[T, H, L]`` becomes ``[T, H * V]``,
``o @ W_UV^T`` per head (tl.dot on 16- or 64-token tiles; grid (heads, token tiles, 32-wide
value chunks)), ``W_UV`` read in place from ``kv_b_proj``'s weight ``[H * (N + V), L]``.

Given the split-KV decode's partials instead (kernels/mla_decode.py's ``mla_decode_partials``:
``[T, S, H, L]`` float32 with log-sum-exps ``[T, S, H]``), each program first combines its
tokens' rows of its head, as ``_combine_kernel`` does (splits weighted by ``exp(lse - max)``,
empty ones by 0, divided by the weights' sum), rounds them to the weight's dtype and goes on:
one launch fewer a decode step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lightwell.kernels import pdl as _pdl
from lightwell.kernels.pdl_sync import wait_then_signal

BLOCK_V = 32  # value dims a program
BLOCK_R = 128  # latent values a step of the product


# (per-step integers are not specialised: no variant compiles in the middle of serving)
@triton.jit(do_not_specialize=["T", "num_splits"])
def _absorb_output_kernel(
    o_ptr,  # [T, H, L]; SPLITS: [T, S, H, L] float32 partials
    lse_ptr,  # SPLITS: [T, S, H] float32 log-sum-exps (else unread)
    w_ptr,  # [H * (N + V), L]
    out_ptr,  # [T, H * V]
    T,
    stride_ot,
    stride_oh,
    stride_y,
    num_splits,
    NOPE: tl.constexpr,
    VDIM: tl.constexpr,
    LATENT: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    SPLITS: tl.constexpr,  # o holds split partials to combine
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
    if SPLITS:
        top, total = _split_weights(lse_ptr, t, t_ok, h, num_splits)
    for r0 in tl.static_range(0, LATENT, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        r_ok = r < LATENT
        if SPLITS:
            o = _combined(o_ptr, lse_ptr, t, t_ok, h, num_splits, top, total, r, r_ok, LATENT)
            o = o.to(w_first.dtype)
        else:
            o = tl.load(o_rows + r[None, :], mask=t_ok[:, None] & r_ok[None, :], other=0.0)
        if r0 == 0:
            w = w_first
        else:
            w_ok = v_ok[:, None] & r_ok[None, :]
            w = tl.load(w_head + v[:, None] * LATENT + r[None, :], mask=w_ok, other=0.0)
        acc = tl.dot(o, tl.trans(w), acc, input_precision=PREC)  # [BT, BV]
    y = out_ptr + t.to(tl.int64)[:, None] * stride_y + h * VDIM + v[None, :]
    tl.store(y, acc.to(out_ptr.dtype.element_ty), mask=t_ok[:, None] & v_ok[None, :])


@triton.jit
def _split_weights(lse_ptr, t, t_ok, h, num_splits):
    """([BT] the largest live log-sum-exp of each token's splits for head h (-1e30 if none),
    [BT] the sum of the splits' weights ``exp(lse - top)``, 1 if none is live)."""
    heads = tl.num_programs(0)
    top = tl.full(t.shape, -1e30, tl.float32)
    for s in range(num_splits):
        lse = tl.load(lse_ptr + (t * num_splits + s) * heads + h, mask=t_ok, other=float("-inf"))
        top = tl.maximum(top, tl.where(lse > float("-inf"), lse, -1e30))
    total = tl.zeros(t.shape, tl.float32)
    for s in range(num_splits):
        lse = tl.load(lse_ptr + (t * num_splits + s) * heads + h, mask=t_ok, other=float("-inf"))
        total += tl.where(lse > float("-inf"), tl.exp(lse - top), 0.0)
    return top, tl.where(total > 0, total, 1.0)


@triton.jit
def _combined(o_ptr, lse_ptr, t, t_ok, h, num_splits, top, total, r, r_ok, LATENT: tl.constexpr):
    """[BT, BR]: latent values r of head h's output for tokens t, from the split partials."""
    heads = tl.num_programs(0)
    acc = tl.zeros((t.shape[0], r.shape[0]), tl.float32)
    for s in range(num_splits):
        row = (t * num_splits + s) * heads + h  # [BT]
        lse = tl.load(lse_ptr + row, mask=t_ok, other=float("-inf"))
        live = lse > float("-inf")  # empty splits weigh nothing (and are not read)
        weight = tl.where(live, tl.exp(lse - top), 0.0)
        part = tl.load(o_ptr + row.to(tl.int64)[:, None] * LATENT + r[None, :],
                       mask=live[:, None] & r_ok[None, :], other=0.0)  # fmt: skip
        acc += part * weight[:, None]
    return acc / total[:, None]


def absorb_output(
    o: torch.Tensor,  # [T, H, L] (rows contiguous in L); with lse: [T, S, H, L] float32 partials
    kv_b_weight: torch.Tensor,  # [H * (N + V), L]
    dims: tuple[int, int],  # (N, V)
    lse: torch.Tensor | None = None,  # [T, S, H] float32: o holds S split partials to combine
) -> torch.Tensor:  # [T, H * V] in o.dtype (with partials: the weight's dtype)
    nope, vdim = dims
    if lse is None:
        num_tokens, heads, latent = o.shape
        splits, dtype = 1, o.dtype
    else:
        num_tokens, splits, heads, latent = o.shape
        dtype = kv_b_weight.dtype
        if lse.shape != (num_tokens, splits, heads) or not (
            o.is_contiguous() and lse.is_contiguous()
        ):
            raise ValueError(f"absorb_output: partials {tuple(o.shape)}, lse {tuple(lse.shape)}")
    if o.stride(-1) != 1 or kv_b_weight.shape != (heads * (nope + vdim), latent):
        raise ValueError(f"absorb_output: o {tuple(o.shape)} does not fit kv_b_proj's weight")
    out = torch.empty(num_tokens, heads * vdim, dtype=dtype, device=o.device)
    if num_tokens:
        block_v = min(BLOCK_V, max(16, triton.next_power_of_2(vdim)))
        block_t = 16 if num_tokens <= 16 else 64
        grid = (heads, triton.cdiv(num_tokens, block_t), triton.cdiv(vdim, block_v))
        _absorb_output_kernel[grid](
            o, o if lse is None else lse, kv_b_weight, out, num_tokens, o.stride(0),
            o.stride(-2), out.stride(0), splits, NOPE=nope, VDIM=vdim, LATENT=latent,
            BLOCK_V=block_v, BLOCK_T=block_t,
            BLOCK_R=min(BLOCK_R, max(16, triton.next_power_of_2(latent))),
            SPLITS=lse is not None, PREC="ieee" if out.dtype == torch.float32 else "tf32",
            **_pdl.kernel_args(o.device),
        )  # fmt: skip
    return out
