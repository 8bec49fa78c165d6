"""Mixture of experts: the router's expert choice and the experts stacked in two weights.

``FusedMoE`` holds every expert's gate/up projection as one ``w13_weight`` [E, 2 * I, H]
(gate rows first) and its down projection as ``w2_weight`` [E, H, I]. Its ``weight_loader``
takes HF's per-expert tensors (``experts.{e}.gate_proj`` ...) with ``(shard, expert)``.

Parallelism, over the tensor-parallel ranks (every rank sees every token, as in the attention):
  - tensor parallel (default): each rank holds a slice ``I / tp`` of every expert;
  - expert parallel (``--enable-expert-parallel``): each rank holds ``E / tp`` whole experts.
Either way a rank's output is a partial sum over its slices / experts; the caller all-reduces it
with the rest of the layer's partial sums (tokens need no dispatch: every rank already has them).

``select_experts`` implements the routing rules of the supported families: softmax top-k with
or without renormalisation (Mixtral, Qwen MoE, DeepSeek-V2 greedy), group-limited top-k
(DeepSeek-V2), and sigmoid scores with a correction bias over the best groups (DeepSeek-V3's
``noaux_tc``), times a routed scaling factor: in one launch on CUDA
(kernels/moe_router.py), in torch ops elsewhere (``select_experts_ref``, the kernel's reference).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lightwell.distributed.parallel_state import get_expert_parallel, get_tp_rank, get_tp_size
from lightwell.layers.linear import divide

SHARDS = {"gate": 0, "up": 1, "down": 2}


@dataclass(frozen=True)
class RouterConfig:
    top_k: int
    renormalize: bool = False  # divide the chosen weights by their sum
    scoring: str = "softmax"  # or "sigmoid" (DeepSeek-V3)
    num_groups: int = 1  # expert groups (DeepSeek); 1: no group limit
    topk_groups: int = 1  # groups a token may choose experts from
    group_score: str = "max"  # a group's score: its best expert, or "top2" (sum of its best two)
    scaling: float = 1.0  # routed_scaling_factor on the final weights

    def __post_init__(self) -> None:
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"router scoring must be softmax or sigmoid, not {self.scoring!r}")
        if self.group_score not in ("max", "top2"):
            raise ValueError(f"group score must be max or top2, not {self.group_score!r}")


def select_experts(
    logits: torch.Tensor,  # [T, E] router logits
    router: RouterConfig,
    correction_bias: torch.Tensor | None = None,  # [E]: added for the choice only
) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, k] float32 weights, [T, k] int64 expert ids)
    """The experts each token goes to and their weights, best first: on CUDA the fused router
    kernel (lightwell/kernels/moe_router.py, one launch, no host sync), elsewhere the torch
    reference ``select_experts_ref``."""
    if not logits.is_cuda:
        return select_experts_ref(logits, router, correction_bias)
    from lightwell.kernels.moe_router import moe_router

    return moe_router(
        logits, router.top_k, correction_bias, renormalize=router.renormalize,
        scoring=router.scoring, num_groups=router.num_groups, topk_groups=router.topk_groups,
        group_score=router.group_score, scaling=router.scaling,
    )  # fmt: skip


def select_experts_ref(
    logits: torch.Tensor,  # [T, E] router logits
    router: RouterConfig,
    correction_bias: torch.Tensor | None = None,  # [E]: added for the choice only
) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, k] float32 weights, [T, k] int64 expert ids)
    """``select_experts`` in torch ops (any device)."""
    logits = logits.float()
    scores = logits.softmax(-1) if router.scoring == "softmax" else logits.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if router.num_groups > 1:
        choice = _limit_groups(choice, router)
    ids = choice.topk(router.top_k, dim=-1)[1]  # [T, k]
    weights = scores.gather(1, ids)
    if router.renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * router.scaling, ids


def _limit_groups(choice: torch.Tensor, router: RouterConfig) -> torch.Tensor:  # [T, E]
    """Scores of experts outside each token's ``topk_groups`` best groups set to -inf."""
    num_tokens, num_experts = choice.shape
    grouped = choice.view(num_tokens, router.num_groups, -1)  # [T, G, E / G]
    if router.group_score == "max":
        group_scores = grouped.max(-1).values
    else:
        group_scores = grouped.topk(2, dim=-1)[0].sum(-1)
    best = group_scores.topk(router.topk_groups, dim=-1)[1]  # [T, g]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return grouped.masked_fill(~keep[:, :, None], float("-inf")).view(num_tokens, num_experts)


