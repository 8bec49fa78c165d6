"""The fused MoE Triton kernel vs its per-pair torch reference (and the torch expert loop the
CPU path runs): on CPU under TRITON_INTERPRET=1, compiled on CUDA. Sizes not multiples of the
tiles, one token, experts without tokens, and ids of another rank's experts (skipped)."""

from __future__ import annotations

import pytest
import torch

from lightwell.kernels.fused_moe import (
    ROW,
    align_by_expert,
    fused_moe,
    fused_moe_ref,
    grouped_tiles,
    grouped_variants,
    pick_block_m,
    w8a8_tiles,
)
from lightwell.layers.moe import moe_loop
from tests.kernels.interpreter import DEVICE

# fp32 on CUDA: tl.dot's default TF32 inputs
TOL = {torch.float32: 1e-4 if DEVICE == "cpu" else 2e-2, torch.float16: 2e-2}


def _case(tokens: int, top_k: int, experts: int, hidden: int, inter: int, dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    scores = torch.rand(tokens, experts, generator=gen)
    weights, ids = scores.topk(top_k, dim=-1)
    return [t.to(DEVICE) for t in (x.to(dtype), w13.to(dtype), w2.to(dtype), weights, ids)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("tokens", [1, 21])
def test_fused_moe_matches_reference(dtype, tokens):
    x, w13, w2, weights, ids = _case(tokens, 2, 5, 48, 40, dtype, seed=tokens)
    tiles = dict(block_m=16, block_n=32, block_k=16) if tokens == 1 else {}  # else: defaults
    got = fused_moe(x, w13, w2, weights, ids, gemv=False, **tiles)  # grouped, even at 1 token
    want = fused_moe_ref(x, w13, w2, weights, ids)
    err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
    assert err < TOL[dtype]
    if dtype == torch.float32:  # the CPU path's loop agrees too
        loop = moe_loop(x, w13, w2, weights, ids)
        assert ((loop - want).abs().max() / want.abs().max()).item() < TOL[dtype]


def test_large_blocks_for_many_tokens_an_expert():
    """More than 128 pairs an expert: 128-row blocks and their tiles (16-bit unquantized
    experts), checked against the reference at those tiles."""
    assert [pick_block_m(n, False) for n in (1, 16, 17, 64, 65, 128, 129)] == [
        16, 16, 32, 32, 64, 64, 128,
    ]  # fmt: skip
    assert pick_block_m(500, True) == 64
    assert grouped_tiles(128) == (128, 64, 8, 3)
    x, w13, w2, weights, ids = _case(150, 2, 2, 48, 40, torch.float16, seed=9)
    got = fused_moe(x, w13, w2, weights, ids, gemv=False).float()  # 150 pairs each: 128 rows
    want = fused_moe_ref(x, w13, w2, weights, ids).float()
    assert ((got - want).abs().max() / want.abs().max()).item() < TOL[torch.float16]


def test_warm_up_covers_every_tile_a_step_can_pick():
    """Start-up compiles ``grouped_variants``: every (row block, tile) a step picks is among
    them, for fp8 activations (``w8a8_tiles``) and for the other experts (row blocks)."""
    keys = ("block_m", "block_n", "block_k", "num_warps", "num_stages")
    for rows, count in ((True, 2), (False, 3)):
        quant = {"w8a8": True, "scales": (None, None, ROW if rows else (128, 128))}
        variants = grouped_variants(quant, torch.bfloat16)
        picked = {w8a8_tiles(n, rows) for n in (0.5, 8, 9, 16, 32, 33, 100, 256, 257, 5000)}
        assert {tuple(v[k] for k in keys) for v in variants} == picked and len(picked) == count
    blocks = lambda quant: [v["block_m"] for v in grouped_variants(quant, torch.bfloat16)]  # noqa: E731
    assert blocks({}) == [16, 32, 64, 128]  # 16-bit experts: pick_block_m's four sizes
    assert blocks({"scales": object()}) == [16, 32, 64] == blocks({"int4": object()})
    assert [v["block_m"] for v in grouped_variants({}, torch.float32)] == [16, 32, 64]


@pytest.mark.parametrize("group_m", [1, 2, 64])
def test_program_groups_and_added_output(group_m):
    """However many row blocks a program group spans (1: each block's column tiles in turn;
    2, with a partial last group; 64: more than there are blocks, every block of a column tile
    first), the grouped kernels give the reference, and ``add`` is added to it once."""
    x, w13, w2, weights, ids = _case(21, 2, 3, 48, 40, torch.float32, seed=4)
    add = torch.randn(21, 48, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    tiles = dict(block_m=16, block_n=16, block_k=16, group_m=group_m)  # 3 column tiles
    got = fused_moe(x, w13, w2, weights, ids, gemv=False, add=add, **tiles)
    want = fused_moe_ref(x, w13, w2, weights, ids) + add
    assert ((got - want).abs().max() / want.abs().max()).item() < TOL[torch.float32]


@pytest.mark.parametrize("gemv", [False, True], ids=["grouped", "gemv"])
def test_other_ranks_experts_are_skipped(gemv):
    """Expert parallelism: ids shifted by a rank's first expert, out-of-range ones skipped;
    the two ranks' outputs add up to the whole (grouped kernels, and moe_gemv.py's)."""
    x, w13, w2, weights, ids = _case(9, 2, 4, 32, 24, torch.float32, seed=3)
    whole = fused_moe_ref(x, w13, w2, weights, ids)
    parts = [
        fused_moe(
            x,
            w13[s : s + 2].contiguous(),
            w2[s : s + 2].contiguous(),
            weights,
            ids - s,
            block_m=16,
            block_n=32,
            block_k=16,
            gemv=gemv,
            gemv_configs=((16, 16, 1, 1), (16, 16, 1, 1)),
        )  # fmt: skip
        for s in (0, 2)
    ]
    assert ((parts[0] + parts[1] - whole).abs().max() / whole.abs().max()).item() < TOL[x.dtype]


def test_align_by_expert_groups_and_pads():
    ids = torch.tensor([[2, 0], [2, 5], [0, 2]], device=DEVICE)  # 5: not this rank's (4 experts)
    sorted_ids, block_expert = align_by_expert(ids, num_experts=4, block_m=4)
    pad = ids.numel()
    blocks = sorted_ids.view(-1, 4).tolist()
    assert block_expert.tolist()[:2] == [0, 2] and set(block_expert.tolist()[2:]) == {-1}
    assert blocks[0] == [1, 4, pad, pad]  # expert 0: pairs (0, 1) and (2, 0)
    assert blocks[1] == [0, 2, 5, pad]  # expert 2: pairs (0, 0), (1, 0), (2, 1)
    assert all(v == pad for row in blocks[2:] for v in row)


@pytest.mark.parametrize("method", ["none", "fp8_block32"])
def test_moe_block_start_up_compiles_every_grouped_variant(monkeypatch, method):
    """``MoEBlock.compile_kernel_variants`` launches the grouped path once at each of
    ``grouped_variants``' tiles for its experts' kernel inputs (w8a8 tiles for block-FP8
    experts), then the few-token path: recorded through the experts' ``apply``."""
    from types import SimpleNamespace

    from lightwell.layers.moe import FusedMoE
    from lightwell.models.moe_blocks import MoEBlock
    from lightwell.quant.fp8 import Fp8BlockMethod

    quant_method = Fp8BlockMethod(16, 32) if method == "fp8_block32" else None
    experts = FusedMoE(4, 64, 64, quant_method)
    calls = []
    monkeypatch.setattr(FusedMoE, "cuda_graph_safe", property(lambda self: True))
    monkeypatch.setattr(
        experts.quant_method, "apply", lambda layer, x, w, ids, **kw: calls.append(kw)
    )
    block = SimpleNamespace(experts=experts, router=SimpleNamespace(top_k=2),
                            gate=SimpleNamespace(weight=torch.empty(4, 64)))  # fmt: skip
    launches = MoEBlock.compile_kernel_variants(block)
    want = grouped_variants(experts.quant_method.kernel_inputs(experts)[2], experts.act_dtype)
    grouped = [{k: v for k, v in kw.items() if k != "gemv"} for kw in calls if "gemv" in kw]
    assert grouped == want and launches == len(calls) == len(want) + 2
    if method == "fp8_block32":
        assert {v["block_m"] for v in want} == {16, 32, 64} and all(
            v["block_k"] == 128 for v in want
        )
