"""MLA decode's output through ``W_UV``: the latent output ``[T, H, L]`` becomes ``[T, H * V]``,
``o @ W_UV^T`` per head (tl.dot on 16- or 64-token tiles; grid (heads, token tiles, 32-wide
value chunks)), ``W_UV`` read in place from ``kv_b_proj``'s weight ``[H * (N + V), L]``.

``absorb_output_splits`` takes the split-KV partials of kernels/mla_decode.py instead of ``o``
(``[T, S, H, L]`` fp32 and their log-sum-exps ``[T, S, H]``) and combines them where it loads
them, as ``_combine_kernel`` would (splits weighted by ``exp(lse - max)``, empty ones by 0, the
sum rounded to the model dtype before the product): the combine's launch folded into this one,
for steps of up to ``SPLITS_MAX_TOKENS`` tokens.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 32  # value dims a program
BLOCK_R = 128  # latent values a step of the product
# Steps of up to this many tokens (one token tile) fold the combine in; each output program
# recombines its head's partials, so larger steps combine once first (kernels/mla_decode.py).
SPLITS_MAX_TOKENS = 16


@triton.jit
def _split_weights(lse_ptr, rows, t_ok, num_splits, num_heads, BLOCK_T: tl.constexpr):
    """Each token's largest log-sum-exp over its splits and the splits' total weight."""
    top = tl.full((BLOCK_T,), -1e30, tl.float32)
    for s in range(num_splits):
        lse = tl.load(lse_ptr + rows + s * num_heads, mask=t_ok, other=float("-inf"))
        top = tl.maximum(top, tl.where(lse > float("-inf"), lse, -1e30))
    total = tl.zeros((BLOCK_T,), tl.float32)
    for s in range(num_splits):
        lse = tl.load(lse_ptr + rows + s * num_heads, mask=t_ok, other=float("-inf"))
        total += tl.where(lse > float("-inf"), tl.exp(lse - top), 0.0)
    return top, tl.where(total > 0, total, 1.0)


@triton.jit
def _combined(part_ptr, lse_ptr, rows, t_ok, r, r_ok, top, total, num_splits, num_heads,
              LATENT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr):  # fmt: skip
    """The combined output [BT, BR] (fp32) of latent values ``r`` from the splits' partials."""
    acc = tl.zeros((BLOCK_T, BLOCK_R), tl.float32)
    for s in range(num_splits):
        row = rows + s * num_heads  # [BT]
        lse = tl.load(lse_ptr + row, mask=t_ok, other=float("-inf"))
        live = lse > float("-inf")
        w = tl.where(live, tl.exp(lse - top), 0.0)
        part = tl.load(part_ptr + row.to(tl.int64)[:, None] * LATENT + r[None, :],
                       mask=live[:, None] & r_ok[None, :], other=0.0)  # fmt: skip
        acc += part * w[:, None]
    return acc / total[:, None]


