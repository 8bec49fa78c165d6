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


_BF16_ON_GPU = pytest.param(
    torch.bfloat16, marks=pytest.mark.skipif(DEVICE != "cuda", reason="bf16: a GPU's"), id="bf16"
)


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, _BF16_ON_GPU], ids=["fp32", "fp16", "bf16"]
)
def test_w4a16_skinny_is_exact_on_exact_inputs(dtype):
    """Integer x, power-of-two scales, zero points 0-16: every product and sum is exact in
    fp32, so the kernel's output equals the reference's bit for bit (each weight's q - z is
    exact, whatever the unpacking; on a GPU, fp16 and bf16 take the planes' inline PTX)."""
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


def _ptx_eval(code: str, a, z):
    """One of w4a16_skinny's plane strings evaluated on uint32 numpy arrays ($1 = a, $2 = z; the
    few instructions those strings use, by their PTX definitions); returns $0."""
    import numpy as np

    regs = {"$1": a, "$2": z}

    def val(t):
        return regs[t] if t in regs else np.uint32(int(t, 0))

    def halves(v, dt):  # the two 16-bit floats of each register, low half first
        return torch.from_numpy(v.view(np.int16).copy()).view(dt).float()

    for stmt in filter(None, (t.strip() for t in code.strip()[1:-1].split(";"))):
        op, *args = stmt.replace(",", " ").split()
        if op == ".reg":
            continue
        if op == "mov.b32":
            r = val(args[1])
        elif op == "shr.b32":
            r = val(args[1]) >> np.uint32(int(args[2]))
        elif op == "and.b32":
            r = val(args[1]) & val(args[2])
        elif op == "lop3.b32":  # bit i of the table: a, b, c at index bits 2, 1, 0
            x, y, w, table = val(args[1]), val(args[2]), val(args[3]), int(args[4], 0)
            r = np.zeros_like(a)
            for i in range(8):
                if table >> i & 1:
                    r |= (x if i & 4 else ~x) & (y if i & 2 else ~y) & (w if i & 1 else ~w)
        elif op in ("sub.rn.bf16x2", "sub.rn.f16x2"):
            dt = torch.bfloat16 if "bf16" in op else torch.float16
            d = (halves(val(args[1]), dt) - halves(val(args[2]), dt)).to(dt)
            r = d.view(torch.int16).numpy().view(np.uint32)
        else:
            raise AssertionError(f"no emulation of {op}")
        regs[args[0]] = r
    return regs["$0"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_w4a16_skinny_plane_ptx_is_exact(dtype):
    """The inline PTX of the planes (which only a GPU runs), evaluated by its instructions'
    definitions: for every 16-bit word in both halves of a register and every zero point 0-16,
    plane J gives (value J of the word) - zero point, exactly."""
    import numpy as np

    from lightwell.kernels import w4a16_skinny as ws

    words = np.arange(1 << 16, dtype=np.uint32)
    high = np.random.default_rng(0).permutation(words)
    a = words | (high << np.uint32(16))  # low half: every word; high half: a permutation
    offset = 128.0 if dtype == torch.bfloat16 else 1024.0
    for j in range(4):
        code = ws.plane_ptx(j, dtype == torch.bfloat16)
        want_lo = torch.from_numpy(((words >> np.uint32(4 * j)) & 15).astype(np.float32))
        want_hi = torch.from_numpy(((high >> np.uint32(4 * j)) & 15).astype(np.float32))
        for z in range(17):
            zo = torch.tensor([offset + z, offset + 16 - z], dtype=dtype).view(torch.int16)
            zbits = np.full_like(a, int(zo[0]) & 0xFFFF | (int(zo[1]) & 0xFFFF) << 16)
            out = _ptx_eval(code, a, zbits)
            got = torch.from_numpy(out.view(np.int16).copy()).view(dtype).float().view(-1, 2)
            assert torch.equal(got[:, 0], want_lo - z), (j, z)
            assert torch.equal(got[:, 1], want_hi - (16 - z)), (j, z)


_SKINNY_PTX_SCRIPT = r"""
import inspect, json, sys, torch, triton
from triton.backends.compiler import GPUTarget
from lightwell.kernels import w4a16_skinny as ws

def ptx(arch, dtype, asm):
    fn = ws._w4a16_skinny_kernel
    consts = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, SPLIT_K=1, GROUP_SIZE=128, HAS_BIAS=False,
                  PRECISION="tf32", ASM=asm, FENCE=True)
    types = dict(x_ptr=dtype, q_ptr="*i16", s_ptr=dtype, z_ptr=dtype, b_ptr=dtype,
                 out_ptr=dtype, part_ptr="*fp32", cnt_ptr="*i32")
    names = list(inspect.signature(fn.fn).parameters)
    sig = {n: types.get(n, "i32") for n in names if n not in consts}
    src = triton.compiler.ASTSource(fn=fn, signature=dict(sig, **{k: "constexpr" for k in consts}),
                                    constexprs=consts)
    target = GPUTarget("cuda", arch, 32)  # compiled through ptxas for that GPU
    return triton.compile(src, target=target, options=dict(num_warps=2, num_stages=3)).asm["ptx"]

out = {}
for arch in (90, 80):
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        asm = ws.use_asm(dtype, (arch // 10, 0))
        text = ptx(arch, "*" + name, asm)
        subs = sum(text.count(op) for op in ("sub.rn.bf16x2", "sub.rn.f16x2"))
        out[f"{name}_sm{arch}"] = [asm, subs]
print(json.dumps(out))
"""


def test_w4a16_skinny_inline_ptx_where_the_gpu_has_it():
    """The planes' inline PTX goes where it assembles: fp16 from sm_80, bf16 from sm_90
    (``sub.bf16x2``), never on ROCm; the kernel compiles (ptxas included) for sm_90 and sm_80
    with the form ``use_asm`` picks, the PTX strings inside when it picks them."""
    from lightwell.kernels.w4a16_skinny import use_asm
    from tests.kernels.test_triton_kernels import _run_ptx_script

    assert use_asm(torch.bfloat16, (9, 0)) and not use_asm(torch.bfloat16, (8, 9))
    assert use_asm(torch.float16, (8, 0)) and not use_asm(torch.float32, (9, 0))
    assert not use_asm(torch.float16, (9, 4), hip=True)
    got = _run_ptx_script(_SKINNY_PTX_SCRIPT, True)
    assert got["bf16_sm90"][0] and got["bf16_sm90"][1] > 0, got
    assert not got["bf16_sm80"][0] and got["bf16_sm80"][1] == 0, got
    assert got["fp16_sm90"][0] and got["fp16_sm90"][1] > 0, got
    assert got["fp16_sm80"][0] and got["fp16_sm80"][1] > 0, got


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
