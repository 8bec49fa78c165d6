"""The fused MoE router (lightwell/kernels/moe_router.py) vs the torch reference
(lightwell/layers/moe.py's ``select_experts_ref``): on CPU under TRITON_INTERPRET=1 (fp32/fp16
logits), compiled on CUDA. Every family's rule (Mixtral, Qwen-MoE with and without
renormalisation, DeepSeek-V2 greedy and group-limited, V3 ``noaux_tc`` with correction bias),
1 to 5 tokens, 8 / 60 / 64 / 160 / 256 experts: the same ids in the same order, weights within
1e-6."""

from __future__ import annotations

import pytest
import torch

from lightwell.kernels.moe_router import moe_router
from lightwell.layers.moe import RouterConfig, select_experts, select_experts_ref
from tests.kernels.interpreter import DEVICE

FP16, FP32 = torch.float16, torch.float32
V2 = RouterConfig(6, False, "softmax", 8, 3, "max", 16.0)  # DeepSeek-V2: group_limited_greedy
V3 = RouterConfig(8, True, "sigmoid", 8, 4, "top2", 2.5)  # DeepSeek-V3: noaux_tc
V3_SMALL = RouterConfig(3, True, "sigmoid", 4, 2, "top2", 1.7)
# name: (tokens, experts, RouterConfig, correction bias, logits dtype)
CASES = {
    "mixtral": (1, 8, RouterConfig(2, renormalize=True), False, FP32),
    "mixtral_fp16": (5, 8, RouterConfig(2, renormalize=True), False, FP16),
    "qwen15_e60": (3, 60, RouterConfig(4), False, FP32),
    "qwen3_renorm": (2, 64, RouterConfig(8, renormalize=True), False, FP16),
    "v2_lite_greedy": (4, 64, RouterConfig(6), False, FP32),
    "v2_group_limited": (3, 160, V2, False, FP32),
    "v3_noaux_tc": (5, 256, V3, True, FP32),
    "v3_noaux_tc_fp16": (2, 256, V3, True, FP16),
    "v3_small_groups": (3, 16, V3_SMALL, True, FP32),
}


def _router_args(router: RouterConfig) -> dict:
    return dict(renormalize=router.renormalize, scoring=router.scoring,
                num_groups=router.num_groups, topk_groups=router.topk_groups,
                group_score=router.group_score, scaling=router.scaling)  # fmt: skip


@pytest.mark.parametrize("name", list(CASES))
def test_router_kernel_matches_torch(name):
    tokens, experts, router, with_bias, dtype = CASES[name]
    gen = torch.Generator().manual_seed(experts + tokens)
    logits = (2 * torch.randn(tokens, experts, generator=gen)).to(dtype).to(DEVICE)
    bias = (0.1 * torch.randn(experts, generator=gen)).to(DEVICE) if with_bias else None
    want_w, want_ids = select_experts_ref(logits, router, bias)
    got_w, got_ids = moe_router(logits, router.top_k, bias, **_router_args(router))
    assert got_ids.dtype == torch.int64 and got_w.dtype == torch.float32
    assert torch.equal(got_ids, want_ids), (got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, atol=1e-6, rtol=1e-6)
    if router.num_groups > 1:  # experts of at most topk_groups groups per token
        groups = got_ids // (experts // router.num_groups)
        assert max(len(set(g.tolist())) for g in groups) <= router.topk_groups


def test_router_kernel_strided_logits_and_no_tokens():
    """A column slice of wider logits (non-unit row stride) and an empty step."""
    router = RouterConfig(2, renormalize=True)
    wide = torch.randn(3, 12, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    logits = wide[:, 2:10]
    got = moe_router(logits, 2, renormalize=True)
    want = select_experts_ref(logits, router)
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=1e-6)
    weights, ids = moe_router(logits[:0], 2)
    assert weights.shape == ids.shape == (0, 2)


def test_router_kernel_refuses_bad_routers():
    logits = torch.randn(2, 12, device=DEVICE)
    with pytest.raises(ValueError, match="groups"):
        moe_router(logits, 2, num_groups=5)
    with pytest.raises(ValueError, match="top_k"):
        moe_router(logits, 5, num_groups=4, topk_groups=1)
    with pytest.raises(ValueError, match="bias"):
        moe_router(logits, 2, torch.zeros(8, device=DEVICE))
    with pytest.raises(ValueError, match="experts"):
        moe_router(torch.randn(1, 2048, device=DEVICE), 2)


def test_select_experts_routes_by_device():
    """``select_experts`` is the torch reference off CUDA, the kernel on it: same result."""
    router = V3_SMALL
    gen = torch.Generator().manual_seed(5)
    logits, bias = torch.randn(4, 16, generator=gen), torch.randn(16, generator=gen)
    want_w, want_ids = select_experts_ref(logits, router, bias)
    got_w, got_ids = select_experts(logits.to(DEVICE), router, bias.to(DEVICE))
    assert torch.equal(got_ids.cpu(), want_ids)
    torch.testing.assert_close(got_w.cpu(), want_w, atol=1e-6, rtol=1e-6)
