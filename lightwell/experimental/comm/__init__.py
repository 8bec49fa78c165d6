"""Experimental all-reduce strategies (the ``AllReduceStrategy`` protocol of
``lightwell.distributed.comm``), built by name with ``create_experimental``:

- ``peermem``: hostmem's low-latency kernel writing into the peer GPU's memory (two GPUs with
  peer access); not yet measured;
- ``int8``: int8-quantized over NCCL (all-to-all + all-gather); hostmem-int8 is faster wherever
  both were measured;
- ``host``: summed by the CPUs through shared memory (ZhiLight's design); hostmem is faster
  wherever both were measured.
"""

from __future__ import annotations

import importlib
from typing import Any

from lightwell.distributed.comm.base import AllReduceStrategy, CommContext

EXPERIMENTAL: dict[str, tuple[str, str]] = {
    "peermem": ("lightwell.experimental.comm.peermem", "PeerMemAllReduce"),
    "int8": ("lightwell.experimental.comm.int8_nccl", "Int8AllReduce"),
    "host": ("lightwell.experimental.comm.host", "HostAllReduce"),
}


def experimental_class(name: str) -> Any:
    if name not in EXPERIMENTAL:
        known = ", ".join(EXPERIMENTAL)
        raise ValueError(f"unknown experimental all-reduce {name!r}; known: {known}")
    module, cls = EXPERIMENTAL[name]
    return getattr(importlib.import_module(module), cls)


def create_experimental(name: str, ctx: CommContext, **options: Any) -> AllReduceStrategy:
    """Build experimental strategy ``name`` (a collective call on every rank of ``ctx.group``)."""
    cls = experimental_class(name)
    if not cls.available(ctx):
        raise RuntimeError(f"experimental all-reduce {name!r} is not available on {ctx.device}")
    return cls(ctx, **options)
