"""The few-token MoE GEMV kernels (lightwell/kernels/moe_gemv.py) vs the fused MoE's per-pair
torch reference: on CPU under TRITON_INTERPRET=1 (fp32/fp16), compiled on CUDA. 1 to 4 tokens,
top-1/2/6 of 8 or 64 experts, sizes not multiples of the tiles (masked K and clamped rows),
ids of other ranks' experts (skipped), and fused_moe's routing to this path."""

from __future__ import annotations

import pytest
import torch

from lightwell.kernels.fused_moe import fused_moe, fused_moe_ref
from lightwell.kernels.moe_gemv import moe_gemv
from lightwell.kernels.moe_gemv_rule import use_gemv
from tests.kernels.interpreter import DEVICE

TOL = {torch.float32: 1e-4, torch.float16: 2e-2}
FP16 = torch.float16


def _case(tokens: int, top_k: int, experts: int, hidden: int, inter: int, dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    scores = torch.rand(tokens, experts, generator=gen)
    weights, ids = scores.topk(top_k, dim=-1)
    return [t.to(DEVICE) for t in (x.to(dtype), w13.to(dtype), w2.to(dtype), weights, ids)]


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


# (tokens, top_k, experts, hidden, inter, dtype, (gate_up config, down config) or None)
CASES = [
    (1, 1, 8, 48, 40, torch.float32, ((16, 16, 1, 1), (32, 16, 1, 1))),  # even K, masked K
    (1, 2, 8, 40, 24, FP16, ((1, 32, 2, 1), (8, 8, 1, 1))),  # masked H, even I
    (2, 2, 8, 48, 24, torch.float32, None),  # default tiles
    (3, 6, 64, 24, 20, torch.float32, ((8, 16, 1, 1), (16, 8, 1, 1))),
    (4, 6, 64, 24, 20, FP16, ((8, 32, 1, 1), (8, 32, 4, 1))),
    (4, 2, 8, 32, 40, torch.float32, ((16, 32, 1, 1), (4, 64, 1, 1))),  # 16 + 32 K tiles
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}k{c[1]}E{c[2]}")
def test_moe_gemv_matches_reference(case):
    tokens, top_k, experts, hidden, inter, dtype, configs = case
    x, w13, w2, weights, ids = _case(tokens, top_k, experts, hidden, inter, dtype, seed=tokens)
    got = moe_gemv(x, w13, w2, weights, ids, *(configs or (None, None)))
    assert got.shape == x.shape and got.dtype == dtype
    assert _rel_err(got, fused_moe_ref(x, w13, w2, weights, ids)) < TOL[dtype]


def test_other_ranks_experts_are_skipped_and_weighted():
    """Ids below 0 or past E contribute nothing (a token with none of its experts here gives
    zeros); the router weights scale each pair (doubling one pair's weight adds its term)."""
    x, w13, w2, weights, ids = _case(3, 2, 8, 24, 20, torch.float32, seed=5)
    ids = torch.tensor([[3, -2], [9, 8], [5, 3]], device=DEVICE)
    configs = ((8, 16, 1, 1), (16, 16, 1, 1))
    got = moe_gemv(x, w13, w2, weights, ids, *configs)
    want = fused_moe_ref(x, w13, w2, weights, ids)
    assert _rel_err(got, want) < TOL[x.dtype]
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    doubled = weights.clone()
    doubled[0, 0] *= 2
    alone = fused_moe_ref(x[:1], w13, w2, weights[:1, :1], ids[:1, :1])  # [1, H]
    gain = moe_gemv(x, w13, w2, doubled, ids, *configs) - got
    assert _rel_err(gain[:1], alone) < TOL[x.dtype]


def test_fused_moe_routes_few_tokens_to_gemv():
    x, w13, w2, weights, ids = _case(2, 2, 8, 24, 20, torch.float32, seed=7)
    assert use_gemv(1, 2, 8) and use_gemv(4, 2, 8) and not use_gemv(8, 2, 8)
    assert use_gemv(8, 6, 64) and not use_gemv(9, 1, 64) and not use_gemv(0, 2, 8)
    routed = fused_moe(x, w13, w2, weights, ids)
    assert torch.equal(routed, moe_gemv(x, w13, w2, weights, ids))
    grouped = fused_moe(x, w13, w2, weights, ids, gemv=False, block_m=16, block_n=16, block_k=16)
    # the grouped kernels' fp32 dots run in tf32 on a GPU (the GEMV's products stay fp32)
    assert _rel_err(routed, grouped) < (TOL[x.dtype] if DEVICE == "cpu" else 1e-2)


@pytest.mark.parametrize(
    "dtype,tokens,shared",
    [(torch.float32, 2, 2), (FP16, 2, 2), (torch.float32, 1, 1), (FP16, 2, 3)],
)
def test_shared_experts_ride_in_the_routed_launches(dtype, tokens, shared):
    """``num_shared`` S: the last S experts of the stack are every token's, weight 1, after
    its k routed ones (ids hold only the routed): the same as the reference over the ids and
    weights extended by them, and as the routed result plus each shared expert alone; the
    gate/up row blocks do not divide I (clamped rows)."""
    from lightwell.kernels.fused_moe import with_shared

    experts = 8 + shared  # routed experts 0-7, then the shared ones
    x, w13, w2, weights, ids = _case(tokens, 2, experts, 40, 24, dtype, seed=11 + shared)
    ids = ids % 8
    configs = ((16, 16, 1, 1), (16, 16, 1, 1))
    got = fused_moe(x, w13, w2, weights, ids, gemv_configs=configs, num_shared=shared)
    wide_w, wide_ids = with_shared(weights, ids, experts, shared)
    assert wide_ids[:, 2:].tolist() == [list(range(8, experts))] * tokens
    assert wide_w[:, 2:].eq(1).all()
    want = fused_moe_ref(x, w13, w2, wide_w, wide_ids)
    assert _rel_err(got, want) < TOL[dtype]
    assert torch.equal(fused_moe_ref(x, w13, w2, weights, ids, num_shared=shared), want)
    routed = fused_moe_ref(x, w13, w2, weights, ids)
    ones = torch.ones(tokens, 1, device=DEVICE)
    alone = [
        fused_moe_ref(x, w13, w2, ones, torch.full_like(ids[:, :1], e)).float()
        for e in range(8, experts)
    ]
    assert _rel_err(got, routed.float() + sum(alone)) < TOL[dtype]
    assert not use_gemv(3, 2 + 2, 10)  # more pairs than experts: the grouped path refuses
    with pytest.raises(ValueError, match="GEMV path only"):
        fused_moe(x, w13, w2, weights, ids, gemv=False, num_shared=shared)


@pytest.mark.parametrize("tokens,shared", [(1, 2), (2, 0), (3, 1), (5, 3)])
def test_gate_up_early_shared_tiles_give_the_same_bits(tokens, shared):
    """PDL's form of the gate/up kernel (the shared experts' programs load their first K tile
    before the wait; routed programs after it) gives the plain form's bits: tiles that divide
    neither I (clamped rows) nor H (masked K), and one that holds H in its first tile; with
    no shared experts, other ranks' expert ids among the routed (their rows left unset)."""
    from lightwell.kernels.moe_gemv import moe_gemv_gate_up

    experts = 8 + shared
    x, w13, _, _, ids = _case(tokens, 2, experts, 40, 24, FP16, seed=tokens * 10 + shared)
    ids = ids % 8
    if not shared:
        ids[0, 1], ids[-1, 0] = -1, experts  # another rank's experts: skipped
    for config in ((16, 16, 1, 1), (8, 64, 2, 1)):
        early = moe_gemv_gate_up(x, w13, ids, config, shared, pdl=True)
        plain = moe_gemv_gate_up(x, w13, ids, config, shared, pdl=False)
        pairs = torch.arange(early.shape[0], device=DEVICE).view(tokens, 2 + shared)
        live = torch.cat([(ids >= 0) & (ids < experts), pairs[:, 2:] >= 0], dim=1).view(-1)
        assert torch.equal(early[live], plain[live]), config


def test_fused_moe_folds_shared_experts_exactly_where_the_gemv_path_runs():
    """``FusedMoE.folds_shared`` asks ``use_gemv`` with its shared experts as extra choices."""
    from lightwell.layers.moe import FusedMoE

    for experts, top_k, shared in ((64, 6, 2), (8, 2, 2), (4, 2, 1), (256, 8, 1)):
        moe = FusedMoE(experts, 16, 8, num_shared=shared)
        for tokens in range(0, 12):
            want = use_gemv(tokens, top_k + shared, experts + shared)
            assert moe.folds_shared(tokens, top_k) == want, (experts, top_k, shared, tokens)


@pytest.mark.parametrize("inter", [44, 64])  # 64: tiles whose BLOCK_K divides I (EVEN_K)
@pytest.mark.parametrize("dtype", [torch.float32, FP16])
@pytest.mark.parametrize("tokens", [1, 2])
def test_down_split_and_pairs_tile_match_the_loop(tokens, dtype, inter):
    """``_moe_gemv_down_split`` (a program per pair, the last of a row block adding the
    partials) and ``_moe_gemv_down_pairs`` (every pair of a token in one tile) against the
    reference and the loop over pairs: shared experts, an id of another rank, I not a multiple
    of BLOCK_K (or a multiple), H not of BLOCK_N, k + S not a power of two; the other rank's
    pair's act row (never written by the gate/up kernel) holds NaN and must not leak in. The
    split kernel is deterministic and leaves its counters at zero."""
    from lightwell.kernels.fused_moe import with_shared
    from lightwell.kernels.moe_gemv import PAIRS_TILE_CONFIG, moe_gemv_down, split_config, use_split
    from lightwell.kernels.split_counters import split_counters

    assert use_split(1, 8) and use_split(2, 4)
    assert not use_split(4, 8) and not use_split(1, 2)  # Mixtral's 2 pairs: the loop
    x, w13, w2, weights, ids = _case(tokens, 4, 12, 40, inter, dtype, seed=13)
    ids = ids % 9
    ids[0, 1] = 17  # another rank's expert: skipped
    act = torch.randn(tokens * (4 + 3), inter, device=DEVICE).to(dtype)  # k + S = 7 a token
    act[1] = float("nan")  # token 0's pair 1 (the other rank's): a row left unwritten
    wide_w, wide_ids = with_shared(weights, ids, 12, 3)
    want = torch.zeros(tokens, 40)
    for t in range(tokens):
        for j in range(7):
            e = int(wide_ids[t, j])
            if 0 <= e < 12:
                row = act[t * 7 + j].float().cpu()
                want[t] += float(wide_w[t, j]) * (w2[e].float().cpu() @ row)
    loop = moe_gemv_down(act, w2, weights, ids, (16, 16, 1, 1), 3, kernel="loop")
    for kernel, config in (("pairs", (4, 32, 2, 1)), ("pairs", PAIRS_TILE_CONFIG),
                           ("split", (16, 16, 1, 1)), ("split", (4, 32, 2, 1)),
                           ("split", split_config(tokens))):  # fmt: skip
        got = moe_gemv_down(act, w2, weights, ids, config, 3, kernel=kernel)
        assert _rel_err(got.cpu(), want) < TOL[dtype], (kernel, config)
        assert _rel_err(got, loop) < TOL[dtype], (kernel, config)
        again = moe_gemv_down(act, w2, weights, ids, config, 3, kernel=kernel)
        assert torch.equal(again, got), (kernel, config)
        assert not split_counters(got.device, 1).any(), (kernel, config)
    split = moe_gemv_down(act, w2, weights, ids, split_config(tokens), 3, kernel="split")
    assert torch.equal(moe_gemv_down(act, w2, weights, ids, None, 3), split)  # the default
    assert torch.equal(moe_gemv_down(act, w2, weights, ids, (16, 16, 1, 1), 3), loop)  # a tile
