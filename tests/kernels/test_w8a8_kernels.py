"""W8A8 kernels (per-token activation quantization, int8 GEMM with the fused epilogue) vs the
torch paths of quant/fp8.py and quant/int8.py: bit-identical. On CPU under TRITON_INTERPRET=1
(small shapes; the interpreter runs the int8 ``tl.dot`` too), compiled on CUDA."""

from __future__ import annotations

import pytest
import torch

from lightwell.kernels.act_quant import act_quant, act_quant_ref
from lightwell.kernels.int8_gemm import Int8GemmConfig, int8_gemm, int8_gemm_ref
from lightwell.quant import fp8, int8
from tests.kernels.interpreter import DEVICE

FP8 = torch.float8_e4m3fn


def _activations(t: int, k: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random rows of several magnitudes, one all-zero row, and ties of int8 rounding."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=gen) * torch.logspace(-3, 2, t)[:, None]
    x[1] = 0.0
    x[2, :8] = torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, 127.5, -128.5, 300.0])
    return x.to(dtype).to(DEVICE)


def _same(got: tuple, ref: tuple) -> None:
    (q, s), (qr, sr) = got, ref
    assert q.dtype == qr.dtype and s.shape == sr.shape == (q.shape[0], 1)
    bits = torch.uint8 if q.dtype == FP8 else torch.int8
    assert torch.equal(q.view(bits).cpu(), qr.view(bits).cpu())
    assert torch.equal(s.cpu(), sr.cpu())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("out", [FP8, torch.int8], ids=["fp8", "int8"])
@pytest.mark.parametrize("block", [64, 16384], ids=["chunked", "one_pass"])
def test_act_quant_bit_identical_to_torch(dtype, static, out, block):
    x = _activations(6, 200, dtype)  # K not a multiple of the block: a masked tail
    scale = torch.tensor(0.05, device=DEVICE) if static else None
    got = act_quant(x, out, scale, block=block)
    _same(got, act_quant_ref(x, out, scale))
    cpu = x.cpu()
    if out == FP8:  # the CPU path of quant/fp8.py
        _same(got, fp8.quantize_fp8(cpu, None if scale is None else scale.cpu().reshape(1, 1)))
    else:
        _same(got, int8.quantize_activations(cpu, None if scale is None else scale.cpu()))


def test_act_quant_fp8_rounds_to_nearest_even_on_the_grid():
    """Values between e4m3 neighbours (subnormals, binade carries, halfway ties) and beyond 448."""
    grid = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    grid = grid[torch.isfinite(grid)].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    vals = torch.cat([grid, mids, mids + 1e-4 * mids.abs(), torch.tensor([460.0, -1e4])])
    x = vals.reshape(1, -1).to(DEVICE)
    _same(
        act_quant(x, FP8, torch.ones((), device=DEVICE)),
        act_quant_ref(x.cpu(), FP8, torch.ones(())),
    )


@pytest.mark.parametrize("out,amax", [(FP8, (3.0, 3.0625, 4.0625)), (torch.int8, (3.25, 4.5))],
                         ids=["fp8", "int8"])  # fmt: skip
def test_act_quant_scale_is_a_true_division(out, amax):
    """Row maxima whose quotient by QMAX differs from the product by the rounded 1 / QMAX (what
    torch's CUDA ``tensor / python scalar`` computes): the scale is the IEEE quotient on every
    device, in the kernel and in the references."""
    qmax = 127.0 if out == torch.int8 else 448.0
    top = torch.tensor(amax)
    true = (top.double() / qmax).float()
    assert not torch.equal(top * torch.tensor(1.0 / qmax), true)  # the case that matters
    x = torch.randn(len(amax), 256, generator=torch.Generator().manual_seed(1)).clamp(-2.5, 2.5)
    x[:, 7] = -top
    x = x.to(torch.bfloat16).to(DEVICE)
    got = act_quant(x, out)
    _same(got, act_quant_ref(x, out))
    assert torch.equal(got[1].cpu().reshape(-1), true)


