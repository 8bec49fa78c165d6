"""All-reduce through pinned host memory, moved by the copy engines: for prefill-sized messages
on boxes without peer access, where the all-reduce should hold no SMs (so that dual-stream
overlap leaves the compute every SM).

Every rank maps one shared segment (/dev/shm, registered with CUDA as portable + mapped). A
call, with the message cut into ``chunks`` pieces:

    up stream (the caller's):    D2H chunk 0 -> my slot | flag[me][0] = epoch | D2H chunk 1 ...
    down stream (a second one):  wait flag[peer][c] >= epoch | H2D peer's chunk c -> recv ...
    then the caller's stream waits for the down stream and sums x and the peers' copies.

The copies are the driver's ``cuMemcpyDtoHAsync``/``cuMemcpyHtoDAsync`` (the copy engines;
the two directions overlap chunk by chunk), the flag write ``cuStreamWriteValue32`` (fenced:
the chunk's bytes are in host memory before the flag) and the wait ``cuStreamWaitValue32``:
stream memory operations, no kernel. The only kernel is the sum: each rank adds the same
values in rank order in fp32 (x + peer for two ranks, x's dtype computed in fp32), so every
rank gets the same result; exact, like ``hostmem``.

Slots alternate between two buffers by call parity, and a rank reaches call k + 2 only after
its peers raised call k + 1's flags, which they do after reading call k's slots: a slot is
never overwritten while a peer still reads it. The epoch and parity are counted on the host,
so the strategy is not graph-safe: the selector uses it for eager steps only (prefills above
the CUDA graphs' token count), and the graph-safe ``hostmem`` lanes for everything captured.
A wait has no timeout on the GPU (a stream memory operation cannot give up): a peer that
died is noticed by the executor, not by this strategy.

On CPU (tests) the same protocol runs on CPU tensors: the copies are memcpys, the flag write a
store, the wait a bounded spin.
"""

from __future__ import annotations

import ctypes
import os
import time
import weakref
from typing import Any

import torch

from lightwell.distributed.comm.base import CommContext, message_bytes
from lightwell.distributed.comm.host import map_shared, pin
from lightwell.distributed.comm.hostmem import (
    _DTYPES,
    _HOST_REGISTER_PORTABLE_MAPPED,
    _device_pointer,
    _unregister,
)

DEFAULT_MAX_BYTES = 16 * 1024 * 1024
# Pieces a message is cut into so that its D2H and H2D copies overlap; messages below
# ``MIN_CHUNK_BYTES`` a piece use fewer. Environment override for experiments (every rank
# inherits the engine's environment, so every rank cuts alike).
CHUNKS = 4
CHUNKS_ENV = "LIGHTWELL_HOSTMEM_COPY_CHUNKS"
MAX_CHUNKS = 16
MIN_CHUNK_BYTES = 256 * 1024
WAIT_TIMEOUT_S = 120.0  # CPU emulation only
_FLAG_ROW = 64  # bytes of flags per rank: MAX_CHUNKS int32
_CU_STREAM_WAIT_VALUE_GEQ = 0  # (int32)(*addr - value) >= 0: wraps like the epoch


