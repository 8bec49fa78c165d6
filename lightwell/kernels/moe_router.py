"""The MoE router's expert choice in one launch: one program per token, all in fp32 registers.

Per token, over its E router logits laid out as a ``[groups, E / groups]`` tile (padded to
powers of two, padding at -inf):
  1. scores: softmax over the E logits, or their sigmoid;
  2. choice = scores + correction bias (the bias steers the choice only);
  3. group limit (``num_groups`` > 1): a group's score is its best choice value (``max``) or the
     sum of its best two (``top2``); experts outside the ``topk_groups`` best groups drop to -inf;
  4. top-k: k rounds of max, the lowest expert id winning ties, the winner masked out;
  5. weights: the unbiased scores of the winners, divided by their sum (+1e-20) if
     ``renormalize``, times ``scaling``.
Writes weights [T, k] fp32 and ids [T, k] int64, in the order of the choice (best first), as
the torch reference (lightwell/layers/moe.py's ``select_experts_ref``) does. No host sync,
shapes fixed by T: CUDA-graph safe. The routing rules per family are in layers/moe.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lightwell.kernels import pdl as _pdl
from lightwell.kernels.pdl_sync import signal_then_wait

# The widest router this kernel takes (DeepSeek-V3 has 256 experts).
MAX_EXPERTS = 1024
_NO_EXPERT = tl.constexpr(1 << 20)  # the id of the padding: above every expert, loses ties


@triton.jit
def _moe_router_kernel(
    logits_ptr,  # [T, E]
    bias_ptr,  # [E] correction bias (read only if HAS_BIAS)
    weights_ptr,  # [T, k] fp32
    ids_ptr,  # [T, k] int64
    stride_t, group_size, scaling,
    TOP_K: tl.constexpr, BLOCK_KP: tl.constexpr,
    NUM_GROUPS: tl.constexpr, TOPK_GROUPS: tl.constexpr, TOP2_GROUPS: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_EG: tl.constexpr,
    SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr,
    GDC: tl.constexpr,  # launched with PDL: signal, then wait for the logits' kernel
):  # fmt: skip
    signal_then_wait(GDC)  # the gate/up kernel's shared experts load under this one
    token = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, BLOCK_G)[:, None]  # [BG, 1]
    j = tl.arange(0, BLOCK_EG)[None, :]  # [1, BEG]
    expert = g * group_size + j  # [BG, BEG]
    valid = (g < NUM_GROUPS) & (j < group_size)
    x = tl.load(logits_ptr + token * stride_t + expert, mask=valid, other=float("-inf"))
    x = x.to(tl.float32)
    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-x))
    else:
        p = tl.exp(x - tl.max(tl.max(x, axis=1), axis=0))  # padding: exp(-inf) = 0
        scores = p / tl.sum(tl.sum(p, axis=1), axis=0)
    choice = scores
    if HAS_BIAS:
        choice += tl.load(bias_ptr + expert, mask=valid, other=0.0).to(tl.float32)
    choice = tl.where(valid, choice, float("-inf"))
    if NUM_GROUPS > 1:
        choice = _limit_groups(choice, j, TOPK_GROUPS, TOP2_GROUPS, BLOCK_G, BLOCK_EG)
    expert = tl.where(valid, expert, _NO_EXPERT)
    slot = tl.arange(0, BLOCK_KP)
    top_w = tl.zeros([BLOCK_KP], dtype=tl.float32)
    top_ids = tl.zeros([BLOCK_KP], dtype=tl.int64)
    for i in tl.static_range(TOP_K):
        best = tl.max(tl.max(choice, axis=1), axis=0)
        winner = tl.min(tl.min(tl.where(choice == best, expert, _NO_EXPERT), axis=1), axis=0)
        hit = expert == winner
        w = tl.sum(tl.sum(tl.where(hit, scores, 0.0), axis=1), axis=0)
        top_w = tl.where(slot == i, w, top_w)
        top_ids = tl.where(slot == i, winner.to(tl.int64), top_ids)
        choice = tl.where(hit, float("-inf"), choice)
    if RENORMALIZE:
        top_w = top_w / (tl.sum(top_w, axis=0) + 1e-20)
    out = token * TOP_K + slot
    tl.store(weights_ptr + out, top_w * scaling, mask=slot < TOP_K)
    tl.store(ids_ptr + out, top_ids, mask=slot < TOP_K)


@triton.jit
def _limit_groups(
    choice,  # [BG, BEG], -inf on padding
    j,  # [1, BEG] position in the group
    TOPK_GROUPS: tl.constexpr, TOP2_GROUPS: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_EG: tl.constexpr,
):  # fmt: skip
    """``choice`` with the experts outside the ``TOPK_GROUPS`` best groups set to -inf."""
    first = tl.max(choice, axis=1)  # [BG]
    group_scores = first
    if TOP2_GROUPS:
        at = tl.min(tl.where(choice == first[:, None], j, BLOCK_EG), axis=1)  # [BG]
        second = tl.max(tl.where(j == at[:, None], float("-inf"), choice), axis=1)
        group_scores = first + second
    gid = tl.arange(0, BLOCK_G)
    keep = gid < 0  # [BG] all False
    for _ in tl.static_range(TOPK_GROUPS):
        best = tl.max(group_scores, axis=0)
        winner = tl.min(tl.where(group_scores == best, gid, BLOCK_G), axis=0)
        keep = keep | (gid == winner)
        group_scores = tl.where(gid == winner, float("-inf"), group_scores)
    return tl.where(keep[:, None], choice, float("-inf"))


def _check(
    logits: torch.Tensor, top_k: int, num_groups: int, topk_groups: int, bias: torch.Tensor | None
) -> None:
    if logits.dim() != 2:
        raise ValueError(f"router logits must be [T, E], not {tuple(logits.shape)}")
    num_experts = logits.shape[1]
    if not 0 < num_experts <= MAX_EXPERTS:
        raise ValueError(f"the router kernel takes 1 to {MAX_EXPERTS} experts, not {num_experts}")
    if num_groups < 1 or num_experts % num_groups or not 0 < topk_groups <= num_groups:
        raise ValueError(
            f"bad expert groups: {num_experts} experts, {num_groups} groups, top {topk_groups}"
        )
    if not 0 < top_k <= topk_groups * (num_experts // num_groups):
        raise ValueError(f"top_k {top_k} does not fit the {num_experts} experts allowed")
    if bias is not None and bias.shape != (num_experts,):
        raise ValueError(f"correction bias must be [{num_experts}], not {tuple(bias.shape)}")


def moe_router(
    logits: torch.Tensor,  # [T, E] router logits, any float dtype
    top_k: int,
    correction_bias: torch.Tensor | None = None,  # [E]: added for the choice only
    *,
    renormalize: bool = False,
    scoring: str = "softmax",  # or "sigmoid"
    num_groups: int = 1,
    topk_groups: int = 1,
    group_score: str = "max",  # or "top2"
    scaling: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, k] float32 weights, [T, k] int64 expert ids)
    """The routing of lightwell/layers/moe.py's ``select_experts_ref`` (its torch reference;
    the arguments are ``RouterConfig``'s fields) in one launch."""
    if scoring not in ("softmax", "sigmoid") or group_score not in ("max", "top2"):
        raise ValueError(f"bad router: scoring {scoring!r}, group score {group_score!r}")
    _check(logits, top_k, num_groups, topk_groups, correction_bias)
    num_tokens, num_experts = logits.shape
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=logits.device)
    if num_tokens == 0:
        return weights, ids
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    group_size = num_experts // num_groups
    bias = correction_bias.contiguous() if correction_bias is not None else weights
    _moe_router_kernel[(num_tokens,)](
        logits, bias, weights, ids, logits.stride(0), group_size, float(scaling),
        TOP_K=top_k, BLOCK_KP=triton.next_power_of_2(top_k),
        NUM_GROUPS=num_groups, TOPK_GROUPS=topk_groups, TOP2_GROUPS=group_score == "top2",
        BLOCK_G=triton.next_power_of_2(num_groups),
        BLOCK_EG=triton.next_power_of_2(group_size),
        SIGMOID=scoring == "sigmoid", HAS_BIAS=correction_bias is not None,
        RENORMALIZE=renormalize,  num_warps=1 if num_experts <= 64 else 2,
        **_pdl.kernel_args(logits.device),
    )  # fmt: skip
    return weights, ids
