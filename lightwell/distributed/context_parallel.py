"""Context-parallel state: this process's rank among the ranks that split a step's tokens,
and the all-gather that gives every rank the whole step's keys and values (or hidden states).

A step of T tokens is cut into C contiguous chunks of ceil(T / C) tokens (the last shorter);
rank r computes chunk r through every layer. Set once per process by the worker
(``init_cp``); without it there is one rank and nothing is split.
"""

from __future__ import annotations

import torch

_RANK, _SIZE = 0, 1


def init_cp(rank: int, size: int) -> None:
    global _RANK, _SIZE
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"invalid context-parallel rank {rank} for size {size}")
    _RANK, _SIZE = rank, size


def reset_cp() -> None:
    init_cp(0, 1)


def get_cp_size() -> int:
    return _SIZE


def chunk_range(num_tokens: int) -> tuple[int, int]:
    """This rank's ``[lo, hi)`` of a step's ``num_tokens`` flat tokens."""
    chunk = -(-num_tokens // _SIZE)
    return min(_RANK * chunk, num_tokens), min((_RANK + 1) * chunk, num_tokens)


def all_gather_tokens(x: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Every rank's chunk of ``x`` ([n, ...], this rank's rows) in rank order: [num_tokens, ...].
    Chunks are padded to the same length for the collective and trimmed after."""
    import torch.distributed as dist

    chunk = -(-num_tokens // _SIZE)
    padded = x.new_zeros((chunk, *x.shape[1:]))
    padded[: x.shape[0]] = x
    parts = [torch.empty_like(padded) for _ in range(_SIZE)]
    dist.all_gather(parts, padded)
    return torch.cat(parts)[:num_tokens]
