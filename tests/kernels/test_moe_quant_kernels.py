"""The fused MoE kernels over quantized experts vs the torch reference on the dequantized
weights: block-FP8 and int4 with group scales and zeros (grouped GEMM and few-token GEMV paths;
weight-only, x in fp32/fp16) on CPU
under TRITON_INTERPRET=1, compiled on CUDA. Partial scale blocks along H, experts without
tokens, and another rank's expert ids (skipped)."""

from __future__ import annotations

import pytest
import torch

from lightwell.kernels.fused_moe import ROW, fused_moe, fused_moe_ref
from tests.kernels.interpreter import DEVICE

TOL = {torch.float32: 1e-4 if DEVICE == "cpu" else 2e-2, torch.float16: 2e-2}
BLOCK = (16, 16)


def fp8_experts(e: int, n: int, k: int, gen: torch.Generator, block=BLOCK):
    """[E, N, K] fp8 with [E, ceil(N / bn), ceil(K / bk)] scales spread over two decades."""
    q = (torch.randn(e, n, k, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = 10 ** (torch.rand(e, -(-n // block[0]), -(-k // block[1]), generator=gen) * 2 - 2)
    return q, (s / (100 * k**0.5)).float()


def _case(tokens, top_k, experts, hidden, inter, dtype, seed, block=BLOCK):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13, s13 = fp8_experts(experts, 2 * inter, hidden, gen, block)
    w2, s2 = fp8_experts(experts, hidden, inter, gen, block)
    weights, ids = torch.rand(tokens, experts, generator=gen).topk(top_k, dim=-1)
    move = [t.to(DEVICE) for t in (x, w13, w2, weights, ids, s13, s2)]
    return move[:5], (move[5], move[6], block)


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


FP32, FP16 = torch.float32, torch.float16


@pytest.mark.parametrize(
    ("tokens", "gemv", "dtype"), [(1, True, FP32), (3, False, FP16), (19, False, FP32)]
)  # fmt: skip
def test_fp8_experts_match_reference(dtype, tokens, gemv):
    """H = 56: three whole 16-blocks and a partial one; 6 experts, some without tokens."""
    (x, w13, w2, weights, ids), scales = _case(tokens, 2, 6, 56, 32, dtype, seed=tokens)
    configs = ((16, 32, 1, 1), (16, 16, 1, 1))  # GEMV K tiles: 2 slices of a block, 1 block
    got = fused_moe(x, w13, w2, weights, ids, gemv=gemv, gemv_configs=configs, scales=scales,
                    block_m=16, block_n=32)  # fmt: skip
    want = fused_moe_ref(x, w13, w2, weights, ids, scales)
    assert _err(got, want) < TOL[dtype]


@pytest.mark.parametrize("gemv", [False, True], ids=["grouped", "gemv"])
def test_fp8_other_ranks_experts_are_skipped(gemv):
    (x, w13, w2, weights, ids), (s13, s2, block) = _case(5, 2, 4, 32, 16, torch.float32, 3)
    whole = fused_moe_ref(x, w13, w2, weights, ids, (s13, s2, block))
    parts = [
        fused_moe(x, w13[s : s + 2].contiguous(), w2[s : s + 2].contiguous(), weights, ids - s,
                  gemv=gemv, gemv_configs=((16, 16, 1, 1),) * 2,
                  scales=(s13[s : s + 2].contiguous(), s2[s : s + 2].contiguous(), block))
        for s in (0, 2)
    ]  # fmt: skip
    assert _err(parts[0] + parts[1], whole) < TOL[torch.float32]


def test_fp8_experts_without_scales_are_refused():
    (x, w13, w2, weights, ids), _ = _case(2, 2, 4, 32, 16, torch.float32, 4)
    with pytest.raises(ValueError, match="block scales"):
        fused_moe(x, w13, w2, weights, ids)


def _row_scaled_case(tokens: int, seed: int):
    """fp8 experts with one scale a row (H 64, I 48, 5 experts top-2): ([x, w13, w2, weights,
    ids], the scales as [1, 16] blocks, the same as ``ROW`` scales)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, 64, generator=gen)
    w13 = (torch.randn(5, 96, 64, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    w2 = (torch.randn(5, 64, 48, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    r13 = 10 ** (torch.rand(5, 96, generator=gen) * 2 - 2) / 800
    r2 = 10 ** (torch.rand(5, 64, generator=gen) * 2 - 2) / 700
    weights, ids = torch.rand(tokens, 5, generator=gen).topk(2, dim=-1)
    blocks = (r13[..., None].expand(5, 96, 4).contiguous(),
              r2[..., None].expand(5, 64, 3).contiguous(), (1, 16))  # fmt: skip
    move = lambda ts: [t.to(DEVICE) for t in ts]  # noqa: E731
    rows = (*move((r13[..., None], r2[..., None])), ROW)
    return move((x, w13, w2, weights, ids)), (*move(blocks[:2]), blocks[2]), rows


def test_row_scaled_fp8_experts_scale_once():
    """Given ``ROW`` scales, the grouped kernels accumulate over all K tiles (BLOCK_K 16: four
    and three of them) and scale once; the result is the [1, 16]-block path's and the
    reference's; the few-token GEMV path takes ``ROW`` scales too."""
    (x, w13, w2, weights, ids), blocks, rows = _row_scaled_case(11, seed=8)
    tiles = dict(gemv=False, block_m=16, block_n=32, block_k=16)
    want = fused_moe_ref(x, w13, w2, weights, ids, blocks)
    once = fused_moe(x, w13, w2, weights, ids, scales=rows, **tiles)
    per_tile = fused_moe(x, w13, w2, weights, ids, scales=blocks, **tiles)
    assert _err(once, want) < TOL[FP32]
    assert _err(once, per_tile) < TOL[FP32]
    few = fused_moe(x[:1], w13, w2, weights[:1], ids[:1], scales=rows, gemv=True)
    assert _err(few, want[:1]) < TOL[FP32]


def test_row_scaled_fp8_experts_w8a8():
    """w8a8: x and the activation quantized per row to fp8 (act_quant), fp8 dots: equal to the
    reference run on those quantized activations (fp32 products of fp8 values), and within
    fp8's rounding of the weight-only result."""
    from lightwell.kernels.act_quant import act_quant_ref

    (x, w13, w2, weights, ids), blocks, rows = _row_scaled_case(9, seed=9)
    got = fused_moe(x, w13, w2, weights, ids, scales=rows, w8a8=True,
                    gemv=False, block_m=16, block_n=32, block_k=32)  # fmt: skip
    qx, sx = act_quant_ref(x, torch.float8_e4m3fn)
    want = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(2):
            e = int(ids[t, j])
            g, u = ((w13[e].float() * rows[0][e]) @ (qx[t].float() * sx[t])).chunk(2)
            act = torch.nn.functional.silu(g) * u
            qa, sa = act_quant_ref(act[None], torch.float8_e4m3fn)
            down = (w2[e].float() * rows[1][e]) @ (qa[0].float() * sa[0])
            want[t] += float(weights[t, j]) * down
    assert _err(got, want) < TOL[FP32]
    weight_only = fused_moe_ref(x, w13, w2, weights, ids, blocks)
    assert 1e-3 < _err(got, weight_only) < 0.1  # fp8 activations: rounded, not far


def test_block_fp8_experts_w8a8():
    """Block-scaled experts ([16, 32] blocks: an fp8 dot's K on a GPU is 32 or more) with
    w8a8: x and the activation quantized per row and 32 inputs (fp8_groups; H 80: a
    partial last group; I 64: two groups), fp8 dots scaled per K tile by the row's and the
    block's scales: equal
    to the reference on those quantized activations; 16-input blocks are refused on a GPU."""
    from lightwell.kernels.act_quant import fp8_groups
    from lightwell.kernels.fused_moe import dequantize_experts

    def deq(v: torch.Tensor) -> torch.Tensor:  # v [1, K] through fp8 per 32 inputs
        q, scale = fp8_groups(v, 32)
        return q.float() * scale.repeat_interleave(32, 1)[:, : v.shape[1]]

    block = (16, 32)  # I 64: the down kernel's K tiles scaled one by one too
    (x, w13, w2, weights, ids), scales = _case(13, 2, 6, 80, 64, torch.float32, 11, block)
    got = fused_moe(x, w13, w2, weights, ids, scales=scales, w8a8=True, gemv=False,
                    block_m=16, block_n=32)  # fmt: skip
    d13, d2 = (dequantize_experts(w, sc, block) for w, sc in ((w13, scales[0]), (w2, scales[1])))
    want = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(2):
            e = int(ids[t, j])
            g, u = (d13[e] @ deq(x[t : t + 1])[0]).chunk(2)
            down = d2[e] @ deq((torch.nn.functional.silu(g) * u)[None])[0]
            want[t] += float(weights[t, j]) * down
    assert _err(got, want) < TOL[FP32]
    assert 1e-3 < _err(got, fused_moe_ref(x, w13, w2, weights, ids, scales)) < 0.1
    if DEVICE == "cuda":
        (x, w13, w2, weights, ids), sixteen = _case(3, 2, 6, 80, 32, FP32, 12)  # [16, 16]
        with pytest.raises(ValueError, match="w8a8 needs"):
            fused_moe(x, w13, w2, weights, ids, scales=sixteen, w8a8=True, gemv=False)


def test_row_scales_are_checked():
    (x, w13, w2, weights, ids), blocks, (r13, r2, row) = _row_scaled_case(3, seed=10)
    with pytest.raises(ValueError, match="do not fit experts"):
        fused_moe(x, w13, w2, weights, ids, scales=(r13, r2[:, :5].contiguous(), row))
    with pytest.raises(ValueError, match="w8a8 needs"):
        fused_moe(x.to(torch.float16), w13.to(torch.float16), w2.to(torch.float16), weights,
                  ids, w8a8=True)  # fmt: skip


def int4_experts(e: int, n: int, k: int, group: int, dtype, gen: torch.Generator):
    """[E, N, K / 8] random words, [E, N, K / group] scales and zero points (0..15)."""
    words = torch.randint(-(2**31), 2**31 - 1, (e, n, k // 8), generator=gen, dtype=torch.int32)
    scales = (torch.rand(e, n, k // group, generator=gen) + 0.5) / (8 * k**0.5)
    zeros = torch.randint(0, 16, (e, n, k // group), generator=gen).float()
    return words, scales.to(dtype), zeros.to(dtype)


@pytest.mark.parametrize(
    ("tokens", "gemv", "groups", "dtype"),
    [(1, True, (16, 32), FP32), (2, True, (48, 32), FP16), (7, False, (16, 32), FP32),
     (4, False, (48, 16), FP16)],
)  # fmt: skip
def test_int4_experts_match_reference(dtype, tokens, gemv, groups):
    """H = 48, I = 32; groups of 16 / 32 inputs, or one group over H (48: GEMV slices of 16)."""
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 48, generator=gen).to(dtype)
    q13, s13, z13 = int4_experts(5, 64, 48, groups[0], dtype, gen)
    q2, s2, z2 = int4_experts(5, 48, 32, groups[1], dtype, gen)
    weights, ids = torch.rand(tokens, 5, generator=gen).topk(2, dim=-1)
    x, q13, q2, weights, ids, s13, z13, s2, z2 = (
        t.to(DEVICE) for t in (x, q13, q2, weights, ids, s13, z13, s2, z2)
    )
    int4 = (s13, z13, s2, z2, *groups)
    configs = ((32, 32, 1, 1), (64, 16, 1, 1))  # few programs: the interpreter is slow
    got = fused_moe(x, q13, q2, weights, ids, gemv=gemv, gemv_configs=configs, int4=int4,
                    block_m=16, block_n=64)  # fmt: skip
    want = fused_moe_ref(x, q13, q2, weights, ids, int4=int4)
    assert _err(got, want) < TOL[dtype]


@pytest.mark.parametrize("key", ["fp8_block16", "gptq_g16_asym"])
def test_loaded_layers_feed_the_kernels(key):
    """A FusedMoE loaded from per-expert checkpoint tensors (tests/models/quant_pack.py's
    published layouts) and converted after loading: its ``kernel_inputs`` run through the
    kernels give its CPU path's output (grouped at 5 tokens, GEMV at 1). AWQ and
    compressed-tensors experts convert to GPTQ's layout (tests/models/test_moe_quant.py)."""
    from tests.models.test_moe_quant import SPLITS, _expert_checkpoint, method_of

    fmt, make = SPLITS[key]
    layer = _load_layer(method_of(fmt), _expert_checkpoint(make, size=32)[0])
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(5, 32, generator=gen)
    weights, ids = torch.rand(5, 4, generator=gen).topk(2, dim=-1)
    want = layer(x, weights, ids)  # the CPU loop, each used expert dequantized
    w13, w2, quant = layer.quant_method.kernel_inputs(layer)
    w13, w2, x, weights, ids = (t.to(DEVICE) for t in (w13, w2, x, weights, ids))
    on_device = lambda v: tuple(t.to(DEVICE) if torch.is_tensor(t) else t for t in v)  # noqa: E731
    quant = {k: on_device(v) if isinstance(v, tuple) else v for k, v in quant.items()}
    want = want.to(DEVICE)
    tiles = dict(block_m=16, block_n=32, gemv_configs=((16, 32, 1, 1), (16, 32, 1, 1)))
    got = fused_moe(x, w13, w2, weights, ids, gemv=False, **quant, **tiles)
    assert _err(got, want) < TOL[FP32]
    got = fused_moe(x[:1], w13, w2, weights[:1], ids[:1], gemv=True, **quant, **tiles)
    assert _err(got, want[:1]) < TOL[FP32]


def _load_layer(method, tensors):
    from lightwell.layers.moe import FusedMoE

    layer = FusedMoE(4, 32, 32, method)
    for (shard, e, kind), t in tensors.items():
        if kind in layer.quant_method.checkpoint_tensors:
            param = getattr(layer, f"{'w2' if shard == 'down' else 'w13'}_{kind}")
            param.weight_loader(param, t, shard, e)
    layer.quant_method.process_after_loading(layer)
    return layer


@pytest.mark.skipif(DEVICE == "cpu", reason="the experts' kernel form is made on CUDA only")
def test_fp8_row_scaled_layer_runs_w8a8_when_grouped():
    """``--quantization fp8`` experts on a GPU: the grouped path gets their row scales and fp8
    activations (within fp8's rounding of the CPU path's weight-only result), the GEMV path
    them too (weight-only: as close as the CPU path's)."""
    from lightwell.layers.moe import FusedMoE
    from lightwell.quant.fp8 import Fp8W8A8Method

    gen = torch.Generator().manual_seed(12)
    layer = FusedMoE(4, 64, 48, Fp8W8A8Method())
    for name in ("w13_weight", "w2_weight"):
        getattr(layer, name).data.copy_(torch.randn(getattr(layer, name).shape, generator=gen) / 8)
    cpu = FusedMoE(4, 64, 48, Fp8W8A8Method())
    cpu.load_state_dict(layer.state_dict())
    cpu.quant_method.process_after_loading(cpu)
    layer = layer.to(DEVICE)
    layer.quant_method.process_after_loading(layer)
    quant = layer.quant_method.kernel_inputs(layer)[2]
    assert quant["w8a8"] and quant["scales"][2] == ROW
    x = torch.randn(40, 64, generator=gen)
    weights, ids = torch.rand(40, 4, generator=gen).topk(2, dim=-1)
    want = cpu(x, weights, ids)
    got = layer(x.to(DEVICE), weights.to(DEVICE), ids.to(DEVICE)).cpu()
    assert 1e-3 < _err(got, want) < 0.1
    few = layer(x[:1].to(DEVICE), weights[:1].to(DEVICE), ids[:1].to(DEVICE)).cpu()
    assert _err(few, want[:1]) < TOL[FP32]


_SM90_SCRIPT = """
import json
from benchmarks.kernels.moe_quant_compile import compile_kernel, variants
sizes = {label: compile_kernel(fn, types, consts, warps, stages)
         for label, fn, types, consts, warps, stages in variants()
         if label.startswith("fp8-") and " grouped " in label}
print(json.dumps(sizes))
"""


def test_fp8_grouped_kernel_variants_compile_for_sm90():
    """What the interpreter does not check: the row-scaled and fp8-activation variants of the
    grouped kernels compile for sm_90 (Triton's typing of constexpr branches, fp8 dots), the
    latter at every tile a step can pick."""
    from tests.kernels.test_triton_kernels import _run_ptx_script

    sizes = _run_ptx_script(_SM90_SCRIPT, True)
    # fp8-rows: 1 tile; fp8-rows-w8a8: w8a8_tiles' 2; fp8-w8a8: its 3; gate/up and down each
    assert len(sizes) == 2 * (1 + 2 + 3) and all(size > 0 for size in sizes.values()), sizes


@pytest.mark.parametrize("bk", [16, 32])
def test_block_fp8_experts_take_w8a8_when_fp8_dots_can(bk):
    """A loaded block-FP8 expert layer asks for fp8 activations when its bk allows fp8 dots
    on a GPU (32 or more); the grouped path on them stays within fp8's rounding of the CPU
    path (weight-only), the few-token path as close as weight-only kernels are."""
    from lightwell.layers.moe import FusedMoE
    from lightwell.quant.fp8 import Fp8BlockMethod

    gen = torch.Generator().manual_seed(13)
    layer = FusedMoE(4, 64, 64, Fp8BlockMethod(16, bk))
    for name in ("w13", "w2"):
        w = getattr(layer, f"{name}_weight")
        w.data.copy_((torch.randn(w.shape, generator=gen) * 100).clamp(-448, 448).to(w.dtype))
        s = getattr(layer, f"{name}_weight_scale_inv")
        s.data.copy_(torch.rand(s.shape, generator=gen) * 1e-3 + 5e-4)
    layer.quant_method.process_after_loading(layer)
    w13, w2, quant = layer.quant_method.kernel_inputs(layer)
    assert quant["w8a8"] == (bk >= 32)
    x = torch.randn(20, 64, generator=gen)
    weights, ids = torch.rand(20, 4, generator=gen).topk(2, dim=-1)
    want = layer(x, weights, ids)  # the CPU loop, weight-only
    on = lambda *ts: [t.to(DEVICE) for t in ts]  # noqa: E731
    quant = {**quant, "scales": (*on(*quant["scales"][:2]), quant["scales"][2])}
    got = fused_moe(*on(x, w13, w2, weights, ids), gemv=False, **quant).cpu()
    assert (1e-3 < _err(got, want) < 0.1) if bk >= 32 else _err(got, want) < TOL[FP32]
