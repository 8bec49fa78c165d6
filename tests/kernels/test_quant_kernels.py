"""Quantized-matmul Triton kernels vs their torch references: on CPU under TRITON_INTERPRET=1
(small shapes, fp32 and fp16: the interpreter gets bf16 wrong), compiled on CUDA."""

from __future__ import annotations

import pytest
import torch

from lightwell.kernels import w4a16
from lightwell.quant.utils import pack_int32
from tests.kernels.interpreter import DEVICE

TOL = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 1e-2}


def _w4(k: int, n: int, group: int, act_order: bool, dtype, gen, sym: bool = False):
    """(qweight [N, K/8], scales [N, G], zeros [N, G], g_idx [K]) with random values (``sym``:
    every zero point 8, as symmetric checkpoints store them; else 0-16, GPTQ v1's +1 included)."""
    gs = group if group > 0 else k
    q = torch.randint(0, 16, (n, k), generator=gen)
    groups = -(-k // gs)
    scales = (torch.rand(n, groups, generator=gen) * 0.05 + 0.01).to(dtype)
    zeros = torch.randint(0, 17, (n, groups), generator=gen).to(dtype)  # GPTQ v1: up to 16
    if sym:
        zeros = torch.full_like(zeros, 8)
    g_idx = torch.arange(k) // gs
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=gen)]
    qweight = pack_int32(q, 4, dim=1)
    return [t.to(DEVICE) for t in (qweight, scales, zeros, g_idx.to(torch.int32))]


def _check_close(out, ref, dtype) -> None:
    assert ref.abs().max() > 0.1
    err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    assert err < TOL[dtype], err


@pytest.mark.parametrize(
    "m, k, n, group, act_order, sym, config",
    [
        (1, 256, 24, 128, False, False, (4, 64, 1, 1)),  # K tile inside one group
        (2, 256, 13, 32, False, True, (8, 128, 2, 2)),  # 4 groups a tile, N past a block, sym
        (3, 192, 16, 64, False, False, (2, 128, 1, 3)),  # K not a multiple of BLOCK_K
        (4, 96, 9, -1, False, False, (4, 64, 1, 1)),  # one group, K tile masked
        (1, 192, 8, 96, False, False, (2, 64, 1, 1)),  # group 96: BLOCK_K shrinks to 32
        (3, 128, 12, 32, True, False, (4, 64, 1, 1)),  # act-order: groups gathered by g_idx
        (1, 512, 6, 128, False, True, None),  # pick_config
    ],
)
def test_w4a16_gemv_matches_reference(m, k, n, group, act_order, sym, config):
    dtype = torch.float32 if m % 2 else torch.float16
    gen = torch.Generator().manual_seed(m * 1000 + k + n)
    qweight, scales, zeros, g_idx = _w4(k, n, group, act_order, dtype, gen, sym)
    x = torch.randn(m, k, generator=gen).to(dtype).to(DEVICE)
    bias = torch.randn(n, generator=gen).to(dtype).to(DEVICE) if m != 3 else None
    gs = 0 if act_order else (group if group > 0 else k)
    out = w4a16.w4a16_gemv(x, qweight, scales, zeros, g_idx, bias, gs, config)
    assert out.shape == (m, n) and out.dtype == dtype
    _check_close(out, w4a16.w4a16_matmul_ref(x, qweight, scales, zeros, g_idx, bias), dtype)


