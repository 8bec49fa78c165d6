"""Quantized-matmul Triton kernels vs their torch references: on CPU under TRITON_INTERPRET=1
(small shapes, fp32 and fp16: the interpreter gets bf16 wrong), compiled on CUDA."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(tl.sum, InterpretedFunction):
        pytest.skip("triton was imported without TRITON_INTERPRET=1", allow_module_level=True)

from lightwell.kernels import w4a16  # noqa: E402
from lightwell.quant.utils import pack_int32  # noqa: E402

TOL = {torch.float32: 1e-4, torch.float16: 3e-3}


def _w4(k: int, n: int, group: int, act_order: bool, dtype, gen):
    """(qweight [K/8, N], scales [G, N], zeros [G, N], g_idx [K]) with random values."""
    gs = group if group > 0 else k
    q = torch.randint(0, 16, (k, n), generator=gen)
    groups = k // gs
    scales = (torch.rand(groups, n, generator=gen) * 0.05 + 0.01).to(dtype)
    zeros = torch.randint(0, 16, (groups, n), generator=gen).to(dtype)
    g_idx = torch.arange(k) // gs
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=gen)]
    qweight = pack_int32(q, 4, dim=0)
    return [t.to(DEVICE) for t in (qweight, scales, zeros, g_idx.to(torch.int32))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(
    "m, k, n, group, act_order",
    [
        (1, 128, 96, 64, False),  # GEMV, one group per K tile
        (1, 96, 80, 32, False),  # GEMV, groups smaller than the K tile, N past a block
        (1, 128, 64, 32, True),  # GEMV, act-order: g_idx gathered
        (3, 128, 72, 32, False),  # GEMM, one group per K tile
        (20, 64, 64, -1, False),  # GEMM, per channel (one group)
        (5, 96, 40, 16, True),  # GEMM, act-order
    ],
)
def test_w4a16_matmul_matches_reference(m, k, n, group, act_order, dtype):
    gen = torch.Generator().manual_seed(m * 1000 + k + n)
    qweight, scales, zeros, g_idx = _w4(k, n, group, act_order, dtype, gen)
    x = torch.randn(m, k, generator=gen).to(dtype).to(DEVICE)
    bias = torch.randn(n, generator=gen).to(dtype).to(DEVICE) if m != 3 else None
    gs = 0 if act_order else (group if group > 0 else k)
    out = w4a16.w4a16_matmul(x, qweight, scales, zeros, g_idx, bias, group_size=gs)
    ref = w4a16.w4a16_matmul_ref(x, qweight, scales, zeros, g_idx, bias)
    assert out.shape == (m, n) and out.dtype == dtype
    assert ref.abs().max() > 0.1
    err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    assert err < TOL[dtype], err


def test_w4a16_matmul_checks_shapes():
    gen = torch.Generator().manual_seed(0)
    qweight, scales, zeros, g_idx = _w4(64, 32, 32, False, torch.float32, gen)
    with pytest.raises(ValueError, match="qweight must be int32"):
        w4a16.w4a16_matmul(torch.randn(2, 72, device=DEVICE), qweight, scales, zeros, g_idx)


@pytest.mark.parametrize(
    "m, n, k, block",
    [(1, 48, 64, (16, 16)), (7, 80, 96, (32, 32)), (20, 64, 128, (16, 64))],
)
def test_fp8_block_matmul_matches_reference(m, n, k, block):
    from lightwell.kernels import fp8_block

    gen = torch.Generator().manual_seed(m + n + k)
    bn, bk = block
    fp8 = torch.float8_e4m3fn
    a = (torch.randn(m, k, generator=gen) * 100).clamp(-448, 448).to(fp8).to(DEVICE)
    b = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(fp8).to(DEVICE)
    sa = (torch.rand(m, -(-k // bk), generator=gen) * 0.01 + 1e-3).to(DEVICE)
    sb = (torch.rand(-(-n // bn), -(-k // bk), generator=gen) * 0.01 + 1e-3).to(DEVICE)
    if DEVICE == "cuda" and bk < 32:  # a GPU's fp8 dot needs K >= 32: refused, clearly
        with pytest.raises(ValueError, match=">= 32"):
            fp8_block.fp8_block_matmul(a, sa, b, sb, block, torch.float32)
        return
    out = fp8_block.fp8_block_matmul(a, sa, b, sb, block, torch.float32)
    ref = fp8_block.fp8_block_matmul_ref(a, sa, b, sb, block, torch.float32)
    assert ref.abs().max() > 0.01
    tol = 1e-5 if DEVICE == "cpu" else 1e-3  # (tensor cores sum the fp8 products their way)
    assert ((out - ref).abs().max() / ref.abs().max()).item() < tol
