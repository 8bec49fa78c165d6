"""Per-token (row) activation quantization in one launch: fp8 e4m3 or int8, dynamic or static.

One program per row: the amax of ``|x|`` (dynamic), then ``q = x / scale`` saturated (fp8: to
+-448; int8: rounded to nearest even, clamped to [-128, 127]). A row of up to ``block`` (16,384)
inputs is read once and kept in registers; a longer one is walked twice in ``block`` chunks.
Dynamic ``scale = amax / QMAX`` (1 for an all-zero row); static: the given scalar. With
``silu_mul`` the row is a gated MLP's ``[gate | up]`` and what is quantized is
``silu(gate) * up`` rounded to x's dtype, computed as kernels/activation.py computes it (the
W8A8 down projection's input: the 16-bit activation is never written).
``q`` and ``scale`` equal the torch references (``quantize_fp8`` in quant/fp8.py,
``quantize_activations`` in quant/int8.py) bit for bit, on CPU and on CUDA, because every step is
exactly rounded on both sides:

- ``amax / QMAX`` is ``tl.math.div_rn`` (PTX ``div.rn.f32``; Triton's ``/`` is the approximate
  ``div.full.f32``), and the references divide by a tensor: torch's CUDA ``tensor / python
  scalar`` multiplies by the rounded reciprocal instead, which differs in the last bit for about
  half of the fp32 values divided by 448 (5% for 127);
- int8 with a dynamic scale divides by Markstein's correction of the product by the
  reciprocal: ``inv = div_rn(1, scale)``, ``q = x * inv``, ``r = fma(-q, scale, x)`` (exact),
  ``fma(r, inv, q)``, the correctly rounded quotient when ``inv`` is the correctly rounded
  reciprocal and nothing overflows or underflows; a scale outside [2**-60, 2**60] and its row
  are first multiplied by 2**64 or 2**-64 (exact; |x / scale| <= 127, and inputs that the
  scaling would make subnormal have quotients that round to zero). Two FMAs and a product an
  element instead of ``div.rn.f32``'s sequence and range check. fp8 and static scales use
  ``div_rn``: the corrected product turns -0 into +0, which fp8 keeps (int8 has one zero).
  Outside the claim: an fp32 row whose amax is below 127 * 2**-149 gets a scale of 0 (its
  values multiply that 0 whatever they quantize to); 16-bit inputs cannot get there;
- the amax is a max of exact values; the clamps are exact;
- int8 rounds half to even with ``cvt.rni.f32.f32`` (libdevice ``rint``, as ``torch.round``),
  the interpreter with the add-and-subtract of 1.5 * 2**23 (no product, nothing to contract);
- fp8 is the hardware's round-to-nearest-even conversion (``cvt.rn.satfinite.e4m3x2.f32``, as
  torch's ``.to(float8_e4m3fn)``); the interpreter, whose conversion does not round so, first
  rounds to the e4m3 grid in fp32 (products by powers of two only: exact, even when fused).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra import libdevice

from lightwell import envs

FP8_MAX = 448.0
INT8_MAX = 127.0


@triton.jit
def _act_quant_kernel(
    x_ptr, q_ptr, s_ptr, static_ptr, K, stride_x, stride_q,
    QMAX: tl.constexpr, IS_INT8: tl.constexpr, STATIC: tl.constexpr, BLOCK: tl.constexpr,
    ONE_PASS: tl.constexpr,  # the row fits one BLOCK: read once, kept in registers
    SILU_MUL: tl.constexpr,  # x rows are [gate | up] (2K wide): quantize silu(gate) * up
    INTERPRET: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    x_row = x_ptr + row * stride_x
    q_row = q_ptr + row * stride_q
    if STATIC:
        scale = tl.load(static_ptr).to(tl.float32)
    if ONE_PASS:
        mask = cols < K
        x = _load_row(x_row, cols, mask, K, SILU_MUL)
        if not STATIC:
            top = tl.max(tl.abs(x), axis=0)
            scale = tl.where(top > 0, tl.math.div_rn(top, QMAX), 1.0)
        tl.store(s_ptr + row, scale)
        tl.store(q_row + cols, _quantize(x, scale, QMAX, IS_INT8, STATIC, INTERPRET), mask=mask)
    else:
        if not STATIC:
            amax = tl.zeros([BLOCK], dtype=tl.float32)
            for k0 in range(0, K, BLOCK):
                x = _load_row(x_row, k0 + cols, k0 + cols < K, K, SILU_MUL)
                amax = tl.maximum(amax, tl.abs(x))
            top = tl.max(amax, axis=0)
            scale = tl.where(top > 0, tl.math.div_rn(top, QMAX), 1.0)
        tl.store(s_ptr + row, scale)
        for k0 in range(0, K, BLOCK):
            mask = k0 + cols < K
            x = _load_row(x_row, k0 + cols, mask, K, SILU_MUL)
            q = _quantize(x, scale, QMAX, IS_INT8, STATIC, INTERPRET)
            tl.store(q_row + k0 + cols, q, mask=mask)


@triton.jit
def _load_row(x_row, cols, mask, K, SILU_MUL: tl.constexpr):
    """``x[row, cols]`` in fp32 (0 where masked); with SILU_MUL, ``silu(gate) * up`` at cols,
    rounded to x's dtype first, as kernels/activation.py's kernel computes and stores it."""
    x = tl.load(x_row + cols, mask=mask, other=0.0)
    if SILU_MUL:
        up = tl.load(x_row + K + cols, mask=mask, other=0.0).to(tl.float32)
        gate = x.to(tl.float32)
        x = (gate / (1.0 + tl.exp(-gate)) * up).to(x.dtype)
    return x.to(tl.float32)


@triton.jit
def _divide(x, scale, CORRECTED: tl.constexpr):
    """``x / scale`` correctly rounded (fp32 x, one scalar scale; module docstring); CORRECTED
    (int8, dynamic scale): by the corrected product, without a branch."""
    if not CORRECTED:
        return tl.math.div_rn(x, tl.zeros_like(x) + scale)
    # a row's scale outside [2**-60, 2**60] and its inputs scaled by 2**64 or 2**-64 first: the
    # quotient unchanged (inputs the scaling makes subnormal have quotients that round to zero)
    k = tl.where(scale < 8.673617379884035e-19, 1.8446744073709552e19, 1.0)
    k = tl.where(scale > 1.152921504606847e18, 5.421010862427522e-20, k)
    s = scale * k
    inv = tl.math.div_rn(1.0, s)
    xs = x * k
    q = xs * inv
    y = tl.fma(-q, tl.zeros_like(x) + s, xs)
    return tl.fma(y, tl.zeros_like(x) + inv, q)


@triton.jit
def _quantize(
    x, scale, QMAX: tl.constexpr, IS_INT8: tl.constexpr, STATIC: tl.constexpr,
    INTERPRET: tl.constexpr,
):  # fmt: skip
    """fp32 ``x / scale`` (correctly rounded), saturated, as int8 or fp8 (module docstring)."""
    y = _divide(x, scale, IS_INT8 and not STATIC)
    if IS_INT8:
        # clamp to the integer bounds, then round half to even (the same as round-then-clamp)
        y = tl.minimum(tl.maximum(y, -QMAX - 1.0), QMAX)
        if INTERPRET:
            y = _rint(y)
        else:
            y = libdevice.rint(y)
        q = y.to(tl.int8)  # exact: y is an integer in range
    else:
        y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
        if INTERPRET:
            y = _round_e4m3(y)  # exact conversion below: y is on the e4m3 grid
        q = y.to(tl.float8e4nv)
    return q


@triton.jit
def _rint(y):
    """Round half to even of |y| <= 2**22: adding and subtracting 1.5 * 2**23 leaves no
    fraction bits, and the fp32 add rounds to nearest even."""
    magic = 12582912.0
    return (y + magic) - magic


@triton.jit
def _round_e4m3(y):
    """|y| <= 448 rounded to nearest even on the e4m3 grid (3 mantissa bits, subnormal step
    2**-9), in fp32: what the hardware conversion does, for the interpreter."""
    bits = y.to(tl.uint32, bitcast=True)
    exp = tl.maximum(((bits >> 23) & 0xFF).to(tl.int32) - 127, -6)  # the binade, >= 2**-6
    step = ((exp - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 2**(exp - 3)
    inv = ((3 - exp + 127) << 23).to(tl.float32, bitcast=True)  # 1 / step
    r = _rint(y * inv) * step  # both products exact: powers of two
    sign = bits & 0x80000000  # keep it: a small negative value rounds to -0, as the hardware's
    return (r.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)


def act_quant(
    x: torch.Tensor,  # [T, K] fp32/fp16/bf16, last dim contiguous ([T, 2K] with silu_mul)
    out_dtype: torch.dtype,  # torch.float8_e4m3fn or torch.int8
    static_scale: torch.Tensor | None = None,  # one element, or None: dynamic per row
    block: int = 16384,  # the longest row read once (a power of two); longer ones in chunks
    *,
    silu_mul: bool = False,  # x is a gated MLP's [gate | up]: quantize silu(gate) * up
) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, K] out_dtype, [T, 1] float32)
    """Per-row quantization of ``x``; with ``silu_mul``, of ``silu_and_mul(x)``
    (kernels/activation.py) in the same launch, bit for bit as that kernel's output then this
    one, without writing and reading back the activation."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"act_quant: x must be 2-D with a contiguous last dim, got {x.shape}")
    if silu_mul and x.shape[1] % 2:
        raise ValueError(f"act_quant: silu_mul needs x [T, 2K], got {tuple(x.shape)}")
    if out_dtype not in (torch.float8_e4m3fn, torch.int8):
        raise ValueError(f"act_quant: out_dtype must be float8_e4m3fn or int8, got {out_dtype}")
    if static_scale is not None and static_scale.numel() != 1:
        raise ValueError(f"act_quant: static scale must have one element, got {static_scale.shape}")
    if block < 16 or block & (block - 1):
        raise ValueError(f"act_quant: block must be a power of two >= 16, got {block}")
    t, k = x.shape[0], x.shape[1] // (1 + silu_mul)
    q = torch.empty((t, k), dtype=out_dtype, device=x.device)
    scale = torch.empty((t, 1), dtype=torch.float32, device=x.device)
    if t == 0:
        return q, scale
    is_int8 = out_dtype == torch.int8
    static = scale if static_scale is None else static_scale.reshape(1).float()
    block = max(16, min(block, triton.next_power_of_2(k)))
    _act_quant_kernel[(t,)](
        x, q, scale, static, k, x.stride(0), q.stride(0),
        QMAX=INT8_MAX if is_int8 else FP8_MAX, IS_INT8=is_int8,
        STATIC=static_scale is not None, BLOCK=block, ONE_PASS=block >= k, SILU_MUL=silu_mul,
        INTERPRET=envs.triton_interpret(), num_warps=min(16, max(1, block // 512)),
    )  # fmt: skip
    return q, scale


def fp8_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] in fp8 per token and ``group`` inputs (torch ops): ([T, K] fp8, a view when
    ``group`` does not divide K; [T, ceil(K / group)] float32 scales, ``amax / 448``)."""
    t, k = x.shape
    xg = F.pad(x.float(), (0, -k % group)).view(t, -1, group)  # [T, K / g, g]
    amax = xg.abs().amax(-1, keepdim=True)
    # a tensor divisor: IEEE division on CUDA too (a python float is a rounded reciprocal)
    scale = torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))
    q = (xg / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(t, -1)[:, :k], scale.squeeze(-1)


def act_quant_ref(
    x: torch.Tensor,  # [T, K]
    out_dtype: torch.dtype,
    static_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, K] out_dtype, [T, 1] float32)
    """The torch reference (the same ops as quant/fp8.py's and quant/int8.py's CPU paths)."""
    qmax = INT8_MAX if out_dtype == torch.int8 else FP8_MAX
    if static_scale is None:
        amax = x.abs().amax(dim=1, keepdim=True).float()
        # a tensor divisor: IEEE division on CUDA too (not the product by a rounded reciprocal)
        scale = torch.where(amax > 0, amax / torch.full_like(amax, qmax), torch.ones_like(amax))
    else:
        scale = static_scale.float().reshape(1, 1).expand(x.shape[0], 1).contiguous()
    y = x.float() / scale
    if out_dtype == torch.int8:
        return torch.round(y).clamp(-qmax - 1, qmax).to(torch.int8), scale
    return y.clamp(-qmax, qmax).to(out_dtype), scale