@pytest.mark.parametrize("out", [FP8, torch.int8], ids=["fp8", "int8"])
def test_act_quant_quotients_at_rounding_boundaries(out):
    """The dynamic scale's division on inputs whose exact quotients sit at or within a few ulps
    of the output format's rounding boundaries, in rows of many magnitudes (tiny and huge
    scales): the same bits as torch's IEEE division. (In the interpreter Triton's ``/`` is exact
    too, so this tells a product by a reciprocal from a division, not ``div_rn`` from ``/``:
    compiled on CUDA it tells both.)"""
    qmax = 127.0 if out == torch.int8 else 448.0
    if out == torch.int8:
        ties = torch.arange(-128, 127, dtype=torch.float64) + 0.5
    else:
        grid = torch.arange(256, dtype=torch.uint8).view(FP8).double()
        grid = grid[torch.isfinite(grid)].unique()
        ties = (grid[1:] + grid[:-1]) / 2
    gen = torch.Generator().manual_seed(3)
    amaxes = [1e-30, 2.0**-60 * qmax, 3e-12, 1.0, 3.0, 1234.5, 7.1e5, 3e30]
    amaxes += (10 ** (torch.rand(8, generator=gen) * 8 - 4)).tolist()
    rows = []
    for amax in amaxes:
        top = torch.tensor(amax, dtype=torch.float32)
        scale = (top.double() / qmax).float().double()  # the kernel's scale, exactly
        exact = (ties * scale).float()  # each tie's nearest fp32, then its neighbours
        cols = [exact]
        for steps in (1, 2, 3):
            up, down = exact.clone(), exact.clone()
            for _ in range(steps):
                up = torch.nextafter(up, torch.full_like(up, float("inf")))
                down = torch.nextafter(down, torch.full_like(down, -float("inf")))
            cols += [up, down]
        row = torch.cat(cols).clamp(-top, top)
        rows.append(torch.cat([top.reshape(1), row]))
    x = torch.stack(rows).to(DEVICE)
    _same(act_quant(x, out), act_quant_ref(x.cpu(), out))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("out", [FP8, torch.int8], ids=["fp8", "int8"])
@pytest.mark.parametrize("block", [64, 16384], ids=["chunked", "one_pass"])
@pytest.mark.filterwarnings("ignore:overflow encountered in exp")
def test_act_quant_silu_mul_equals_activation_then_quant(dtype, static, out, block):
    """``silu_mul``: the activation kernel's output quantized, bit for bit, in one launch (a
    masked tail; gate and up of several magnitudes, an all-zero row)."""
    from lightwell.kernels.activation import silu_and_mul, silu_and_mul_ref

    gate_up = _activations(6, 400, dtype, seed=4)  # [6, 2 x 200]
    scale = torch.tensor(0.05, device=DEVICE) if static else None
    got = act_quant(gate_up, out, scale, block=block, silu_mul=True)
    assert got[0].shape == (6, 200)
    _same(got, act_quant(silu_and_mul(gate_up), out, scale, block=block))
    # and the torch activation's quantization up to one step of the rounding of exp
    ref = act_quant_ref(silu_and_mul_ref(gate_up.cpu()), out, None if scale is None else scale)
    deq, deq_ref = got[0].cpu().float() * got[1].cpu(), ref[0].float() * ref[1]
    step = ref[1] * (1.0 if out == torch.int8 else 2.0**-3 * 448.0)
    assert ((deq - deq_ref).abs() <= step + 1e-6).all()


_CUDA_ONLY = pytest.mark.skipif(DEVICE == "cpu", reason="the interpreter's bf16 is inexact")


