"""RMSNorm (with and without its residual add) and SiLU-and-mul writing W8A8 inputs in one
launch (kernels/act_quant_fused.py) vs the unfused kernels they replace (the op, then
``act_quant``): equal bit for bit, fp8 and int8, dynamic and static scales. On CPU under
TRITON_INTERPRET=1 (fp32 / fp16), compiled on CUDA (bf16 too)."""

from __future__ import annotations

import pytest
import torch

from lightwell.kernels.act_quant import act_quant
from lightwell.kernels.act_quant_fused import (
    rmsnorm_quant,
    rmsnorm_quant_ref,
    silu_and_mul_quant,
    silu_and_mul_quant_ref,
)
from lightwell.kernels.activation import silu_and_mul
from lightwell.kernels.rmsnorm import fused_add_rmsnorm, rmsnorm
from tests.kernels.interpreter import DEVICE

FP8 = torch.float8_e4m3fn
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
OUTS = pytest.mark.parametrize("out", [FP8, torch.int8], ids=["fp8", "int8"])
SCALES = pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])


def _rows(t: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random rows of several magnitudes, one of them all zero."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=gen) * torch.logspace(-2, 1, t)[:, None]
    x[1] = 0.0
    return x.to(dtype).to(DEVICE)


def _same(got: tuple, ref: tuple) -> None:
    for a, b in zip(got, ref):
        if a is None or b is None:
            assert a is None and b is None
            continue
        assert a.dtype == b.dtype and a.shape == b.shape
        bits = {FP8: torch.uint8, torch.float32: torch.int32}.get(a.dtype)
        a, b = (a, b) if bits is None else (a.view(bits), b.view(bits))
        assert torch.equal(a.cpu(), b.cpu())


def _static(static: bool) -> torch.Tensor | None:
    return torch.tensor(0.02, device=DEVICE) if static else None


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@SCALES
@OUTS
def test_rmsnorm_quant_equals_the_unfused_kernels(dtype, residual, static, out):
    x = _rows(5, 200, dtype, seed=1)  # H not a power of two: a masked tail
    w = (1.0 + 0.3 * torch.randn(200, generator=torch.Generator().manual_seed(2))).to(dtype)
    w = w.to(DEVICE)
    res = _rows(5, 200, dtype, seed=3) if residual else None
    scale = _static(static)
    got = rmsnorm_quant(x, res, w, 1e-5, out, scale)
    if residual:
        normed, res_out = fused_add_rmsnorm(x, res, w, 1e-5)
    else:
        normed, res_out = rmsnorm(x, w, 1e-5), None
    _same(got, (*act_quant(normed, out, scale), res_out))
    if dtype == torch.float32:  # the torch references: the norm's rsqrt may differ by an ulp
        q, s, _ = got
        qr, sr, _ = rmsnorm_quant_ref(x.cpu(), None if res is None else res.cpu(), w.cpu(), 1e-5,
                                      out, None if scale is None else scale.cpu())  # fmt: skip
        torch.testing.assert_close(s.cpu(), sr, rtol=1e-6, atol=0)
        assert (q.cpu().float() - qr.float()).abs().max() <= (1.0 if out == torch.int8 else 32.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("inter,block", [(200, 64), (48, 1024)], ids=["blocks", "one_block"])
@SCALES
@OUTS
def test_silu_and_mul_quant_equals_the_unfused_kernels(dtype, inter, block, static, out):
    x = _rows(4, 2 * inter, dtype, seed=4) * 3
    scale = _static(static)
    got = silu_and_mul_quant(x, out, scale, block=block)
    _same(got, act_quant(silu_and_mul(x), out, scale))
    if dtype == torch.float32:
        qr, sr = silu_and_mul_quant_ref(x.cpu(), out, None if scale is None else scale.cpu())
        torch.testing.assert_close(got[1].cpu(), sr, rtol=1e-6, atol=0)


def test_fused_quant_kernels_check_arguments():
    x = torch.zeros(2, 32, device=DEVICE)
    w = torch.ones(32, device=DEVICE)
    with pytest.raises(ValueError, match="out_dtype"):
        rmsnorm_quant(x, None, w, 1e-5, torch.float16)
    with pytest.raises(ValueError, match="static scale"):
        silu_and_mul_quant(x, torch.int8, torch.ones(2, device=DEVICE))
    with pytest.raises(ValueError, match="2\\*I"):
        silu_and_mul_quant(x[:, :31], FP8)
    q, s, r = rmsnorm_quant(x[:0], None, w, 1e-5, FP8)
    assert q.shape == (0, 32) and s.shape == (0, 1) and r is None