def test_w4a16_gemv_bf16_x():
    """bf16 x, the serving dtype: the reference to within the bf16 rounding of the output."""
    gen = torch.Generator().manual_seed(7)
    qweight, scales, zeros, g_idx = _w4(256, 8, 128, False, torch.float32, gen)
    x = torch.randn(1, 256, generator=gen).to(torch.bfloat16).to(DEVICE)
    ref = w4a16.w4a16_matmul_ref(x, qweight, scales, zeros, g_idx)
    out = w4a16.w4a16_gemv(x, qweight, scales, zeros, g_idx, None, 128, (4, 128, 1, 1))
    assert out.dtype == torch.bfloat16
    err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    assert err < 8e-3, err  # the bf16 rounding of the output (2^-8) and no more


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(
    "m, k, n, group, act_order",
    [
        (5, 128, 72, 32, False),  # GEMM, two groups a K tile
        (20, 64, 64, -1, False),  # GEMM, per channel (one group)
        (6, 96, 40, 16, True),  # GEMM, act-order
    ],
)
def test_w4a16_matmul_gemm_matches_reference(m, k, n, group, act_order, dtype):
    gen = torch.Generator().manual_seed(m * 1000 + k + n)
    qweight, scales, zeros, g_idx = _w4(k, n, group, act_order, dtype, gen)
    x = torch.randn(m, k, generator=gen).to(dtype).to(DEVICE)
    bias = torch.randn(n, generator=gen).to(dtype).to(DEVICE) if m != 20 else None
    gs = 0 if act_order else (group if group > 0 else k)
    out = w4a16.w4a16_matmul(x, qweight, scales, zeros, g_idx, bias, group_size=gs)
    assert out.shape == (m, n) and out.dtype == dtype
    _check_close(out, w4a16.w4a16_matmul_ref(x, qweight, scales, zeros, g_idx, bias), dtype)