@pytest.mark.parametrize("out", [FP8, torch.int8], ids=["fp8", "int8"])
@pytest.mark.parametrize(
    "dtype", [torch.float32, pytest.param(torch.bfloat16, marks=_CUDA_ONLY)], ids=["fp32", "bf16"]
)
def test_act_quant_silu_mul_scales_show_each_activation(out, dtype):
    """One activation a row: its dynamic scale is ``|silu(gate) * up| / QMAX``, so every row's
    scale exposes the activation's bits (an ulp off in the formula shows in many rows)."""
    from lightwell.kernels.activation import silu_and_mul

    gen = torch.Generator().manual_seed(8)
    gate_up = (4 * torch.randn(512, 2, generator=gen)).to(dtype).to(DEVICE)
    got = act_quant(gate_up, out, silu_mul=True)
    _same(got, act_quant(silu_and_mul(gate_up), out))


def _scaled_layer(dtype: torch.dtype, static: bool) -> torch.nn.Module:
    """A linear's parameters as the W8A8 methods keep them: 8-bit [N, K] weight, [N] fp32
    scales, a 0-dim static input scale."""
    weight = torch.randn(24, 64, generator=torch.Generator().manual_seed(9))
    if dtype == FP8:
        q, scale = fp8.quantize_fp8(weight)
    else:
        q, scale = int8.quantize_rows(weight)
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(q.to(DEVICE), requires_grad=False)
    layer.weight_scale = torch.nn.Parameter(scale.reshape(-1).to(DEVICE), requires_grad=False)
    if static:
        layer.input_scale = torch.nn.Parameter(torch.tensor(0.02, device=DEVICE), False)
    return layer


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(
    "method,weights,static",
    [
        ("ct", torch.int8, "dynamic"), ("ct", torch.int8, "static"), ("ct", FP8, "dynamic"),
        ("ct", FP8, "static"), ("ct", torch.int8, "none"), ("fp8", FP8, "dynamic"),
    ],
)  # fmt: skip
def test_w8a8_methods_fuse_the_down_projections_activation(monkeypatch, dtype, method, weights,
                                                           static):  # fmt: skip
    """``apply_silu_mul`` of compressed-tensors' ScaledMethod and of ``--quantization fp8``
    (the device check forced on: on CPU the kernel runs in the interpreter) equals the
    activation kernel then ``apply`` bit for bit, its static input scale included; int8
    weight-only answers None (the caller runs the activation, then ``apply``). Off CUDA every
    method answers None."""
    from lightwell.kernels.activation import silu_and_mul
    from lightwell.quant import utils as quant_utils
    from lightwell.quant.compressed_tensors import ScaledMethod

    if method == "ct":
        m = ScaledMethod(weights, "channel", static)
    else:
        m = fp8.Fp8W8A8Method()
    layer = _scaled_layer(weights, static == "static")
    gate_up = _activations(5, 128, dtype, seed=10)
    bias = torch.randn(24, generator=torch.Generator().manual_seed(11)).to(dtype).to(DEVICE)
    if DEVICE == "cpu":
        assert m.apply_silu_mul(layer, gate_up, bias) is None
    monkeypatch.setattr(quant_utils, "silu_mul_fusable", lambda gate_up: True)
    got = m.apply_silu_mul(layer, gate_up, bias)
    if static == "none":
        assert got is None
        return
    want = m.apply(layer, silu_and_mul(gate_up), bias)
    assert got.dtype == dtype and torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("out", [FP8, torch.int8], ids=["fp8", "int8"])
