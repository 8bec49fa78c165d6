"""RMSNorm (optionally with its residual add) and SiLU-and-mul that write their output as a
W8A8 linear's input: 8-bit values (fp8 e4m3 or int8) and a per-token scale (dynamic, or one
static scale), in one launch instead of the op then ``act_quant``.

Bit for bit the unfused pair: each kernel computes its value as its unfused kernel does
(``norm_row`` of kernels/rmsnorm.py; ``silu_mul`` of kernels/activation.py), rounds it to the
dtype that kernel stores, then quantizes it with act_quant.py's ``row_scale`` and
``quantize_values``. RMSNorm holds its row in registers (one pass); SiLU-and-mul walks the row
twice in ``BLOCK`` chunks (the amax, then the values, recomputed: the same operations on the same
inputs). The torch references are the unfused references composed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lightwell import envs
from lightwell.kernels import pdl as _pdl
from lightwell.kernels.act_quant import FP8_MAX, INT8_MAX, act_quant_ref, quantize_values, row_scale
from lightwell.kernels.activation import silu_and_mul_ref, silu_mul
from lightwell.kernels.rmsnorm import check_args, fused_add_rmsnorm_ref, norm_row, rmsnorm_ref


@triton.jit
def _rmsnorm_quant_kernel(
    x_ptr, res_ptr, w_ptr, q_ptr, s_ptr, static_ptr, res_out_ptr,
    stride_x, stride_res, stride_q, stride_res_out, eps,
    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, ROUND: tl.constexpr,
    QMAX: tl.constexpr, IS_INT8: tl.constexpr, STATIC: tl.constexpr, INTERPRET: tl.constexpr,
    GDC: tl.constexpr,  # launched with PDL (kernels/pdl.py): signal, then wait, before any access
):  # fmt: skip
    # x, res, res_out: [T, H]; w: [H]; q: [T, H] int8/fp8; s: [T] float32; static: [1]
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
    y = norm_row(x, w, eps, HIDDEN)
    if ROUND:  # the unfused kernel stores x's dtype (else fp32: nothing to round)
        y = y.to(x_ptr.dtype.element_ty).to(tl.float32)
    if STATIC:
        scale = tl.load(static_ptr).to(tl.float32)
    else:
        scale = row_scale(tl.max(tl.abs(y), axis=0), QMAX)  # masked lanes are 0
    tl.store(s_ptr + row, scale)
    q = quantize_values(y, scale, QMAX, IS_INT8, INTERPRET)
    tl.store(q_ptr + row * stride_q + offs, q, mask=mask)


@triton.jit
def _silu_block(x_ptr, row_off, offs, INTER: tl.constexpr):
    """``silu(gate) * up`` at columns ``offs`` of one row, rounded to x's dtype, in fp32."""
    mask = offs < INTER
    gate = tl.load(x_ptr + row_off + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row_off + INTER + offs, mask=mask, other=0.0).to(tl.float32)
    return silu_mul(gate, up).to(x_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _silu_mul_quant_kernel(
    x_ptr, q_ptr, s_ptr, static_ptr, stride_x, stride_q,
    INTER: tl.constexpr, BLOCK: tl.constexpr,
    QMAX: tl.constexpr, IS_INT8: tl.constexpr, STATIC: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    # x: [T, 2 * I]; q: [T, I] int8/fp8; s: [T] float32; static: [1]
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    row_off = row * stride_x
    if STATIC:
        scale = tl.load(static_ptr).to(tl.float32)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for k0 in range(0, INTER, BLOCK):
            amax = tl.maximum(amax, tl.abs(_silu_block(x_ptr, row_off, k0 + cols, INTER)))
        scale = row_scale(tl.max(amax, axis=0), QMAX)
    tl.store(s_ptr + row, scale)
    for k0 in range(0, INTER, BLOCK):
        y = _silu_block(x_ptr, row_off, k0 + cols, INTER)
        q = quantize_values(y, scale, QMAX, IS_INT8, INTERPRET)
        tl.store(q_ptr + row * stride_q + k0 + cols, q, mask=k0 + cols < INTER)


def _check_quant(out_dtype: torch.dtype, static_scale: torch.Tensor | None) -> None:
    if out_dtype not in (torch.float8_e4m3fn, torch.int8):
        raise ValueError(f"out_dtype must be float8_e4m3fn or int8, got {out_dtype}")
    if static_scale is not None and static_scale.numel() != 1:
        raise ValueError(f"static scale must have one element, got {tuple(static_scale.shape)}")


def _quant_args(out_dtype: torch.dtype, static_scale: torch.Tensor | None, scale: torch.Tensor):
    """(static scale pointer, constexprs) of a quantizing launch."""
    is_int8 = out_dtype == torch.int8
    static = scale if static_scale is None else static_scale.reshape(1).float()
    consts = dict(
        QMAX=INT8_MAX if is_int8 else FP8_MAX, IS_INT8=is_int8, STATIC=static_scale is not None,
        INTERPRET=envs.triton_interpret(),
    )  # fmt: skip
    return static, consts


def rmsnorm_quant(
    x: torch.Tensor,  # [T, H]
    residual: torch.Tensor | None,  # [T, H], or None: no residual add
    weight: torch.Tensor,  # [H]
    eps: float,
    out_dtype: torch.dtype,  # torch.float8_e4m3fn or torch.int8
    static_scale: torch.Tensor | None = None,  # one element, or None: dynamic per row
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(``q`` [T, H] out_dtype, ``scale`` [T, 1] float32, new residual [T, H] or None): the
    RMSNorm of ``x (+ residual)`` quantized per token, as ``act_quant(rmsnorm(...))``."""
    check_args(x, residual, weight)
    _check_quant(out_dtype, static_scale)
    num_tokens, hidden = x.shape
    q = torch.empty((num_tokens, hidden), dtype=out_dtype, device=x.device)
    scale = torch.empty((num_tokens, 1), dtype=torch.float32, device=x.device)
    res_out = torch.empty_like(x) if residual is not None else None
    if num_tokens == 0:
        return q, scale, res_out
    block = triton.next_power_of_2(hidden)
    res_in = residual if residual is not None else x
    res_o = res_out if res_out is not None else x  # never written without a residual
    static, consts = _quant_args(out_dtype, static_scale, scale)
    rounded = torch.result_type(x, weight) == x.dtype and x.dtype != torch.float32
    gdc = _pdl.use_pdl(x.device)
    _rmsnorm_quant_kernel[(num_tokens,)](
        x, res_in, weight, q, scale, static, res_o,
        x.stride(0), res_in.stride(0), q.stride(0), res_o.stride(0), eps,
        HIDDEN=hidden, BLOCK=block, HAS_RESIDUAL=residual is not None, ROUND=rounded, GDC=gdc,
        num_warps=min(16, max(1, block // 512)), **consts, **_pdl.launch_options(gdc),
    )  # fmt: skip
    return q, scale, res_out


def silu_and_mul_quant(
    x: torch.Tensor,  # [T, 2 * I]
    out_dtype: torch.dtype,  # torch.float8_e4m3fn or torch.int8
    static_scale: torch.Tensor | None = None,  # one element, or None: dynamic per row
    block: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, I] out_dtype, [T, 1] float32)
    """``act_quant(silu_and_mul(x))`` in one launch."""
    if x.dim() != 2 or x.shape[1] % 2 or x.stride(1) != 1:
        raise ValueError(f"want x [T, 2*I] with a contiguous last dim; got {tuple(x.shape)}")
    _check_quant(out_dtype, static_scale)
    num_tokens, inter = x.shape[0], x.shape[1] // 2
    q = torch.empty((num_tokens, inter), dtype=out_dtype, device=x.device)
    scale = torch.empty((num_tokens, 1), dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return q, scale
    static, consts = _quant_args(out_dtype, static_scale, scale)
    block = max(16, min(block, triton.next_power_of_2(inter)))
    _silu_mul_quant_kernel[(num_tokens,)](
        x, q, scale, static, x.stride(0), q.stride(0), INTER=inter, BLOCK=block, **consts,
        num_warps=4 if block >= 512 else 1,
    )  # fmt: skip
    return q, scale


def rmsnorm_quant_ref(
    x: torch.Tensor,  # [T, H]
    residual: torch.Tensor | None,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    out_dtype: torch.dtype,
    static_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # ([T, H], [T, 1], [T, H] | None)
    """The unfused torch references composed."""
    if residual is None:
        normed, res_out = rmsnorm_ref(x, weight, eps), None
    else:
        normed, res_out = fused_add_rmsnorm_ref(x, residual, weight, eps)
    return (*act_quant_ref(normed, out_dtype, static_scale), res_out)


def silu_and_mul_quant_ref(
    x: torch.Tensor,  # [T, 2 * I]
    out_dtype: torch.dtype,
    static_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, I], [T, 1])
    return act_quant_ref(silu_and_mul_ref(x), out_dtype, static_scale)
