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


_BESIDE_COMPUTE = False


@contextlib.contextmanager
def beside_compute() -> Iterator[None]:
    """All-reduces issued inside run beside compute on another stream (the dual-stream
    overlap's comm stream): strategies that hold no SMs are preferred for them
    (``hostmem-copy``). Set while the call is issued, so a CUDA-graph capture bakes the
    choice in; every rank issues the same calls the same way, so all pick alike."""
    global _BESIDE_COMPUTE
    before, _BESIDE_COMPUTE = _BESIDE_COMPUTE, True
    try:
        yield
    finally:
        _BESIDE_COMPUTE = before


def is_beside_compute() -> bool:
    return _BESIDE_COMPUTE


_EXACT_SUM = False


@contextlib.contextmanager
def exact_sum() -> Iterator[None]:
    """All-reduces issued inside are summed exactly even under the int8 strategies (each sends
    its full-precision payload for them): the vocab-parallel embedding's, where every row has
    one non-zero contribution, which int8 would only blur. Set while the call is issued, like
    ``beside_compute``, so a CUDA-graph capture bakes it in."""
    global _EXACT_SUM
    before, _EXACT_SUM = _EXACT_SUM, True
    try:
        yield
    finally:
        _EXACT_SUM = before


def is_exact_sum() -> bool:
    return _EXACT_SUM
