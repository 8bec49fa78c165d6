"""Tensor-parallel state: this process's rank, the group size, and the collectives layers use.

Set once per process by the worker (``init_tp_group``) before the model is built; without it
every layer behaves as rank 0 of 1 and the collectives are identities. ``tp_all_reduce``
dispatches through the all-reduce strategy set by ``set_tp_all_reduce`` (normally the selector
of ``lightwell.distributed.comm``), or the process group's own all-reduce when none is set.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class _TPState:
    rank: int = 0
    size: int = 1
    group: Any = None  # a torch.distributed ProcessGroup, or None for the default group
    cpu_group: Any = None  # a gloo group over the same ranks (host-side control), or None
    all_reduce: Any = None  # an AllReduceStrategy, or None: the group's own all-reduce
    expert_parallel: bool = False  # MoE layers hold whole experts per rank (not slices)


_STATE = _TPState()


def init_tp_group(rank: int, size: int, group: Any = None, cpu_group: Any = None) -> None:
    """Record this process's tensor-parallel rank, size and process groups."""
    global _STATE
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"invalid tensor-parallel rank {rank} for size {size}")
    _STATE = _TPState(rank, size, group, cpu_group if cpu_group is not None else group)


def set_tp_all_reduce(strategy: Any) -> None:
    """Route ``tp_all_reduce`` through ``strategy`` (``strategy.all_reduce(x) -> sum``)."""
    global _STATE
    _STATE = dataclasses.replace(_STATE, all_reduce=strategy)


def set_expert_parallel(enabled: bool) -> None:
    """Whether MoE layers built from now on spread whole experts over the TP ranks."""
    global _STATE
    _STATE = dataclasses.replace(_STATE, expert_parallel=bool(enabled))


def get_expert_parallel() -> bool:
    return _STATE.expert_parallel


def get_tp_all_reduce() -> Any:
    return _STATE.all_reduce


def reset_tp_group() -> None:
    """Back to the single-process defaults (rank 0 of 1)."""
    global _STATE
    _STATE = _TPState()


def get_tp_rank() -> int:
    return _STATE.rank


def get_tp_size() -> int:
    return _STATE.size


def get_tp_group() -> Any:
    return _STATE.group


def get_tp_cpu_group() -> Any:
    return _STATE.cpu_group


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the tensor-parallel group; returns the sum (``x`` itself, reduced in
    place, or a new tensor, depending on the strategy: always use the returned tensor)."""
    if _STATE.size == 1:
        return x
    if _STATE.all_reduce is not None:
        return _STATE.all_reduce.all_reduce(x)
    import torch.distributed as dist

    dist.all_reduce(x, group=_STATE.group)
    return x


def tp_all_reduce_start(x: torch.Tensor) -> Any:
    """The all-reduce of ``x`` in phases, when its strategy has them (``hostmem-copy``): begun
    on the current stream, then ``.transfer()`` (on a comm stream: no kernel) and ``.finish()``
    (on the stream that consumes the sum, which returns it). None otherwise (and at TP=1)."""
    if _STATE.size == 1 or _STATE.all_reduce is None:
        return None
    start = getattr(_STATE.all_reduce, "start", None)
    return None if start is None else start(x)


def tp_all_reduce_add_rmsnorm(
    x: torch.Tensor,  # [T, H] this rank's partial sum
    residual: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The all-reduce of ``x`` fused with the residual add + RMSNorm that consumes it:
    ``(rmsnorm(sum + residual) * weight, sum + residual)``, when the strategy has a fused form
    for x (``hostmem``); None otherwise (and at TP=1): the caller reduces and norms apart."""
    if _STATE.size == 1 or _STATE.all_reduce is None:
        return None
    fused = getattr(_STATE.all_reduce, "all_reduce_add_rmsnorm", None)
    return None if fused is None else fused(x, residual, weight, eps)


def tp_broadcast(x: torch.Tensor) -> torch.Tensor:
    """Overwrite ``x`` on every rank with tensor-parallel rank 0's ``x`` (in place)."""
    if _STATE.size == 1:
        return x
    import torch.distributed as dist

    src = dist.get_global_rank(_STATE.group, 0) if _STATE.group is not None else 0
    dist.broadcast(x, src=src, group=_STATE.group)
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``, in rank order."""
    if _STATE.size == 1:
        return x
    import torch.distributed as dist

    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_STATE.size)]
    dist.all_gather(parts, x, group=_STATE.group)
    return torch.cat(parts, dim=dim)
