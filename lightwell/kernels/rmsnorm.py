"""RMSNorm, and RMSNorm fused with the residual add before it (one read, one write per tensor).

Rounding follows HF Llama: the residual sum is rounded to the input dtype, the norm is taken in
fp32 from that rounded sum, the normalised value is rounded to the input dtype, then multiplied by
the weight and rounded once more.

``rmsnorm_quant`` writes the normalised rows quantized per row for a W8A8 linear (int8 or fp8,
kernels/act_quant.py's rounding) instead of the 16-bit rows, in one launch, the 16-bit rows never
written. Its rows are ``norm_row``'s, as the norm kernel computes them; compiled, its sum of
squares may add in another order than the norm kernel's, so the fp32 rstd can differ in the last
bit and a rare element by one ulp of the 16-bit dtype (the interpreter: the same bits).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lightwell import envs
from lightwell.kernels import act_quant as _aq
from lightwell.kernels import pdl as _pdl


@triton.jit
def norm_row(x, w, eps, HIDDEN: tl.constexpr):
    """One row's RMSNorm from x (the activation dtype, masked lanes 0; any shape, every
    element of it in the row) and w (fp32, x's shape): the normalised value rounded to x's
    dtype, times w, in fp32 (the caller rounds on store)."""
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(tl.reshape(xf * xf, [xf.numel]), 0) / HIDDEN + eps)
    return (xf * rstd).to(x.dtype).to(tl.float32) * w


@triton.jit
def _norm_program_row(
    x_ptr, res_ptr, w_ptr, res_out_ptr, stride_x, stride_res, stride_res_out, eps,
    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    """This program's row (after the PDL wait with GDC): the residual added and stored (with
    HAS_RESIDUAL), then ``norm_row`` in fp32; (row, offsets, mask, normalised row)."""
    if GDC:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_res_out + offs, x, mask=mask)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return row, offs, mask, norm_row(x, w, eps, HIDDEN)


@triton.jit
def _rmsnorm_kernel(
    x_ptr,  # [T, H]
    res_ptr,  # [T, H] (read only when HAS_RESIDUAL)
    w_ptr,  # [H]
    out_ptr,  # [T, H]
    res_out_ptr,  # [T, H] (written only when HAS_RESIDUAL)
    stride_x,
    stride_res,
    stride_out,
    stride_res_out,
    eps,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    GDC: tl.constexpr,  # launched with PDL (kernels/pdl.py): signal, then wait, before any access
):
    row, offs, mask, out = _norm_program_row(
        x_ptr, res_ptr, w_ptr, res_out_ptr, stride_x, stride_res, stride_res_out, eps,
        HIDDEN, BLOCK, HAS_RESIDUAL, GDC,
    )  # fmt: skip
    tl.store(out_ptr + row * stride_out + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rmsnorm_quant_kernel(
    x_ptr, res_ptr, w_ptr, q_ptr, s_ptr, static_ptr, res_out_ptr,
    stride_x, stride_res, stride_q, stride_res_out, eps,
    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    OUT_DTYPE: tl.constexpr,  # the 16/32-bit dtype the unfused norm would write
    QMAX: tl.constexpr, IS_INT8: tl.constexpr, STATIC: tl.constexpr,
    INTERPRET: tl.constexpr,  # under TRITON_INTERPRET=1 (act_quant's rounding steps)
    GDC: tl.constexpr,  # launched with PDL (kernels/pdl.py): signal, then wait, before any access
):  # fmt: skip
    row, offs, mask, out = _norm_program_row(
        x_ptr, res_ptr, w_ptr, res_out_ptr, stride_x, stride_res, stride_res_out, eps,
        HIDDEN, BLOCK, HAS_RESIDUAL, GDC,
    )  # fmt: skip
    y = out.to(OUT_DTYPE).to(tl.float32)  # the unfused norm's output
    if STATIC:
        scale = tl.load(static_ptr).to(tl.float32)
    else:
        top = tl.max(tl.abs(y), axis=0)
        scale = tl.where(top > 0, tl.math.div_rn(top, QMAX), 1.0)
    tl.store(s_ptr + row, scale)
    q = _aq._quantize(y, scale, QMAX, IS_INT8, STATIC, INTERPRET)
    tl.store(q_ptr + row * stride_q + offs, q, mask=mask)


def _launch(
    x: torch.Tensor,  # [T, H]
    residual: torch.Tensor | None,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    _check(x, residual, weight)
    num_tokens, hidden = x.shape
    out = torch.empty(x.shape, dtype=torch.result_type(x, weight), device=x.device)
    res_out = torch.empty_like(x) if residual is not None else None
    if num_tokens == 0:
        return out, res_out
    block = triton.next_power_of_2(hidden)
    res_in = residual if residual is not None else x
    res_o = res_out if res_out is not None else out
    gdc = _pdl.use_pdl(x.device)
    _rmsnorm_kernel[(num_tokens,)](
        x, res_in, weight, out, res_o,
        x.stride(0), res_in.stride(0), out.stride(0), res_o.stride(0), eps,
        HIDDEN=hidden, BLOCK=block, HAS_RESIDUAL=residual is not None, GDC=gdc,
        num_warps=min(16, max(1, block // 512)), **_pdl.launch_options(gdc),
    )  # fmt: skip
    return out, res_out


def rmsnorm(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
) -> torch.Tensor:  # [T, H]
    """``weight * (x / rms(x))``, fp32 inside."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rmsnorm(
    x: torch.Tensor,  # [T, H]
    residual: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, H] normed, [T, H] new residual)
    """``r = x + residual; return rmsnorm(r), r`` in one pass."""
    out, res_out = _launch(x, residual, weight, eps)
    assert res_out is not None
    return out, res_out


