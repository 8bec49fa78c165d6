"""Mixture of experts: the router's expert choice and the experts stacked in two weights.

``FusedMoE`` holds every expert's gate/up projection as one ``w13_weight`` [E, 2 * I, H]
(gate rows first) and its down projection as ``w2_weight`` [E, H, I], or their quantized forms
(block FP8, packed int4 with group scales): its ``quant_method`` (``lightwell/quant/experts.py``)
creates them from the model's linear method and runs the experts. Its ``weight_loader`` takes
HF's per-expert tensors (``experts.{e}.gate_proj.weight`` ...) with ``(shard, expert)``.
With ``num_shared`` S (DeepSeek's shared experts, unquantized, tensor parallel only) the stack
holds S more experts after the routed ones, which every token uses with weight 1: in the routed
experts' launches when the step takes the few-token GEMV path, as a dense MLP otherwise.

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

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightwell.distributed.parallel_state import get_expert_parallel, get_tp_rank, get_tp_size
from lightwell.kernels.moe_gemv_rule import use_gemv
from lightwell.layers.activation import SiluAndMul
from lightwell.layers.linear import divide
from lightwell.quant.base import is_unquantized
from lightwell.quant.experts import experts_method

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

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        quant_method: Any = None,  # the model's linear method; its experts' strategy follows
        num_shared: int = 0,  # always-on experts of the same size, stacked after the routed
    ):
        super().__init__()
        tp, rank = get_tp_size(), get_tp_rank()
        self.num_experts, self.num_shared = num_experts, num_shared
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
        if num_shared and (self.expert_parallel or not folds_shared_experts(quant_method)):
            raise ValueError("shared experts stack with unquantized tensor-parallel experts only")
        self.num_stacked = self.num_local_experts + num_shared
        self.full_inter = intermediate_size
        self.quant_method = experts_method(quant_method)
        self.act_dtype = torch.get_default_dtype()  # the model's (activations, scales)
        self.quant_method.create_weights(self, hidden_size, self.inter, self.act_dtype)

    def weight_loader(
        self,
        param: torch.Tensor,  # [E_local, ...]: a stacked w13 (gate, up) or w2 (down) tensor
        loaded: torch.Tensor,  # one expert's checkpoint tensor of that projection
        shard: str,  # "gate", "up" or "down"
        expert: int,
    ) -> None:
        """One expert's tensor into its slot: this rank's slice of the intermediate features
        (``param.inter_dim``, ``param.inter_factor`` features an index), gate and up side by
        side; another rank's expert is skipped."""
        if shard not in SHARDS or not 0 <= expert < self.num_experts + self.num_shared:
            raise ValueError(f"bad expert weight: shard {shard!r}, expert {expert}")
        local = expert - self.expert_start  # shared experts: only without expert parallelism
        if not 0 <= local < self.num_stacked:
            return  # another rank's expert
        dim, factor = param.inter_dim, param.inter_factor
        dst = param.data[local]
        if loaded.dim() == 0:  # a per-tensor scale saved as a scalar
            loaded = loaded.reshape(1)
        want = list(dst.shape)
        if dim is not None:
            want[dim] = -(-self.full_inter // factor)
        if list(loaded.shape) != want:
            raise ValueError(
                f"shape mismatch: expert {expert} {shard} tensor has shape "
                f"{tuple(loaded.shape)}, expected {tuple(want)}"
            )
        if dim is None:
            dst.copy_(loaded)
            return
        size = dst.shape[dim] // (1 if shard == "down" else 2)
        src = loaded.narrow(dim, self.inter_start // factor, size)
        dst.narrow(dim, 0 if shard != "up" else size, size).copy_(src)

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        weights: torch.Tensor,  # [T, k] router weights
        ids: torch.Tensor,  # [T, k] expert ids
    ) -> torch.Tensor:  # [T, H] this rank's partial sum, shared experts included
        ids = ids - self.expert_start if self.expert_start else ids
        if not self.num_shared:
            return self.quant_method.apply(self, x, weights, ids)
        if self.folds_shared(x.shape[0], ids.shape[1]):  # decode: one launch a projection
            return self.quant_method.apply(self, x, weights, ids, num_shared=self.num_shared)
        return self.quant_method.apply(self, x, weights, ids, add=self.shared_mlp(x))

    def folds_shared(self, num_tokens: int, top_k: int) -> bool:
        """Whether a step runs the shared experts as every token's extra choices, in the
        routed experts' launches (the few-token GEMV path, ``kernels/moe_gemv_rule.use_gemv``;
        the same rule on every device); else ``shared_mlp`` runs them as one dense MLP."""
        return use_gemv(num_tokens, top_k + self.num_shared, self.num_stacked)

    def shared_mlp(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        """The shared experts on every token as dense matmuls over their stacked weights
        (steps too large for ``folds_shared``): one gate/up matmul, one down matmul each."""
        start, count, inter = self.num_local_experts, self.num_shared, self.inter
        w13 = self.w13_weight[start:].reshape(count * 2 * inter, -1)  # [S * 2I, H]
        gate_up = F.linear(x, w13).view(-1, 2 * inter)  # [T * S, 2I]
        act = SiluAndMul()(gate_up).view(x.shape[0], count, inter)  # [T, S, I]
        out = F.linear(act[:, 0], self.w2_weight[start])
        for s in range(1, count):
            out = out + F.linear(act[:, s], self.w2_weight[start + s])
        return out

    @property
    def cuda_graph_safe(self) -> bool:
        """The Triton kernel (CUDA) runs without host syncs; the torch loop reads the
        per-expert token counts on the host."""
        return next(self.parameters()).is_cuda

    def extra_repr(self) -> str:
        return (
            f"experts={self.num_local_experts}/{self.num_experts}, shared={self.num_shared}, "
            f"intermediate={self.inter}, "
            f"expert_parallel={self.expert_parallel}, {type(self.quant_method).__name__}"
        )


def moe_loop(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2 * I, H]
    w2: torch.Tensor,  # [E, H, I]
    weights: torch.Tensor,  # [T, k]
    ids: torch.Tensor,  # [T, k] local expert ids (outside [0, E): another rank's, skipped)
    num_shared: int = 0,  # the last S experts: every token's, weight 1
) -> torch.Tensor:  # [T, H]
    """Tokens sorted by expert, one matmul pair per expert that has tokens (torch, any device)."""
    return moe_loop_by(x, lambda e: (w13[e], w2[e]), w13.shape[0], weights, ids, num_shared)


def folds_shared_experts(linear_method: Any) -> bool:
    """Whether a model whose linears use ``linear_method`` may stack DeepSeek's shared
    experts with the routed ones (``FusedMoE(num_shared=...)``): its experts and its shared MLP
    alike unquantized, and no expert parallelism (a rank holds a slice of every expert)."""
    tp_sliced = not (get_expert_parallel() and get_tp_size() > 1)
    return tp_sliced and is_unquantized(linear_method)


def moe_loop_by(
    x: torch.Tensor,  # [T, H]
    expert: Callable[[int], tuple[torch.Tensor, torch.Tensor]],  # e -> ([2I, H], [H, I])
    num_experts: int,
    weights: torch.Tensor,  # [T, k]
    ids: torch.Tensor,  # [T, k] local expert ids (outside [0, E): another rank's, skipped)
    num_shared: int = 0,  # the last S experts: every token's, weight 1
) -> torch.Tensor:  # [T, H]
    """``moe_loop`` with each expert's weights from ``expert(e)``, asked only for the experts
    that have tokens (a quantized layer dequantizes them there, one at a time)."""
    if num_shared:
        num_tokens = ids.shape[0]
        shared = torch.arange(num_experts - num_shared, num_experts, device=ids.device)
        ids = torch.cat([ids, shared.to(ids.dtype).expand(num_tokens, num_shared)], 1)
        weights = torch.cat([weights, weights.new_ones(num_tokens, num_shared)], 1)
    top_k = ids.shape[1]
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
            w13, w2 = expert(e)
            gate_up = x[tokens] @ w13.t()  # [n, 2 * I]
            gate, up = gate_up.chunk(2, dim=-1)
            y = (F.silu(gate) * up) @ w2.t()  # [n, H]
            w = weights.reshape(-1)[rows].to(x.dtype)
            out.index_add_(0, tokens, y * w[:, None])
        start += n
    return out
