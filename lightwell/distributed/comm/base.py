"""The all-reduce strategy interface, the context every strategy is built from, whether the
all-reduce being issued runs beside compute (the dual-stream overlap), and whether it must be
exact even under a lossy (int8) strategy."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass(frozen=True)
class CommContext:
    """Where a strategy runs: this rank, the group size, the groups and the device."""

    rank: int
    size: int
    group: Any  # the device group: NCCL on GPU, gloo on CPU
    cpu_group: Any  # a gloo group over the same ranks (host-side handshakes)
    device: torch.device


class AllReduceStrategy(Protocol):
    """Sums a tensor over the tensor-parallel group.

    Every rank calls ``all_reduce`` with a tensor of the same shape and dtype, in the same
    order; the result is identical on every rank. ``all_reduce`` may reduce ``x`` in place or
    return a new tensor: callers use the returned one. ``graph_safe``: the strategy may be
    captured in a CUDA graph (no host synchronisation inside).
    """

    name: str
    graph_safe: bool

    def supports(self, x: torch.Tensor) -> bool: ...

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...

    def close(self) -> None: ...


def message_bytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


class _CallFlag:
    """A flag on the all-reduces issued inside ``with flag():``, read by the strategies while
    the call is issued (so a CUDA-graph capture bakes the choice in; every rank issues the
    same calls the same way, so all choose alike)."""

    def __init__(self) -> None:
        self.on = False

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        before, self.on = self.on, True
        try:
            yield
        finally:
            self.on = before


# The all-reduces issued beside compute on another stream (the dual-stream overlap's comm
# stream): strategies that hold no SMs are preferred for them (``hostmem-copy``).
beside_compute = _CallFlag()
# The all-reduces summed exactly even under the int8 strategies (they leave such a call to an
# exact lane): the vocab-parallel embedding's, where every row has one non-zero contribution,
# which int8 would only blur.
exact_sum = _CallFlag()


def is_beside_compute() -> bool:
    return beside_compute.on


def is_exact_sum() -> bool:
    return exact_sum.on