def rmsnorm_quant(
    x: torch.Tensor,  # [T, H]
    residual: torch.Tensor | None,  # [T, H], or None: no residual add
    weight: torch.Tensor,  # [H]
    eps: float,
    out_dtype: torch.dtype,  # torch.int8 or torch.float8_e4m3fn
    static_scale: torch.Tensor | None = None,  # one element, or None: dynamic per row
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``act_quant(rmsnorm(x + residual), out_dtype, static_scale)`` and the new residual
    (None without one) in one launch: ([T, H] out_dtype, [T, 1] float32, [T, H] | None); the
    norm as the module docstring says, then kernels/act_quant.py's quantization."""
    _check(x, residual, weight)
    if out_dtype not in (torch.float8_e4m3fn, torch.int8):
        raise ValueError(f"rmsnorm_quant: out_dtype must be fp8 e4m3 or int8, got {out_dtype}")
    num_tokens, hidden = x.shape
    q = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    scale = torch.empty((num_tokens, 1), dtype=torch.float32, device=x.device)
    res_out = torch.empty_like(x) if residual is not None else None
    if num_tokens == 0:
        return q, scale, res_out
    block = triton.next_power_of_2(hidden)
    res_in = residual if residual is not None else x
    res_o = res_out if res_out is not None else x
    static = static_scale.reshape(1).float() if static_scale is not None else scale
    is_int8 = out_dtype == torch.int8
    gdc = _pdl.use_pdl(x.device)
    _rmsnorm_quant_kernel[(num_tokens,)](
        x, res_in, weight, q, scale, static, res_o,
        x.stride(0), res_in.stride(0), q.stride(0), res_o.stride(0), eps,
        HIDDEN=hidden, BLOCK=block, HAS_RESIDUAL=residual is not None,
        OUT_DTYPE=_TL_DTYPES[torch.result_type(x, weight)],
        QMAX=_aq.INT8_MAX if is_int8 else _aq.FP8_MAX, IS_INT8=is_int8,
        STATIC=static_scale is not None, INTERPRET=envs.triton_interpret(), GDC=gdc,
        num_warps=min(16, max(1, block // 512)), **_pdl.launch_options(gdc),
    )  # fmt: skip
    return q, scale, res_out


_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def rmsnorm_ref(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
) -> torch.Tensor:  # [T, H]
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def fused_add_rmsnorm_ref(
    x: torch.Tensor,  # [T, H]
    residual: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, H], [T, H])
    r = x + residual
    return rmsnorm_ref(r, weight, eps), r


def _check(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor) -> None:
    if x.dim() != 2 or weight.shape != (x.shape[1],):
        raise ValueError(
            f"want x [T, H] and weight [H]; got {tuple(x.shape)}, {tuple(weight.shape)}"
        )
    if x.stride(1) != 1 or weight.stride(0) != 1:
        raise ValueError("x and weight need a contiguous last dim")
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(1) != 1:
            raise ValueError(f"residual must be like x {tuple(x.shape)} {x.dtype}")
