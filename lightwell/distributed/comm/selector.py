"""Pick the all-reduce strategy per call, by the option asked for, message size and backend.

The rule (``--all-reduce``):
- auto, GPUs with peer access (every pair can map the other, and NCCL_P2P_DISABLE is not
  set): with ``--custom-all-reduce`` (default), on two GPUs messages up to ``hostmem``'s
  low-latency lane's limit (``hostmem.LL_MAX_BYTES``: batch-1 to 8 decode) go to that lane
  (through pinned host memory, with the residual add + RMSNorm in its kernel), messages of at
  most ``AUTO_PEER_MAX_BYTES`` to the peer-memory strategy (``oneshot``: one-shot up to
  256 KB, two-shot above) when it is available; everything else (and everything with
  ``--no-custom-all-reduce``) to NCCL.
- auto, GPUs without peer access (a PCIe box without P2P, or NCCL_P2P_DISABLE=1): ``hostmem``
  (exact, through pinned host memory) for every message that fits its buffer, NCCL above.
  If it cannot be set up on every rank, NCCL for everything, with a warning.
  The lossy one (hostmem-int8) is never chosen by auto.
- auto, CPU: the gloo process group's all-reduce.
- nccl / gloo: always that one.
- oneshot: peer memory for every message that fits its buffer (sized to the largest step),
  NCCL for the rest.
- hostmem / hostmem-int8: the GPU-summed all-reduce through pinned host memory (exact / int8
  payload) for every message that fits its buffer, NCCL for the rest; graph-safe.
- hostmem-copy / hostmem-copy-int8: the all-reduces issued beside compute (the dual-stream
  overlap's, ``comm.base.beside_compute``) of at least ``COPY_MIN_BYTES`` through pinned host
  memory moved by the copy engines (exact / int8 payload; no SMs held); everything else as
  hostmem / hostmem-int8 (whose kernel is faster back to back); graph-safe.
A strategy that is not available here (oneshot on CPU) is skipped with a warning. Every rank
sees the same shape, dtype and capture state, so every rank picks the same strategy.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from lightwell import envs
from lightwell.distributed.comm import create_strategy, is_available
from lightwell.distributed.comm.base import AllReduceStrategy, CommContext
from lightwell.distributed.comm.hostmem import lanes

logger = logging.getLogger(__name__)

# 512 tokens x 4096 bf16, the largest step a CUDA graph holds: up to it two-shot beats NCCL
# over NVLink; from 2,048 tokens NCCL wins or ties, so larger messages stay on it.
AUTO_PEER_MAX_BYTES = 4 << 20
# hostmem-copy's smallest message (128 tokens x 4096 bf16); smaller ones take hostmem's lanes.
# Back to back hostmem's kernel is faster at every size, so the copy engines only take the
# dual-stream overlap's all-reduces, which run beside compute that needs the SMs.
COPY_MIN_BYTES = 1 << 20


class AllReduceSelector:
    """An ``AllReduceStrategy`` that forwards each call to the strategy the rule picks."""

    name = "selector"
    graph_safe = True

    def __init__(
        self,
        ctx: CommContext,
        choice: str = "auto",
        custom_all_reduce: bool = True,
        max_bytes: int = 16 << 20,
        phases: int = 0,
    ) -> None:
        """``max_bytes``: the largest message expected (the step's token budget x hidden x
        dtype size); buffers of the strategies that need one are sized from it. ``phases``:
        all-reduces the dual-stream overlap keeps in flight (its micro-batches; 0 without
        it): the copy strategies' stage sets for calls in phases."""
        self.choice = choice
        self.fallback: AllReduceStrategy = create_strategy(
            "gloo" if choice == "gloo" else "nccl", ctx
        )
        self.preferred: list[AllReduceStrategy] = []
        for name, options in _preferred(ctx, choice, custom_all_reduce, max_bytes, phases):
            if not is_available(name, ctx):
                if choice == name:
                    logger.warning(
                        "all-reduce %r is not available on %s: using %s instead",
                        name,
                        ctx.device,
                        self.fallback.name,
                    )
            elif choice == "auto":  # auto's picks are optional: fall back if any rank fails
                strategy = _build_on_every_rank(name, ctx, options)
                if strategy is not None:
                    self.preferred.append(strategy)
            else:
                self.preferred.append(create_strategy(name, ctx, **options))
        # some strategy here runs calls in phases (``start``)
        self.phased = any(hasattr(s, "start") for s in self.preferred)

    def pick(self, x: torch.Tensor) -> AllReduceStrategy:
        for strategy in self.preferred:
            if strategy.supports(x) and (strategy.graph_safe or not _capturing(x)):
                return strategy
        return self.fallback

    def supports(self, x: torch.Tensor) -> bool:
        return True

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self.pick(x).all_reduce(x)

    def start(self, x: torch.Tensor) -> Any:
        """The picked strategy's all-reduce of x in phases (``start`` on this stream, then
        ``transfer()`` and ``finish()``: ``hostmem-copy``), or None when it has none."""
        if not self.phased:  # (no pick here that all_reduce would make again)
            return None
        start = getattr(self.pick(x), "start", None)
        return None if start is None else start(x)

    def all_reduce_add_rmsnorm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The picked strategy's all-reduce fused with the residual add + RMSNorm after it
        (``(norm(sum + residual), sum + residual)``), or None when it has no fused form for x
        (the caller reduces, then norms). Every rank gets the same answer: the same strategy,
        shapes and dtypes everywhere."""
        fused = getattr(self.pick(x), "all_reduce_add_rmsnorm", None)
        return None if fused is None else fused(x, residual, weight, eps)

    def describe(self) -> str:
        return " > ".join(s.name for s in [*self.preferred, self.fallback])

    def close(self) -> None:
        for strategy in [*self.preferred, self.fallback]:
            strategy.close()
        self.preferred = []


def _preferred(
    ctx: CommContext, choice: str, custom: bool, max_bytes: int, phases: int = 0
) -> list[tuple[str, dict]]:
    if choice == "auto":
        if ctx.device.type != "cuda":
            return []
        if not peer_access(ctx):
            # through pinned host memory beats NCCL's own host path at every size, exactly
            return lanes("hostmem", max_bytes)
        if not custom:
            return []
        small = []
        if ctx.size == 2:  # (the low-latency lane's kernel pays on two GPUs)
            small = [lane for lane in lanes("hostmem", max_bytes) if lane[1].get("protocol")]
        return [*small, ("oneshot", {"max_bytes": min(AUTO_PEER_MAX_BYTES, max_bytes)})]
    if choice == "oneshot":
        return [("oneshot", {"max_bytes": max_bytes})]
    if choice in ("hostmem", "hostmem-int8"):
        return lanes(choice, max_bytes)
    if choice in ("hostmem-copy", "hostmem-copy-int8"):
        copy = {
            "max_bytes": max_bytes,
            "min_bytes": COPY_MIN_BYTES,
            "beside_compute_only": True,
            "phases": phases,
        }
        return [(choice, copy), *lanes(choice.replace("-copy", ""), max_bytes)]
    return []  # nccl, gloo: the fallback itself


def peer_access(ctx: CommContext) -> bool:
    """Whether every rank's GPU can map every other's memory (ranks are GPUs 0..size-1), and
    NCCL is allowed to use it (``NCCL_P2P_DISABLE`` unset or 0). A collective over the CPU
    group, so that all ranks answer the same on a box where only some pairs have peer access."""
    if envs.nccl_p2p_disabled():
        return False
    me = ctx.device.index if ctx.device.index is not None else ctx.rank
    mine = all(torch.cuda.can_device_access_peer(me, j) for j in range(ctx.size) if j != me)
    return _all_ranks(ctx, mine)


def _all_ranks(ctx: CommContext, ok: bool) -> bool:
    """True when ``ok`` holds on every rank (a collective over the CPU group)."""
    flag = torch.tensor([int(ok)], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=ctx.cpu_group)
    return bool(flag.item())


def _build_on_every_rank(name: str, ctx: CommContext, options: dict) -> AllReduceStrategy | None:
    """Build an optional strategy; if it fails on any rank (no room in /dev/shm, pinning
    refused...), close it everywhere and return None, so that every rank falls back alike."""
    strategy, error = None, None
    try:
        strategy = create_strategy(name, ctx, **options)
    except Exception as e:  # noqa: BLE001 - any failure means: use the fallback
        error = e
    if _all_ranks(ctx, strategy is not None):
        return strategy
    if strategy is not None:
        strategy.close()
    logger.warning(
        "all-reduce %r could not be set up on every rank (%s): its messages go to the next "
        "strategy (NCCL at the end)",
        name,
        error,
    )
    return None


def _capturing(x: torch.Tensor) -> bool:
    return x.is_cuda and torch.cuda.is_current_stream_capturing()