# (per-step integers are not specialised: no variant compiles in the middle of serving)
@triton.jit(do_not_specialize=["T", "num_splits", "num_heads"])
def _absorb_output_kernel(
    o_ptr,  # [T, H, L] (not SPLIT)
    part_ptr,  # [T, S, H, L] fp32 partials (SPLIT)
    lse_ptr,  # [T, S, H] fp32 (SPLIT)
    w_ptr,  # [H * (N + V), L]
    out_ptr,  # [T, H * V]
    T,
    num_splits,
    num_heads,
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
    SPLIT: tl.constexpr,
):
    h, tile, chunk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < T
    v = chunk * BLOCK_V + tl.arange(0, BLOCK_V)
    v_ok = v < VDIM
    o_rows = o_ptr + t.to(tl.int64)[:, None] * stride_ot + h * stride_oh
    rows = t * num_splits * num_heads + h  # [BT] split 0's partial row
    if SPLIT:
        top, total = _split_weights(lse_ptr, rows, t_ok, num_splits, num_heads, BLOCK_T)
    w_head = w_ptr + (h * (NOPE + VDIM) + NOPE) * LATENT
    acc = tl.zeros((BLOCK_T, BLOCK_V), tl.float32)
    for r0 in tl.static_range(0, LATENT, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        r_ok = r < LATENT
        if SPLIT:
            o = _combined(part_ptr, lse_ptr, rows, t_ok, r, r_ok, top, total, num_splits,
                          num_heads, LATENT, BLOCK_T, BLOCK_R)  # fmt: skip
            o = o.to(out_ptr.dtype.element_ty)  # the combine's rounding
        else:
            o = tl.load(o_rows + r[None, :], mask=t_ok[:, None] & r_ok[None, :], other=0.0)
        w_ok = v_ok[:, None] & r_ok[None, :]
        w = tl.load(w_head + v[:, None] * LATENT + r[None, :], mask=w_ok, other=0.0)  # [BV, BR]
        acc = tl.dot(o, tl.trans(w), acc, input_precision=PREC)  # [BT, BV]
    y = out_ptr + t.to(tl.int64)[:, None] * stride_y + h * VDIM + v[None, :]
    tl.store(y, acc.to(out_ptr.dtype.element_ty), mask=t_ok[:, None] & v_ok[None, :])


def _launch(o, part, lse, kv_b_weight, out, dims, heads, splits, strides) -> torch.Tensor:
    nope, vdim = dims
    num_tokens, latent = out.shape[0], kv_b_weight.shape[1]
    if num_tokens:
        block_v = min(BLOCK_V, max(16, triton.next_power_of_2(vdim)))
        block_t = 16 if num_tokens <= 16 else 64
        grid = (heads, triton.cdiv(num_tokens, block_t), triton.cdiv(vdim, block_v))
        _absorb_output_kernel[grid](
            o, part, lse, kv_b_weight, out, num_tokens, splits, heads, *strides, out.stride(0),
            NOPE=nope, VDIM=vdim, LATENT=latent, BLOCK_V=block_v, BLOCK_T=block_t,
            BLOCK_R=min(BLOCK_R, max(16, triton.next_power_of_2(latent))),
            PREC="ieee" if out.dtype == torch.float32 else "tf32", SPLIT=part is not None,
        )  # fmt: skip
    return out


def absorb_output(
    o: torch.Tensor,  # [T, H, L] (rows contiguous in L)
    kv_b_weight: torch.Tensor,  # [H * (N + V), L]
    dims: tuple[int, int],  # (N, V)
) -> torch.Tensor:  # [T, H * V]
    nope, vdim = dims
    num_tokens, heads, latent = o.shape
    if o.stride(2) != 1 or kv_b_weight.shape != (heads * (nope + vdim), latent):
        raise ValueError(f"absorb_output: o {tuple(o.shape)} does not fit kv_b_proj's weight")
    out = o.new_empty(num_tokens, heads * vdim)
    return _launch(o, None, None, kv_b_weight, out, dims, heads, 1, (o.stride(0), o.stride(1)))


def absorb_output_splits(
    part: torch.Tensor,  # [T, S, H, L] fp32 split partials (kernels/mla_decode.py)
    lse: torch.Tensor,  # [T, S, H] fp32 their log-sum-exps
    kv_b_weight: torch.Tensor,  # [H * (N + V), L]
    dims: tuple[int, int],  # (N, V)
) -> torch.Tensor:  # [T, H * V] in kv_b_weight's dtype
    """``absorb_output`` of the combined partials, the combine inside the same launch."""
    nope, vdim = dims
    num_tokens, splits, heads, latent = part.shape
    fits = kv_b_weight.shape == (heads * (nope + vdim), latent) and lse.shape == part.shape[:3]
    if not (fits and part.is_contiguous() and lse.is_contiguous()):
        raise ValueError(f"absorb_output: partials {tuple(part.shape)} do not fit kv_b_proj")
    if num_tokens > SPLITS_MAX_TOKENS:
        raise ValueError(f"absorb_output: {num_tokens} tokens' partials (> {SPLITS_MAX_TOKENS})")
    out = kv_b_weight.new_empty(num_tokens, heads * vdim)
    return _launch(kv_b_weight, part, lse, kv_b_weight, out, dims, heads, splits, (0, 0))
