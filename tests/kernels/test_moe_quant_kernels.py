"""The fused MoE kernels over quantized experts vs the torch reference on the dequantized
weights: block-FP8 (grouped GEMM and few-token GEMV paths; weight-only, x in fp32/fp16) on CPU
under TRITON_INTERPRET=1, compiled on CUDA. Partial scale blocks along H, experts without
tokens, and another rank's expert ids (skipped)."""

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

from lightwell.kernels.fused_moe import fused_moe, fused_moe_ref  # noqa: E402

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(("tokens", "gemv"), [(1, True), (3, False), (19, False)])
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
