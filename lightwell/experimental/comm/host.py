"""Experimental: the CPU-summed host all-reduce (``host``), ZhiLight's design. Slower than
``hostmem`` (summed on the GPUs) wherever both were measured, so it is off the product's path.

Host all-reduce: through a shared-memory buffer that every rank maps (2-8 ranks).

Per call, with the buffers of this call's parity (calls alternate between two sets, so a rank
that runs ahead into the next call never overwrites what a slower rank still reads):
    1. device -> host: each rank copies its tensor into its slot (pinned, /dev/shm-backed)
    2. barrier
    3. rank r sums chunk r of every slot in fp32 (vectorised torch on CPU; the ranks sum their
       chunks in parallel) and writes it to the result buffer
    4. barrier
    5. host -> device: each rank copies the whole result back
Barriers are per-rank counters in the same shared memory, spun on with ``sched_yield`` (no
sockets on the hot path), with a timeout so a dead peer raises instead of hanging.

The whole call runs on one CPU thread, not torch's intra-op pool: two ranks' OpenMP teams
spin-waiting on the same cores (beside the barriers' own spinning) make a 32-token call take
tens of milliseconds instead of ~0.1 ms. With 2 ranks the
sum is one add in x's dtype (computed in fp32, rounded once: the bytes of the fp32 sum).

Not capturable in a CUDA graph (host synchronisation): the selector uses NCCL inside captures.
The counters rely on the host's store order (x86 TSO): data is written before the counter.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator

import torch

from lightwell.distributed.comm.base import CommContext, message_bytes
from lightwell.distributed.comm.shm import map_shared, pin, rank_order_sum

DEFAULT_MAX_BYTES = 16 * 1024 * 1024
BARRIER_TIMEOUT_S = 120.0
_FLAG_STRIDE = 8  # int64s per rank counter: one 64-byte cache line each


class HostAllReduce:
    name = "host"
    graph_safe = False

    def __init__(self, ctx: CommContext, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.rank, self.size = ctx.rank, ctx.size
        self.max_bytes = -(-max_bytes // 64) * 64
        self.flag_bytes = 64 * self.size
        self.set_bytes = (self.size + 1) * self.max_bytes  # n input slots + 1 result
        total = self.flag_bytes + 2 * self.set_bytes
        self.memory = map_shared(ctx, total)  # uint8 [total]
        self.flags = self.memory[: self.flag_bytes].view(torch.int64).numpy()
        self.flags = self.flags.reshape(self.size, _FLAG_STRIDE)
        self.registered = pin(self.memory) if ctx.device.type == "cuda" else False
        self.calls = 0

    @staticmethod
    def available(ctx: CommContext) -> bool:
        return 2 <= ctx.size <= 8

    def supports(self, x: torch.Tensor) -> bool:
        return x.is_floating_point() and message_bytes(x) <= self.max_bytes

    def _view(self, parity: int, slot: int, x: torch.Tensor) -> torch.Tensor:  # [N] x.dtype
        start = self.flag_bytes + parity * self.set_bytes + slot * self.max_bytes
        return self.memory[start : start + message_bytes(x)].view(x.dtype)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        with _one_thread():  # copies included: on CPU they use the intra-op pool too
            return self._all_reduce(x)

    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        parity, n = self.calls % 2, x.numel()
        self.calls += 1
        self._view(parity, self.rank, x).copy_(x.reshape(-1))  # device -> host
        self._barrier(2 * self.calls - 1)
        chunk = -(-n // self.size)
        a, b = min(self.rank * chunk, n), min((self.rank + 1) * chunk, n)
        if b > a:
            self._sum_chunk(parity, x, a, b)
        self._barrier(2 * self.calls)
        out = torch.empty_like(x)
        out.view(-1).copy_(self._view(parity, self.size, x))  # host -> device
        return out

    def _sum_chunk(self, parity: int, x: torch.Tensor, a: int, b: int) -> None:
        slots = [self._view(parity, r, x)[a:b] for r in range(self.size)]
        rank_order_sum(slots, self._view(parity, self.size, x)[a:b])

    def _barrier(self, target: int) -> None:
        self.flags[self.rank, 0] = target
        deadline = None
        for peer in range(self.size):
            while self.flags[peer, 0] < target:
                if deadline is None:
                    deadline = time.monotonic() + BARRIER_TIMEOUT_S
                elif time.monotonic() > deadline:
                    raise RuntimeError(
                        f"host all-reduce: rank {peer} did not arrive within "
                        f"{BARRIER_TIMEOUT_S:.0f} s (is it alive?)"
                    )
                os.sched_yield()

    def close(self) -> None:
        if self.registered:
            torch.cuda.cudart().cudaHostUnregister(self.memory.data_ptr())
            self.registered = False
        self.flags = None
        self.memory = None


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """torch's intra-op pool off for the duration (a global setting; toggling costs < 1 us)."""
    n = torch.get_num_threads()
    if n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)