class FusedMoE(nn.Module):
    """The routed experts of one layer (silu-gated MLPs); ``forward`` returns this rank's
    partial sum over the experts each token chose, weighted by the router."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        tp, rank = get_tp_size(), get_tp_rank()
        self.num_experts = num_experts
        self.expert_parallel = get_expert_parallel() and tp > 1
        if self.expert_parallel:
            if num_experts % tp:
                raise ValueError(
                    f"expert parallelism needs the experts ({num_experts}) to divide among "
                    f"the {tp} tensor-parallel ranks"
                )
            self.num_local_experts = num_experts // tp
            self.expert_start, self.inter = rank * self.num_local_experts, intermediate_size
            self.inter_start = 0
        else:
            self.num_local_experts, self.expert_start = num_experts, 0
            self.inter = divide(intermediate_size, tp, "expert intermediate size")
            self.inter_start = rank * self.inter
        dtype = torch.get_default_dtype()
        e, i = self.num_local_experts, self.inter
        self.w13_weight = nn.Parameter(torch.empty(e, 2 * i, hidden_size, dtype=dtype), False)
        self.w2_weight = nn.Parameter(torch.empty(e, hidden_size, i, dtype=dtype), False)
        for p in (self.w13_weight, self.w2_weight):
            p.weight_loader = self.weight_loader

    def weight_loader(
        self,
        param: torch.Tensor,  # w13_weight or w2_weight
        loaded: torch.Tensor,  # one expert's [I, H] (gate, up) or [H, I] (down)
        shard: str,  # "gate", "up" or "down"
        expert: int,
    ) -> None:
        if shard not in SHARDS or not 0 <= expert < self.num_experts:
            raise ValueError(f"bad expert weight: shard {shard!r}, expert {expert}")
        local = expert - self.expert_start
        if not 0 <= local < self.num_local_experts:
            return  # another rank's expert
        full_inter = self.inter * (1 if self.expert_parallel else get_tp_size())
        down = shard == "down"
        want = (param.shape[1], full_inter) if down else (full_inter, param.shape[2])
        if tuple(loaded.shape) != want:
            raise ValueError(
                f"shape mismatch: expert {expert} {shard} tensor has shape "
                f"{tuple(loaded.shape)}, expected {want}"
            )
        if down:
            param.data[local].copy_(loaded[:, self.inter_start : self.inter_start + self.inter])
            return
        rows = loaded[self.inter_start : self.inter_start + self.inter]
        param.data[local, SHARDS[shard] * self.inter : (SHARDS[shard] + 1) * self.inter] = rows

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        weights: torch.Tensor,  # [T, k] router weights
        ids: torch.Tensor,  # [T, k] expert ids
    ) -> torch.Tensor:  # [T, H] this rank's partial sum
        ids = ids - self.expert_start if self.expert_start else ids
        if x.is_cuda:
            from lightwell.kernels.fused_moe import fused_moe

            return fused_moe(x, self.w13_weight, self.w2_weight, weights, ids)
        return moe_loop(x, self.w13_weight, self.w2_weight, weights, ids)

    @property
    def cuda_graph_safe(self) -> bool:
        """The Triton kernel (CUDA) runs without host syncs; the torch loop reads the
        per-expert token counts on the host."""
        return self.w13_weight.is_cuda

    def extra_repr(self) -> str:
        return (
            f"experts={self.num_local_experts}/{self.num_experts}, intermediate={self.inter}, "
            f"expert_parallel={self.expert_parallel}"
        )


def moe_loop(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2 * I, H]
    w2: torch.Tensor,  # [E, H, I]
    weights: torch.Tensor,  # [T, k]
    ids: torch.Tensor,  # [T, k] local expert ids (outside [0, E): another rank's, skipped)
) -> torch.Tensor:  # [T, H]
    """Tokens sorted by expert, one matmul pair per expert that has tokens (torch, any device)."""
    num_experts, top_k = w13.shape[0], ids.shape[1]
    flat = ids.reshape(-1)
    order = flat.argsort(stable=True)  # [T * k]
    counts = torch.bincount(flat.clamp(-1, num_experts) + 1, minlength=num_experts + 2)
    counts = counts.tolist()  # [-1: below, 0..E-1, E: above]
    out = torch.zeros_like(x)
    start = counts[0]
    for e in range(num_experts):
        n = counts[e + 1]
        if n:
            rows = order[start : start + n]
            tokens = rows // top_k
            gate_up = x[tokens] @ w13[e].t()  # [n, 2 * I]
            gate, up = gate_up.chunk(2, dim=-1)
            y = (F.silu(gate) * up) @ w2[e].t()  # [n, H]
            w = weights.reshape(-1)[rows].to(x.dtype)
            out.index_add_(0, tokens, y * w[:, None])
        start += n
    return out