@pytest.mark.parametrize("residual", [False, True], ids=["norm", "add_norm"])
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_rmsnorm_quant_equals_norm_then_act_quant(dtype, out, residual, static):
    """kernels/rmsnorm.py's ``rmsnorm_quant``: the norm kernel's output (and new residual) then
    ``act_quant``, in one launch (rows of several magnitudes, a masked tail): bit for bit in the
    interpreter (compiled, the sum of squares may add in another order)."""
    from lightwell.kernels import rmsnorm as rn

    x = _activations(6, 200, dtype, seed=12)
    x[1] = 1.0  # (an all-zero row has no norm)
    gen = torch.Generator().manual_seed(13)
    res = (torch.randn(6, 200, generator=gen)).to(dtype).to(DEVICE) if residual else None
    w = (torch.rand(200, generator=gen) + 0.5).to(dtype).to(DEVICE)
    scale = torch.tensor(0.05, device=DEVICE) if static else None
    q, s, new_res = rn.rmsnorm_quant(x, res, w, 1e-6, out, scale)
    if residual:
        normed, want_res = rn.fused_add_rmsnorm(x, res, w, 1e-6)
        assert torch.equal(new_res, want_res)
    else:
        normed = rn.rmsnorm(x, w, 1e-6)
        assert new_res is None
    _same((q, s), act_quant(normed, out, scale))


@pytest.mark.parametrize(
    "method,weights,static",
    [
        ("ct", torch.int8, "dynamic"), ("ct", torch.int8, "static"), ("ct", FP8, "dynamic"),
        ("ct", FP8, "static"), ("ct", torch.int8, "none"), ("fp8", FP8, "dynamic"),
    ],
)  # fmt: skip
def test_w8a8_methods_take_the_input_quantized(method, weights, static):
    """``input_quant`` says what a W8A8 method quantizes its input to (None: weight-only), and
    ``apply_quantized`` of the input so quantized equals ``apply`` bit for bit."""
    from lightwell.quant.base import QuantizedInput, input_quant
    from lightwell.quant.compressed_tensors import ScaledMethod

    m = ScaledMethod(weights, "channel", static) if method == "ct" else fp8.Fp8W8A8Method()
    layer = _scaled_layer(weights, static == "static")
    spec = input_quant(m, layer)
    if static == "none":
        assert spec is None
        return
    dtype, scale = spec
    assert dtype == weights and (
        scale is layer.input_scale if static == "static" else scale is None
    )
    x = _activations(5, 64, torch.float16, seed=14)
    bias = torch.randn(24, generator=torch.Generator().manual_seed(15)).half().to(DEVICE)
    got = m.apply_quantized(layer, QuantizedInput(*act_quant(x, dtype, scale), x.dtype), bias)
    assert got.dtype == x.dtype and torch.equal(got, m.apply(layer, x, bias))


def test_rms_norm_quantized_input_keeps_the_unfused_output_dtype():
    """``RMSNorm.quantized`` tags its rows with the dtype the unfused norm would write (bf16
    rows and an fp32 weight: fp32), which the linear's output takes."""
    from lightwell.kernels import rmsnorm as rn
    from lightwell.layers.norm import RMSNorm

    norm = RMSNorm(64).to(DEVICE)  # fp32 weight
    x = _activations(3, 64, torch.bfloat16, seed=16)
    x[1] = 1.0
    out, res = norm.quantized(x, None, (torch.int8, None))
    want = rn.rmsnorm(x, norm.weight, norm.eps)
    assert out.dtype == want.dtype == torch.float32 and res is x
    _same((out.q, out.scale), act_quant(want, torch.int8))


