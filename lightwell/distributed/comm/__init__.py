"""All-reduce strategies for tensor parallelism: a Protocol, a registry and lazy imports.

One module per strategy (``nccl``, ``oneshot``, ``hostmem``, ``hostmem_copy``); ``shm`` holds
the shared host memory they map; ``selector`` picks one per call by message size and backend.
A strategy's module is imported only when it is built, so optional machinery (symmetric
memory, pinned shared memory) loads only when chosen.
"""

from __future__ import annotations

import importlib
from typing import Any

from lightwell.distributed.comm.base import AllReduceStrategy, CommContext

__all__ = ["AllReduceStrategy", "CommContext", "create_strategy", "is_available", "STRATEGIES"]

# name -> (module, class); every class has ``available(ctx) -> bool`` and ``__init__(ctx, ...)``.
STRATEGIES: dict[str, tuple[str, str]] = {
    "nccl": ("lightwell.distributed.comm.nccl", "ProcessGroupAllReduce"),
    "gloo": ("lightwell.distributed.comm.nccl", "GlooAllReduce"),
    "oneshot": ("lightwell.distributed.comm.oneshot", "SymmMemAllReduce"),
    "hostmem": ("lightwell.distributed.comm.hostmem", "HostMemAllReduce"),
    "hostmem-int8": ("lightwell.distributed.comm.hostmem", "HostMemInt8AllReduce"),
    "hostmem-copy": ("lightwell.distributed.comm.hostmem_copy", "HostMemCopyAllReduce"),
    "hostmem-copy-int8": ("lightwell.distributed.comm.hostmem_copy", "HostMemCopyInt8AllReduce"),
}


def _strategy_class(name: str) -> Any:
    if name not in STRATEGIES:
        raise ValueError(f"unknown all-reduce strategy {name!r}; known: {', '.join(STRATEGIES)}")
    module, cls = STRATEGIES[name]
    return getattr(importlib.import_module(module), cls)


def is_available(name: str, ctx: CommContext) -> bool:
    """Whether strategy ``name`` can run here (device type, torch build)."""
    return bool(_strategy_class(name).available(ctx))


def create_strategy(name: str, ctx: CommContext, **options: Any) -> AllReduceStrategy:
    """Build strategy ``name`` (a collective call on every rank of ``ctx.group``)."""
    cls = _strategy_class(name)
    if not cls.available(ctx):
        raise RuntimeError(f"all-reduce strategy {name!r} is not available on {ctx.device}")
    return cls(ctx, **options)
