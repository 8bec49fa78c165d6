"""Tensor-parallel state: this process's rank, the group size, and the collectives layers use.

Set once per process by the worker (``init_tp_group``) before the model is built; without it
every layer behaves as rank 0 of 1 and the collectives are identities. The communication
strategies (NCCL, one-shot, int8 ...) plug in behind ``tp_all_reduce`` later.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class _TPState:
    rank: int = 0
    size: int = 1
    group: Any = None  # a torch.distributed ProcessGroup, or None for the default group


_STATE = _TPState()


def init_tp_group(rank: int, size: int, group: Any = None) -> None:
    """Record this process's tensor-parallel rank, size and process group."""
    global _STATE
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"invalid tensor-parallel rank {rank} for size {size}")
    _STATE = _TPState(rank, size, group)


def reset_tp_group() -> None:
    """Back to the single-process defaults (rank 0 of 1)."""
    global _STATE
    _STATE = _TPState()


def get_tp_rank() -> int:
    return _STATE.rank


def get_tp_size() -> int:
    return _STATE.size


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the tensor-parallel group (in place when size > 1); returns the sum."""
    if _STATE.size == 1:
        return x
    import torch.distributed as dist

    dist.all_reduce(x, group=_STATE.group)
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
