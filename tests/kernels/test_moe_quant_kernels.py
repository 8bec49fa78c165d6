"""The fused MoE kernels over quantized experts vs the torch reference on the dequantized
weights: block-FP8 and int4 with group scales and zeros (grouped GEMM and few-token GEMV paths;
weight-only, x in fp32/fp16) on CPU
under TRITON_INTERPRET=1, compiled on CUDA. Partial scale blocks along H, experts without
tokens, and another rank's expert ids (skipped)."""

from __future__ import annotations

import pytest
import torch

from lightwell.kernels.fused_moe import fused_moe, fused_moe_ref
from tests.kernels.interpreter import DEVICE

TOL = {torch.float32: 1e-4 if DEVICE == "cpu" else 2e-2, torch.float16: 2e-2}
BLOCK = (16, 16)


def fp8_experts(e: int, n: int, k: int, gen: torch.Generator):
    """[E, N, K] fp8 with [E, ceil(N / 16), ceil(K / 16)] scales spread over two decades."""
    q = (torch.randn(e, n, k, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = 10 ** (torch.rand(e, -(-n // BLOCK[0]), -(-k // BLOCK[1]), generator=gen) * 2 - 2)
    return q, (s / (100 * k**0.5)).float()


def _case(tokens, top_k, experts, hidden, inter, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13, s13 = fp8_experts(experts, 2 * inter, hidden, gen)
    w2, s2 = fp8_experts(experts, hidden, inter, gen)
    weights, ids = torch.rand(tokens, experts, generator=gen).topk(top_k, dim=-1)
    move = [t.to(DEVICE) for t in (x, w13, w2, weights, ids, s13, s2)]
    return move[:5], (move[5], move[6], BLOCK)


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