def test_w4a16_gemv_act_order_sorted_at_load():
    """An act-order layer through quant/wna16.finalize: inputs sorted by group, x's columns
    permuted at the call, the GEMV on contiguous groups, against the unsorted weight."""
    from torch import nn

    from lightwell.quant.wna16 import finalize

    gen = torch.Generator().manual_seed(7)
    k, n, gs = 128, 12, 32
    q = torch.randint(0, 16, (k, n), generator=gen)  # [K, N], the checkpoint's order
    scales = torch.rand(k // gs, n, generator=gen) * 0.05 + 0.01  # [G, N]
    zeros = torch.randint(0, 16, (k // gs, n), generator=gen).float()
    g_idx = (torch.arange(k) // gs)[torch.randperm(k, generator=gen)]
    layer = nn.Module()
    finalize(layer, q, scales, zeros, g_idx, 4, (), gs, act_order=True)
    assert layer.quant_group_size == gs and layer.quant_perm is not None
    x = torch.randn(2, k, generator=gen)
    want = x @ ((q.float() - zeros[g_idx]) * scales[g_idx])  # [2, N]
    params = [t.to(DEVICE) for t in (layer.qweight, layer.scales, layer.zeros, layer.g_idx)]
    xs = x.index_select(1, layer.quant_perm).to(DEVICE)
    out = w4a16.w4a16_gemv(xs, *params, group_size=gs, config=(4, 64, 1, 1))
    _check_close(out.cpu(), want, torch.float32)


def test_w4a16_slices_stay_inside_groups():
    assert w4a16.slice_size(1024, 128, 4096) == (1024, 128)  # 8 groups a tile
    assert w4a16.slice_size(64, 128, 4096) == (64, 64)  # half a group a tile
    assert w4a16.slice_size(1024, 4096, 4096) == (1024, 1024)  # one group
    assert w4a16.slice_size(256, 0, 4096) == (256, 256)  # gathered
    assert w4a16.slice_size(256, 96, 4096) == (32, 32)  # neither divides: shrink
    assert w4a16.pick_config(4096, 4096, 1) == (4, 2048, 2, 1)  # o
    assert w4a16.pick_config(6144, 4096, 1) == (4, 2048, 4, 1)  # qkv
    assert w4a16.pick_config(28672, 4096, 1) == (16, 256, 1, 1)  # gate_up
    assert w4a16.pick_config(4096, 14336, 1) == (4, 2048, 2, 1)  # down
    assert w4a16.pick_config(4096, 96, 4) == (2, 128, 1, 3)  # K tile cut to K


def test_w4a16_matmul_checks_shapes():
    gen = torch.Generator().manual_seed(0)
    qweight, scales, zeros, g_idx = _w4(64, 32, 32, False, torch.float32, gen)
    with pytest.raises(ValueError, match="qweight must be int32"):
        w4a16.w4a16_matmul(torch.randn(2, 72, device=DEVICE), qweight, scales, zeros, g_idx)
    with pytest.raises(ValueError, match="multiple of 8"):
        w4a16.w4a16_matmul(torch.randn(2, 60, device=DEVICE), qweight, scales, zeros, g_idx)
    with pytest.raises(ValueError, match="at most 4 rows"):
        w4a16.w4a16_gemv(torch.randn(5, 64, device=DEVICE), qweight, scales, zeros, g_idx)


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


@pytest.mark.parametrize(
    "m, n, k, block",
    [(1, 48, 64, (16, 16)), (3, 80, 200, (16, 64)), (4, 4100, 1024, (128, 128)),
     (2, 24, 640, (8, 128))],
)  # fmt: skip
def test_fp8_block_gemv_matches_reference(m, n, k, block):
    """A few rows against block-scaled fp8 weights, weight-only: K past a 512-wide step and
    not a multiple of it (200, 640), N past a program's rows (4,100), a block of 8 rows;
    strided x rows; 16- and 32-bit x; too many rows or a bad scale shape refused."""
    from lightwell.kernels import fp8_block

    gen = torch.Generator().manual_seed(m + n + k)
    bn, bk = block
    b = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    sb = torch.rand(-(-n // bn), -(-k // bk), generator=gen) * 0.01 + 1e-3
    b, sb = b.to(DEVICE), sb.to(DEVICE)
    wide = torch.randn(m, k + 8, generator=gen)
    for dtype in (torch.float32, torch.float16):
        x = wide.to(dtype).to(DEVICE)[:, 3 : 3 + k]  # rows strided
        out = fp8_block.fp8_block_gemv(x, b, sb, block)
        ref = fp8_block.fp8_block_gemv_ref(x, b, sb, block)
        assert out.shape == (m, n) and out.dtype == dtype
        tol = 1e-5 if dtype == torch.float32 else 2e-3
        assert ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item() < tol
    with pytest.raises(ValueError, match="at most 4 rows"):
        fp8_block.fp8_block_gemv(torch.zeros(5, k, device=DEVICE), b, sb, block)
    with pytest.raises(ValueError, match="do not fit"):
        fp8_block.fp8_block_gemv(x, b, sb[:, :1], block)


@pytest.mark.parametrize(
    "m, k, n, group, sym, config",
    [
        (3, 512, 96, 128, False, (32, 128, 1, 4, 1)),
        (5, 512, 40, 128, True, (16, 128, 2, 4, 1)),  # split K, N past a block, sym
        (16, 256, 64, 256, False, (32, 128, 2, 2, 1)),  # 16 rows, group of two tiles
        (2, 384, 48, -1, False, (16, 128, 3, 1, 1)),  # per channel, 3-way split
        (1, 512, 72, 128, False, (64, 128, 4, 4, 1)),  # one row
        (4, 256, 24, 128, False, None),  # pick_config: split capped by the K tiles
    ],
)
def test_w4a16_skinny_matches_reference(m, k, n, group, sym, config):
    from lightwell.kernels.w4a16_skinny import w4a16_skinny

    gen = torch.Generator().manual_seed(m * 1000 + k + n)
    dtypes = (torch.float32, torch.float16) + ((torch.bfloat16,) if DEVICE == "cuda" else ())
    for dtype in dtypes:  # (the interpreter cannot bitcast 16 bits to bf16)
        qweight, scales, zeros, g_idx = _w4(k, n, group, False, dtype, gen, sym)
        x = torch.randn(m, k, generator=gen).to(dtype).to(DEVICE)
        bias = torch.randn(n, generator=gen).to(dtype).to(DEVICE) if m != 16 else None
        gs = group if group > 0 else k
        ref = w4a16.w4a16_matmul_ref(x, qweight, scales, zeros, g_idx, bias)
        for _ in range(2):  # the split-K counters are back at zero after a call
            out = w4a16_skinny(x, qweight, scales, zeros, bias, gs, config)
            assert out.shape == (m, n) and out.dtype == dtype
            _check_close(out, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_w4a16_skinny_is_exact_on_exact_inputs(dtype):
    """Integer x, power-of-two scales, zero points 0-16: every product and sum is exact in
    fp32, so the kernel's output equals the reference's bit for bit (each weight's q - z is
    exact, whatever the unpacking)."""
    from lightwell.kernels.w4a16_skinny import w4a16_skinny

    gen = torch.Generator().manual_seed(7)
    m, k, n = 4, 512, 48
    qweight, _, zeros, g_idx = _w4(k, n, 128, False, dtype, gen)
    scales = (2.0 ** -torch.randint(1, 5, tuple(zeros.shape), generator=gen)).to(dtype)
    x = torch.randint(-4, 5, (m, k), generator=gen).to(dtype).to(DEVICE)
    scales = scales.to(DEVICE)
    assert (zeros == 16).any() and (zeros == 0).any()
    ref = w4a16.w4a16_matmul_ref(x, qweight, scales, zeros, g_idx)
    out = w4a16_skinny(x, qweight, scales, zeros, None, 128, (16, 128, 2, 4, 1))
    assert torch.equal(out, ref)


def test_w4a16_matmul_routes_few_rows_to_skinny(monkeypatch):
    """2-16 rows of 16-bit x with 128-multiple groups take the skinny kernel; act-order gathered
    groups, fp32 x and one row keep the GEMV."""
    from lightwell.kernels import w4a16_skinny

    calls = []
    real = w4a16_skinny.w4a16_skinny
    monkeypatch.setattr(w4a16_skinny, "w4a16_skinny", lambda *a: calls.append(1) or real(*a))
    gen = torch.Generator().manual_seed(3)
    qweight, scales, zeros, g_idx = _w4(256, 32, 128, False, torch.float16, gen)
    cases = [
        (3, 128, torch.float16, True),
        (3, 0, torch.float16, False),
        (3, 128, torch.float32, False),
        (1, 128, torch.float16, False),
    ]
    for m, gs, dtype, skinny in cases:
        calls.clear()
        x = torch.randn(m, 256, generator=gen).to(dtype).to(DEVICE)
        out = w4a16.w4a16_matmul(x, qweight, scales.to(dtype), zeros.to(dtype), g_idx, None, gs)
        assert bool(calls) == skinny, (m, gs, dtype)
        ref = w4a16.w4a16_matmul_ref(x, qweight, scales.to(dtype), zeros.to(dtype), g_idx)
        _check_close(out, ref, dtype)


def test_fp8_block_matmul_compiles_one_variant_for_any_row_count(monkeypatch):
    """17, 32 and 33 rows (one tile size) launch one specialisation of the block-fp8 GEMM: a
    step's token count never compiles a variant in the middle of serving."""
    from lightwell.kernels import fp8_block
    from tests.kernels.test_triton_kernels import _SpecRecorder

    rec = _SpecRecorder(fp8_block._fp8_block_kernel)
    monkeypatch.setattr(fp8_block, "_fp8_block_kernel", rec)
    gen, fp8 = torch.Generator().manual_seed(6), torch.float8_e4m3fn
    b = (torch.randn(64, 64, generator=gen) * 50).to(fp8).to(DEVICE)
    sb = (torch.rand(2, 2, generator=gen) * 0.01 + 1e-3).to(DEVICE)
    for m in (17, 32, 33):
        a = (torch.randn(m, 64, generator=gen) * 50).to(fp8).to(DEVICE)
        sa = (torch.rand(m, 2, generator=gen) * 0.01 + 1e-3).to(DEVICE)
        out = fp8_block.fp8_block_matmul(a, sa, b, sb, (32, 32), torch.float32)
        ref = fp8_block.fp8_block_matmul_ref(a, sa, b, sb, (32, 32), torch.float32)
        assert ((out - ref).abs().max() / ref.abs().max()).item() < 1e-3
    assert len(rec.keys) == 1