def test_act_quant_checks_input():
    x = torch.zeros(4, 32, device=DEVICE)
    with pytest.raises(ValueError, match="out_dtype"):
        act_quant(x, torch.float16)
    with pytest.raises(ValueError, match="static scale"):
        act_quant(x, torch.int8, torch.ones(4, device=DEVICE))
    with pytest.raises(ValueError, match="silu_mul"):
        act_quant(torch.zeros(4, 33, device=DEVICE), torch.int8, silu_mul=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("m,n,k", [(1, 48, 64), (19, 40, 96), (5, 33, 48)])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_int8_gemm_matches_reference(dtype, m, n, k, bias):
    gen = torch.Generator().manual_seed(m * n + k)
    a = torch.randint(-128, 128, (m, k), generator=gen, dtype=torch.int8)
    b = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    sa = torch.rand(m, 1, generator=gen) * 0.01
    sb = torch.rand(n, generator=gen) * 0.01
    bv = torch.randn(n, generator=gen).to(dtype) if bias else None
    ref = int8_gemm_ref(a, b, sa, sb, dtype, bv)
    args = [t.to(DEVICE) if t is not None else None for t in (a, b, sa, sb)]
    cfg = Int8GemmConfig(16, 32, 32, 4, 1) if DEVICE == "cpu" else None  # several tiles
    got = int8_gemm(*args, dtype, None if bv is None else bv.to(DEVICE), config=cfg)
    if DEVICE == "cpu":
        assert torch.equal(got.cpu(), ref)
    else:  # the GPU contracts the epilogue's multiply and bias add into one FMA: an ulp apart
        ulp = 2.0**-23 if dtype == torch.float32 else 2.0**-10
        torch.testing.assert_close(got.cpu(), ref, rtol=2 * ulp, atol=2 * ulp * ref.abs().max())


def test_int8_gemm_checks_shapes():
    a = torch.zeros(4, 32, dtype=torch.int8, device=DEVICE)
    with pytest.raises(ValueError, match="int8 GEMM"):
        int8_gemm(a, a[:, :16].contiguous(), torch.ones(4, 1), torch.ones(4), torch.float32)
    with pytest.raises(ValueError, match="scales"):
        int8_gemm(a, a, torch.ones(3, 1), torch.ones(4), torch.float32)


def test_int8_w8a8_linear_kernel_path_equals_torch_path():
    """The CUDA route of ``int8_w8a8_linear`` (act_quant + int8_gemm) against its CPU path."""
    x = _activations(7, 64, torch.float32, seed=3)
    w, sw = int8.quantize_rows(torch.randn(24, 64, generator=torch.Generator().manual_seed(1)))
    bias = torch.randn(24, generator=torch.Generator().manual_seed(2))
    ref = int8.int8_w8a8_linear(x.cpu(), w, sw, None, bias)
    qx, sx = act_quant(x, torch.int8)
    cfg = Int8GemmConfig(16, 16, 32, 4, 1) if DEVICE == "cpu" else None
    got = int8_gemm(qx, w.to(DEVICE), sx, sw.to(DEVICE), x.dtype, bias.to(DEVICE), config=cfg)
    if DEVICE == "cpu":
        assert torch.equal(got.cpu(), ref)
    else:  # the epilogue's multiply and bias add contract into one FMA on the GPU
        torch.testing.assert_close(got.cpu(), ref, rtol=2.0**-22, atol=2.0**-22 * ref.abs().max())


def test_int8_gemm_compiles_one_variant_for_any_row_count(monkeypatch):
    """Steps of 17, 32 and 33 rows (one tile size) launch one specialisation: a mixed step's
    token count, 16-divisible or not, never compiles a variant in the middle of serving."""
    import lightwell.kernels.int8_gemm as ig
    from tests.kernels.test_triton_kernels import _SpecRecorder

    rec = _SpecRecorder(ig._int8_gemm_kernel)
    monkeypatch.setattr(ig, "_int8_gemm_kernel", rec)
    gen = torch.Generator().manual_seed(3)
    b = torch.randint(-127, 128, (32, 64), generator=gen, dtype=torch.int8).to(DEVICE)
    sb = torch.rand(32, generator=gen).to(DEVICE)
    for m in (17, 32, 33):
        a = torch.randint(-127, 128, (m, 64), generator=gen, dtype=torch.int8).to(DEVICE)
        sa = torch.rand(m, generator=gen).to(DEVICE)
        got = int8_gemm(a, b, sa, sb, torch.float32)
        assert torch.allclose(got, int8_gemm_ref(a, b, sa, sb, torch.float32), rtol=1e-5)
    assert len(rec.keys) == 1


def test_int8_gemm_tiles_by_rows_and_shape():
    """Up to 16 rows: 16-row tiles; decode batches (17-256 rows): gate_up-wide weights 64-row
    tiles up to 64 rows, then 128; long K (down) past 128 rows split in two over K; others
    64 x 64 tiles, as many programs an SM as the tiles need for one wave; prefill-sized steps
    128 x 128."""
    from lightwell.kernels.int8_gemm import Int8GemmConfig as C
    from lightwell.kernels.int8_gemm import pick_config

    assert pick_config(8, 4096, 4096).block_m == 16
    assert pick_config(48, 28672, 4096) == C(64, 128, 128, 4, 4)
    assert pick_config(256, 28672, 4096) == C(128, 128, 128, 8, 3)
    for n, k in ((6144, 4096), (4096, 4096), (4096, 14336)):  # qkv, o, down
        assert pick_config(64, n, k) == C(64, 64, 256, 4, 4)
        assert pick_config(257, n, k) == C(128, 128, 128, 8, 3)
    assert pick_config(128, 4096, 4096) == C(64, 64, 256, 4, 4)  # 128 tiles: one an SM
    assert pick_config(128, 6144, 4096) == C(64, 64, 256, 4, 3)  # 192: two an SM
    assert pick_config(256, 6144, 4096) == C(64, 64, 128, 4, 4)  # 384: three an SM
    assert pick_config(128, 4096, 4096, sms=66) == C(64, 64, 256, 4, 3)
    assert pick_config(128, 4096, 14336) == C(64, 64, 256, 4, 4)
    assert pick_config(256, 4096, 14336) == C(128, 64, 128, 4, 4, 2)
    # the boundaries
    assert pick_config(16, 4096, 4096).block_m == 16 and pick_config(17, 4096, 4096).block_m == 64
    assert pick_config(129, 4096, 14336).split_k == 2
    assert pick_config(129, 4096, 8191) == C(64, 64, 256, 4, 3)  # 192 tiles, K short
    assert pick_config(128, 16383, 4096).block_n == 64
    assert pick_config(128, 16384, 4096) == C(128, 128, 128, 8, 3)
    assert pick_config(128, 4224, 4096) == C(64, 64, 256, 4, 4)  # 132 tiles: one wave
    assert pick_config(128, 4288, 4096) == C(64, 64, 256, 4, 3)  # 134 tiles


def _int8_operands(m: int, n: int, k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randint(-128, 128, (m, k), generator=gen, dtype=torch.int8)
    b = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    return a, b, torch.rand(m, 1, generator=gen) * 0.01, torch.rand(n, generator=gen) * 0.01


@pytest.mark.parametrize("split,k", [(2, 96), (4, 150)])
def test_int8_gemm_split_k_equals_unsplit(split, k):
    """Split over K (3 tiles in two shares of 2 and 1; 4 asked over 5 tiles: three shares of
    2, 2 and 1, none empty), the partials added exactly: the unsplit kernel's output bit for
    bit, and the reference's, on two calls in a row (the per-tile counters are back at zero
    after each)."""
    from lightwell.kernels.int8_gemm import _splits
    from lightwell.kernels.split_counters import split_counters

    a, b, sa, sb = _int8_operands(21, 40, k, seed=split)
    bias = torch.randn(40, generator=torch.Generator().manual_seed(1))
    ref = int8_gemm_ref(a, b, sa, sb, torch.float32, bias)
    args = [t.to(DEVICE) for t in (a, b, sa, sb)]
    cfg = Int8GemmConfig(16, 16, 32, 4, 1, split)  # 2 x 3 output tiles
    assert _splits(cfg, 21, 40, k) == {96: 2, 150: 3}[k]
    whole = int8_gemm(*args, torch.float32, bias.to(DEVICE), config=cfg._replace(split_k=1))
    for _ in range(2):
        got = int8_gemm(*args, torch.float32, bias.to(DEVICE), config=cfg)
        assert torch.equal(got, whole)
        if DEVICE == "cpu":
            assert torch.equal(got.cpu(), ref)
        else:  # the epilogue's multiply and bias add contract into one FMA on the GPU
            torch.testing.assert_close(got.cpu(), ref, rtol=2.0**-22, atol=2.0**-22 * 1e3)
        assert not split_counters(got.device, 6)[:6].any()


def test_split_counters_are_one_buffer_per_device_of_fixed_size():
    """The counters of every split-K launch on a device are one buffer (graphs captured over
    it stay valid); a launch of more tiles than it holds is refused."""
    from lightwell.kernels.split_counters import COUNTER_CAPACITY, split_counters

    device = torch.device(DEVICE)
    first = split_counters(device, 6)
    assert split_counters(device, COUNTER_CAPACITY).data_ptr() == first.data_ptr()
    assert first.numel() == COUNTER_CAPACITY and first.dtype == torch.int32
    with pytest.raises(ValueError, match="split-K launch"):
        split_counters(device, COUNTER_CAPACITY + 1)


# The split-K kernels compiled for sm_90 (no GPU needed): the order of their barriers, counter
# atomics, fences and partial loads in the PTX.
_SPLIT_PTX_SCRIPT = r"""
import inspect, json, re, sys, triton
from triton.backends.compiler import GPUTarget
from lightwell.kernels import int8_gemm as ig, w4a16_skinny as ws

def order(fn, types, consts, **options):
    names = list(inspect.signature(fn.fn).parameters)
    sig = {n: types.get(n, "i32") for n in names if n not in consts}
    src = triton.compiler.ASTSource(fn=fn, signature=dict(sig, **{k: "constexpr" for k in consts}),
                                    constexprs=consts)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    return re.findall(r"\b(bar\.sync|atom\.[\w.]+|fence\.acq_rel[\w.]*|ld\.global\.cg[\w.]*)",
                      k.asm["ptx"])

fence = sys.argv[1] == "1"
print(json.dumps({
    "int8": order(ig._int8_gemm_kernel, dict(a_ptr="*i8", b_ptr="*i8", sa_ptr="*fp32",
        sb_ptr="*fp32", bias_ptr="*bf16", out_ptr="*bf16", part_ptr="*i32", cnt_ptr="*i32"),
        dict(HAS_BIAS=False, BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, SPLIT_K=2, FENCE=fence),
        num_warps=4, num_stages=3),
    "w4a16": order(ws._w4a16_skinny_kernel, dict(x_ptr="*bf16", q_ptr="*i16", s_ptr="*bf16",
        z_ptr="*bf16", b_ptr="*bf16", out_ptr="*bf16", part_ptr="*fp32", cnt_ptr="*i32"),
        dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, SPLIT_K=4, GROUP_SIZE=128, HAS_BIAS=False,
        PRECISION="tf32", ASM=True, FENCE=fence), num_warps=2, num_stages=3),
}))
"""


@pytest.mark.parametrize("fence", [True, False])
def test_split_k_kernels_fence_before_reading_the_partials(fence):
    """Compiled for a GPU, the split-K kernels (int8 GEMM, W4A16 skinny) count a tile's
    programs in after a barrier (every thread's partial stores issued), with an acquire-release
    atomic at GPU scope; then every thread of the last program fences (acquire-release, GPU)
    before its loads of the partials (past L1). The interpreter's form has no fence."""
    from tests.kernels.test_triton_kernels import _run_ptx_script

    for name, ops in _run_ptx_script(_SPLIT_PTX_SCRIPT, fence).items():
        count = next(i for i, op in enumerate(ops) if op.startswith("atom.global.gpu.acq_rel.add"))
        assert ops[count - 1] == "bar.sync", (name, ops)
        loads = [i for i, op in enumerate(ops) if op.startswith("ld.global.cg")]
        assert loads and min(loads) > count, (name, ops)
        fences = [i for i, op in enumerate(ops) if op == "fence.acq_rel.gpu"]
        if fence:
            assert len(fences) == 1 and count < fences[0] < min(loads), (name, ops)
        else:
            assert not fences, (name, ops)