def chunk_bounds(n: int, itemsize: int, chunks: int) -> list[tuple[int, int]]:
    """[start, end) element ranges of a message of ``n`` elements: at most ``chunks`` pieces of
    at least ``MIN_CHUNK_BYTES`` (but one piece at least), multiples of 64 elements but the
    last."""
    pieces = max(1, min(chunks, n * itemsize // MIN_CHUNK_BYTES))
    per = -(-n // pieces)
    step = -(-per // 64) * 64
    return [(a, min(a + step, n)) for a in range(0, n, step)]


class HostMemCopyAllReduce:
    name = "hostmem-copy"
    graph_safe = False

    def __init__(
        self,
        ctx: CommContext,
        max_bytes: int = DEFAULT_MAX_BYTES,
        min_bytes: int = 0,
        chunks: int | None = None,
    ) -> None:
        """``min_bytes``: smaller messages are left to other strategies (``supports``);
        ``chunks``: pieces per message (default ``LIGHTWELL_HOSTMEM_COPY_CHUNKS`` or
        ``CHUNKS``)."""
        self.rank, self.size = ctx.rank, ctx.size
        self.max_bytes, self.min_bytes = max_bytes, min_bytes
        if chunks is None:
            chunks = int(os.environ.get(CHUNKS_ENV, CHUNKS))
        if not 1 <= chunks <= MAX_CHUNKS:
            raise ValueError(f"hostmem-copy chunks must be 1..{MAX_CHUNKS}, got {chunks}")
        self.chunks = chunks
        self.slot_bytes = -(-max_bytes // 4096) * 4096
        self.flag_bytes = -(-(_FLAG_ROW * ctx.size) // 4096) * 4096
        total = self.flag_bytes + 2 * ctx.size * self.slot_bytes
        self.memory = map_shared(ctx, total)  # CPU view, uint8 [total]
        self.on_gpu = ctx.device.type == "cuda"
        self.registered = self.on_gpu and pin(self.memory, _HOST_REGISTER_PORTABLE_MAPPED)
        self._release = weakref.finalize(self, _unregister, self.memory, self.registered)
        if self.on_gpu and not self.registered:
            raise RuntimeError("cudaHostRegister of the hostmem-copy segment failed")
        self.flags = self.memory[: self.flag_bytes].view(torch.int32)
        self.calls = 0
        self.device = ctx.device
        if self.on_gpu:
            self.ops: _Ops = _DriverOps(self.memory, ctx.device)
            self.down = torch.cuda.Stream(ctx.device)
            # one receive buffer per peer, reused by every call: a call's H2D copies are on
            # the down stream after the caller's stream (which consumed the previous call)
            self.recv = torch.empty(
                max(1, ctx.size - 1), self.slot_bytes, dtype=torch.uint8, device=ctx.device
            )
        else:
            self.ops = _HostOps(self.memory)
            self.down = None
            self.recv = torch.empty(max(1, ctx.size - 1), self.slot_bytes, dtype=torch.uint8)

    @staticmethod
    def available(ctx: CommContext) -> bool:
        if not 2 <= ctx.size <= 8:
            return False
        return torch.cuda.is_available() if ctx.device.type == "cuda" else True

    def supports(self, x: torch.Tensor) -> bool:
        return (
            x.dtype in _DTYPES
            and x.device.type == self.device.type
            and self.min_bytes <= message_bytes(x) <= self.max_bytes
        )

    def _slot(self, parity: int, rank: int) -> int:  # byte offset of a slot in the segment
        return self.flag_bytes + (parity * self.size + rank) * self.slot_bytes

    def _flag(self, rank: int, chunk: int) -> int:  # byte offset of a flag
        return rank * _FLAG_ROW + 4 * chunk

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        flat = x.view(-1)
        n, item = flat.numel(), flat.element_size()
        bounds = chunk_bounds(n, item, self.chunks)
        self.calls += 1
        epoch = self.calls % (1 << 32)  # 32-bit flags; the waits compare cyclically
        parity = self.calls % 2
        ops = self.ops
        up = torch.cuda.current_stream(self.device) if self.on_gpu else None
        if self.down is not None:
            self.down.wait_stream(up)  # x is ready, and the previous call's sum has read recv
        mine = self._slot(parity, self.rank)
        for c, (a, b) in enumerate(bounds):
            ops.d2h(mine + a * item, flat, a, b, up)
            ops.write_flag(self._flag(self.rank, c), epoch, up)
        peers = [r for r in range(self.size) if r != self.rank]
        for i, peer in enumerate(peers):
            theirs = self._slot(parity, peer)
            recv = self.recv[i][: n * item].view(x.dtype)
            for c, (a, b) in enumerate(bounds):
                ops.wait_flag(self._flag(peer, c), epoch, self.down)
                ops.h2d(recv, a, b, theirs + a * item, self.down)
        if self.down is not None:
            up.wait_stream(self.down)
        received = [self.recv[i][: n * item].view(x.dtype).view(x.shape) for i in range(len(peers))]
        if self.size == 2:  # one add in x's dtype: computed in fp32, rounded once
            return flat.view(x.shape).add_(received[0])
        terms = received[: self.rank] + [x] + received[self.rank :]  # rank order
        acc = terms[0].float()
        for t in terms[1:]:
            acc += t
        return x.copy_(acc)

    def close(self) -> None:
        if self.on_gpu and self.registered:
            torch.cuda.synchronize(self.device)  # no copy may still use it
        self.ops = self.flags = self.memory = self.recv = None
        self._release()


class _Ops:
    """The four primitives of a call, on a stream (GPU) or in order (CPU)."""

    def d2h(self, dst: int, src: torch.Tensor, a: int, b: int, stream: Any) -> None: ...

    def h2d(self, dst: torch.Tensor, a: int, b: int, src: int, stream: Any) -> None: ...

    def write_flag(self, offset: int, value: int, stream: Any) -> None: ...

    def wait_flag(self, offset: int, value: int, stream: Any) -> None: ...


class _HostOps(_Ops):
    """CPU emulation: the segment is plain shared memory."""

    def __init__(self, memory: torch.Tensor) -> None:
        self.memory = memory

    def _view(self, offset: int, dtype: torch.dtype, count: int) -> torch.Tensor:
        size = torch.empty((), dtype=dtype).element_size()
        return self.memory[offset : offset + count * size].view(dtype)

    def d2h(self, dst: int, src: torch.Tensor, a: int, b: int, stream: Any) -> None:
        self._view(dst, src.dtype, b - a).copy_(src[a:b])

    def h2d(self, dst: torch.Tensor, a: int, b: int, src: int, stream: Any) -> None:
        dst[a:b].copy_(self._view(src, dst.dtype, b - a))

    def write_flag(self, offset: int, value: int, stream: Any) -> None:
        # after the data: x86 stores are ordered; the uint32 epoch stored as its int32 bits
        self._view(offset, torch.int32, 1)[0] = value - (1 << 32) if value >= 1 << 31 else value

    def wait_flag(self, offset: int, value: int, stream: Any) -> None:
        flag = self._view(offset, torch.int32, 1)
        deadline = time.monotonic() + WAIT_TIMEOUT_S
        while (int(flag[0]) - value) % (1 << 32) >= 1 << 31:  # flag behind value, cyclically
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"hostmem-copy: no peer flag within {WAIT_TIMEOUT_S:.0f} s (is it alive?)"
                )
            os.sched_yield()


class _DriverOps(_Ops):
    """The CUDA driver's async copies and stream memory operations (through ctypes: no kernel,
    a few microseconds of host time each)."""

    def __init__(self, memory: torch.Tensor, device: torch.device) -> None:
        self.host = memory.data_ptr()
        self.dev = _device_pointer(self.host)  # flags are addressed from the device side
        self.cuda = ctypes.CDLL("libcuda.so.1")
        for name in ("cuMemcpyDtoHAsync_v2", "cuMemcpyHtoDAsync_v2"):
            getattr(self.cuda, name).argtypes = [
                ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p
            ]  # fmt: skip
        for name in ("cuStreamWriteValue32_v2", "cuStreamWaitValue32_v2"):
            getattr(self.cuda, name).argtypes = [
                ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint
            ]  # fmt: skip

    def _check(self, err: int, what: str) -> None:
        if err != 0:
            raise RuntimeError(f"hostmem-copy: {what} failed with CUDA driver error {err}")

    def d2h(self, dst: int, src: torch.Tensor, a: int, b: int, stream: Any) -> None:
        item = src.element_size()
        err = self.cuda.cuMemcpyDtoHAsync_v2(
            self.host + dst, src.data_ptr() + a * item, (b - a) * item, stream.cuda_stream
        )
        self._check(err, "cuMemcpyDtoHAsync")

    def h2d(self, dst: torch.Tensor, a: int, b: int, src: int, stream: Any) -> None:
        item = dst.element_size()
        err = self.cuda.cuMemcpyHtoDAsync_v2(
            dst.data_ptr() + a * item, self.host + src, (b - a) * item, stream.cuda_stream
        )
        self._check(err, "cuMemcpyHtoDAsync")

    def write_flag(self, offset: int, value: int, stream: Any) -> None:
        # flags 0: the write is fenced after the stream's earlier work (the chunk's copy)
        err = self.cuda.cuStreamWriteValue32_v2(stream.cuda_stream, self.dev + offset, value, 0)
        self._check(err, "cuStreamWriteValue32")

    def wait_flag(self, offset: int, value: int, stream: Any) -> None:
        err = self.cuda.cuStreamWaitValue32_v2(
            stream.cuda_stream, self.dev + offset, value, _CU_STREAM_WAIT_VALUE_GEQ
        )
        self._check(err, "cuStreamWaitValue32")
