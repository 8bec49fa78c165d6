"""All-reduce through pinned host memory, moved by the copy engines: for prefill-sized messages
on boxes without peer access, where the all-reduce should hold no SMs (so that dual-stream
overlap leaves the compute every SM).

Every rank maps one shared segment (/dev/shm, registered with CUDA as portable + mapped). A
call, with the message cut into ``chunks`` pieces, writing slot ``p`` (calls alternate between
two slots a rank):

    up stream (the caller's): wait busy[p][me][r] == 0, then busy[p][me][r] = 1 (every reader
                              r) | per chunk c: D2H chunk c -> my slot p, flag[p][me][r][c] = 1
    down stream (a second):   per chunk c, per peer q: (after this rank raised its chunk c)
                              wait flag[p][q][me][c] == 1 | H2D q's chunk c -> stage |
                              flag[p][q][me][c] = 0 | finally busy[p][q][me] = 0
    then the caller's stream waits for the down stream and sums x and the peers' copies.

Flags are handshakes with fixed values: a chunk flag is raised by the writer once the chunk is
in host memory and lowered by its reader once copied out; a slot's busy word is raised by the
writer when it starts a message and lowered by each reader after its last chunk (its chunk
flags are all down by then). A writer reuses a slot only once every reader has lowered its busy
word, whatever the previous message's size and chunks, so calls that reuse a slot back to back
are safe: the slot's parity comes from a counter on the host, which CUDA-graph replays do not
advance. Every rank makes the same calls in the same order, so all agree on each call's slot,
and eager calls and replays mix freely. The reader of chunk c waits for this rank's own raise
of chunk c (an event), so a graph whose branches run one after the other still progresses.

The copies are the driver's ``cuMemcpyDtoHAsync``/``cuMemcpyHtoDAsync`` (the copy engines;
the two directions overlap chunk by chunk), the flag writes ``cuStreamWriteValue32`` (fenced:
a chunk's bytes are in host memory before its flag) and the waits ``cuStreamWaitValue32``:
stream memory operations, no kernel. The only kernel is the sum: each rank adds the same
values in rank order in fp32 (x + peer for two ranks, x's dtype computed in fp32), so every
rank gets the same result; exact, like ``hostmem``. A wait has no timeout on the GPU (a stream
memory operation cannot give up): a peer that died is noticed by the executor, not here.

``hostmem-copy-int8`` sends int8 values with one fp32 scale per 128 (``int8_pack``'s rows,
one row a chunk: about 0.52x the bytes of bf16), and every rank sums every rank's dequantized
values in rank order (each element off by at most the sum over ranks of its group's absmax /
254, one rounding, like ``hostmem-int8``).

On CPU (tests) the same protocol runs on CPU tensors: the copies are memcpys, the flag writes
stores, the waits bounded spins; the int8 kernels run under the Triton interpreter.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import time
from typing import Any

import torch

from lightwell.distributed.comm.base import CommContext, is_beside_compute, message_bytes
from lightwell.distributed.comm.hostmem import (
    _DTYPES,
    HostMemAllReduce,
    _device_pointer,
    map_pinned,
)

DEFAULT_MAX_BYTES = 16 * 1024 * 1024
# Pieces a message is cut into so that its D2H and H2D copies overlap; messages below
# ``MIN_CHUNK_BYTES`` a piece use fewer. Environment override for experiments (every rank
# inherits the engine's environment, so every rank cuts alike).
CHUNKS = 4
CHUNKS_ENV = "LIGHTWELL_HOSTMEM_COPY_CHUNKS"
MAX_CHUNKS = 16
MIN_CHUNK_BYTES = 256 * 1024
# "0" / "1": never / always quantize and sum chunk by chunk (default: inside CUDA graphs and on
# CPU); for experiments, like CHUNKS_ENV.
PIPELINE_ENV = "LIGHTWELL_HOSTMEM_COPY_PIPELINE"
WAIT_TIMEOUT_S = 120.0  # CPU emulation only
_FLAG_ROW = 4 * (MAX_CHUNKS + 1)  # bytes per (slot, writer, reader): chunk flags, busy word
_CU_STREAM_WAIT_VALUE_EQ = 1


def int8_layout(n: int, chunks: int) -> tuple[int, int]:
    """(rows, cols) of a message of ``n`` elements sent as int8: at most ``chunks`` rows of
    ``cols`` elements (a multiple of the 128-element group), each at least MIN_CHUNK_BYTES
    of int8 (but one row at least)."""
    from lightwell.kernels.int8_pack import GROUP

    rows = max(1, min(chunks, n // MIN_CHUNK_BYTES))
    per = -(-n // rows)
    cols = -(-per // GROUP) * GROUP
    return -(-n // cols), cols


def chunk_bounds(n: int, itemsize: int, chunks: int) -> list[tuple[int, int]]:
    """[start, end) element ranges of a message of ``n`` elements: at most ``chunks`` pieces,
    as many as leave each at least ``MIN_CHUNK_BYTES`` on average (one at least), multiples
    of 64 elements but the last (which may be a little shorter)."""
    pieces = max(1, min(chunks, n * itemsize // MIN_CHUNK_BYTES))
    per = -(-n // pieces)
    step = -(-per // 64) * 64
    return [(a, min(a + step, n)) for a in range(0, n, step)]


class HostMemCopyAllReduce:
    name = "hostmem-copy"
    graph_safe = True

    def __init__(
        self,
        ctx: CommContext,
        max_bytes: int = DEFAULT_MAX_BYTES,
        min_bytes: int = 0,
        chunks: int | None = None,
        int8: bool = False,
        beside_compute_only: bool = False,
        pipeline: bool | None = None,
    ) -> None:
        """``min_bytes``: smaller messages are left to other strategies (``supports``);
        ``chunks``: pieces per message (default ``LIGHTWELL_HOSTMEM_COPY_CHUNKS`` or
        ``CHUNKS``); ``int8``: the int8 payload; ``beside_compute_only``: take only the
        all-reduces issued beside compute (``comm.base.beside_compute``: the dual-stream
        overlap), leaving the rest to other strategies (the selector's rule: back to back,
        hostmem's kernel is faster); ``pipeline``: quantize and sum chunk by chunk (default:
        inside CUDA graphs and on CPU, or ``PIPELINE_ENV``; eager GPU calls launch one
        kernel each way)."""
        self.beside_compute_only = beside_compute_only
        if pipeline is None and os.environ.get(PIPELINE_ENV) in ("0", "1"):
            pipeline = os.environ[PIPELINE_ENV] == "1"
        self.pipeline = pipeline
        self.int8 = int8
        self.name = "hostmem-copy-int8" if int8 else "hostmem-copy"
        self.rank, self.size = ctx.rank, ctx.size
        self.max_bytes, self.min_bytes = max_bytes, min_bytes
        if chunks is None:
            chunks = int(os.environ.get(CHUNKS_ENV, CHUNKS))
        if not 1 <= chunks <= MAX_CHUNKS:
            raise ValueError(f"hostmem-copy chunks must be 1..{MAX_CHUNKS}, got {chunks}")
        self.chunks = chunks
        # room for max_bytes of a 2-byte dtype as int8 rows too (+ their scales and padding)
        self.slot_bytes = -(-(max_bytes + 8 * MAX_CHUNKS * 132) // 4096) * 4096
        self.flag_bytes = -(-(2 * _FLAG_ROW * ctx.size**2) // 4096) * 4096
        total = self.flag_bytes + 2 * ctx.size * self.slot_bytes
        self.on_gpu = ctx.device.type == "cuda"
        self.memory, self.registered = map_pinned(self, ctx, total)
        self.calls = 0
        self.device = ctx.device
        # What each peer sent, copied in (int8: this rank's own packed message too; ``_row``),
        # reused by every call: a call's copies into it are on the down stream after the
        # caller's stream, which consumed the previous call's sum.
        rows = ctx.size if int8 else ctx.size - 1
        self.stage = torch.empty(rows, self.slot_bytes, dtype=torch.uint8, device=ctx.device)
        if self.on_gpu:
            self.ops: _Ops = _DriverOps(self.memory)
            # high priority: the pipelined sums on it are the end of the critical path
            self.down = torch.cuda.Stream(ctx.device, priority=-1)
        else:
            self.ops = _HostOps(self.memory)
            self.down = None

    @staticmethod
    def available(ctx: CommContext) -> bool:
        if not 2 <= ctx.size <= 8:
            return False
        return torch.cuda.is_available() if ctx.device.type == "cuda" else True

    def _payload(
        self, flat: torch.Tensor, layout: tuple[int, int] | None
    ) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """The bytes to send (uint8 [B]) and their [start, end) byte range a chunk; int8: the
        buffer that ``_quantize`` fills, a row of ``layout``'s (rows, cols) a chunk."""
        n = flat.numel()
        if layout is None:
            item = flat.element_size()
            bounds = chunk_bounds(n, item, self.chunks)
            return flat.view(torch.uint8), [(a * item, b * item) for a, b in bounds]
        from lightwell.kernels.int8_pack import packed_row_bytes

        rows, cols = layout
        rb = packed_row_bytes(cols)
        if rows * rb > self.slot_bytes:
            raise ValueError(f"{n} elements do not fit hostmem-copy's {self.slot_bytes}-byte slot")
        return self._row(self.rank)[: rows * rb], [(r * rb, (r + 1) * rb) for r in range(rows)]

    def _quantize(
        self, flat: torch.Tensor, layout: tuple[int, int], payload: torch.Tensor, rows: range
    ) -> None:  # int8: rows ``rows`` of this rank's message into its packed buffer
        from lightwell.kernels.int8_pack import quantize_pack

        n_rows, cols = layout
        out = payload.view(n_rows, -1)
        quantize_pack(flat, n_rows, cols, out=out, rows=(rows.start, rows.stop))

    def _sum(
        self,
        x: torch.Tensor,
        layout: tuple[int, int] | None,
        peers: list[int],
        part: tuple[int, int],  # [a, b): chunks (int8: packed rows), or elements
    ) -> None:
        """Sums the part that every peer's copy of has landed into x, in rank order."""
        flat = x.view(-1)
        if layout is not None:
            from lightwell.kernels.int8_pack import dequant_sum

            rows, cols = layout
            dequant_sum(self.stage, cols, rows, flat, rows=part)  # rows in rank order
            return
        a, b = part
        item = x.element_size()
        received = [self._row(q)[a * item : b * item].view(x.dtype) for q in peers]
        mine = flat[a:b]
        if self.size == 2:  # one add in x's dtype: computed in fp32, rounded once
            mine.add_(received[0])
            return
        terms = received[: self.rank] + [mine] + received[self.rank :]  # rank order
        acc = terms[0].float()
        for t in terms[1:]:
            acc += t
        mine.copy_(acc)

    def supports(self, x: torch.Tensor) -> bool:
        return (
            x.dtype in _DTYPES
            and x.device.type == self.device.type
            and self.min_bytes <= message_bytes(x) <= self.max_bytes
            and (is_beside_compute() or not self.beside_compute_only)
        )

    def _slot(self, parity: int, rank: int) -> int:  # byte offset of a slot in the segment
        return self.flag_bytes + (parity * self.size + rank) * self.slot_bytes

    def _flag(self, parity: int, writer: int, reader: int, chunk: int) -> int:  # byte offset
        """Chunk ``chunk``'s flag, or (chunk ``MAX_CHUNKS``) the slot's busy word."""
        return ((parity * self.size + writer) * self.size + reader) * _FLAG_ROW + 4 * chunk

    def _row(self, rank: int) -> torch.Tensor:  # uint8 [slot_bytes]: rank's bytes in stage
        return self.stage[rank if self.int8 else rank - (rank > self.rank)]

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        flat = x.view(-1)
        self.calls += 1
        p = self.calls % 2
        ops = self.ops
        up = torch.cuda.current_stream(self.device) if self.on_gpu else None
        if self.down is not None:
            self.down.wait_stream(up)  # x is ready, and the previous call's sum has read stage
        # Pipelined (in a CUDA graph, and on CPU): chunk c is quantized just before its copy
        # and summed on the down stream as soon as it lands, so only the first chunk's
        # quantize and the last one's sum are not under the copies. Eager calls on a GPU take
        # one kernel each way instead (their launches, not the copies, are the cost there).
        pipelined = self.pipeline
        if pipelined is None:
            pipelined = not self.on_gpu or torch.cuda.is_current_stream_capturing()
        layout = int8_layout(flat.numel(), self.chunks) if self.int8 else None
        payload, bounds = self._payload(flat, layout)
        if layout is not None and not pipelined:
            self._quantize(flat, layout, payload, range(len(bounds)))
        me = self.rank
        peers = [r for r in range(self.size) if r != me]
        mine, busy = self._slot(p, me), MAX_CHUNKS
        for r in peers:  # every reader is done with this slot's previous message
            ops.wait_flag(self._flag(p, me, r, busy), 0, up)
        for r in peers:
            ops.write_flag(self._flag(p, me, r, busy), 1, up)
        raised = []
        for c, (a, b) in enumerate(bounds):
            if layout is not None and pipelined:
                self._quantize(flat, layout, payload, range(c, c + 1))
            ops.d2h(mine + a, payload, a, b, up)
            for r in peers:
                ops.write_flag(self._flag(p, me, r, c), 1, up)
            raised.append(ops.record(up))
        # what a chunk's sum covers: its packed row (int8), its elements (exact)
        if layout is not None:
            parts = [(c, c + 1) for c in range(len(bounds))]
        else:
            parts = [(a // x.element_size(), b // x.element_size()) for a, b in bounds]
        down = self.down if self.down is not None else up
        for c, (a, b) in enumerate(bounds):
            ops.after(raised[c], self.down)  # progress if the graph runs the streams in series
            for q in peers:
                ops.wait_flag(self._flag(p, q, me, c), 1, self.down)
                ops.h2d(self._row(q), a, b, self._slot(p, q) + a, self.down)
                ops.write_flag(self._flag(p, q, me, c), 0, self.down)
            if pipelined:
                with _on(down):
                    self._sum(x, layout, peers, parts[c])
        for q in peers:
            ops.write_flag(self._flag(p, q, me, busy), 0, self.down)
        if self.down is not None:
            up.wait_stream(self.down)
        if not pipelined:
            self._sum(x, layout, peers, (parts[0][0], parts[-1][1]))
        return x

    def close(self) -> None:
        if self.on_gpu and self.registered:
            torch.cuda.synchronize(self.device)  # no copy may still use it
        self.ops = self.memory = self.stage = None
        self._release()


def _on(stream: torch.cuda.Stream | None) -> Any:  # a stream context, or nothing on CPU
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


class _Ops:
    """The four primitives of a call, on a stream (GPU) or in order (CPU). Offsets are
    byte offsets into the segment; tensors are uint8, ``[a, b)`` a byte range of them."""

    def d2h(self, dst: int, src: torch.Tensor, a: int, b: int, stream: Any) -> None: ...

    def h2d(self, dst: torch.Tensor, a: int, b: int, src: int, stream: Any) -> None: ...

    def write_flag(self, offset: int, value: int, stream: Any) -> None: ...

    def wait_flag(self, offset: int, value: int, stream: Any) -> None: ...

    def record(self, stream: Any) -> Any:  # a marker of the stream's work so far
        return None

    def after(self, marker: Any, stream: Any) -> None:  # stream waits for the marker
        return None


class _HostOps(_Ops):
    """CPU emulation: the segment is plain shared memory."""

    def __init__(self, memory: torch.Tensor) -> None:
        self.memory = memory

    def _flag(self, offset: int) -> torch.Tensor:  # int32 [1]
        return self.memory[offset : offset + 4].view(torch.int32)

    def d2h(self, dst: int, src: torch.Tensor, a: int, b: int, stream: Any) -> None:
        self.memory[dst : dst + b - a].copy_(src[a:b])

    def h2d(self, dst: torch.Tensor, a: int, b: int, src: int, stream: Any) -> None:
        dst[a:b].copy_(self.memory[src : src + b - a])

    def write_flag(self, offset: int, value: int, stream: Any) -> None:
        self._flag(offset)[0] = value  # after the data: x86 stores are ordered

    def wait_flag(self, offset: int, value: int, stream: Any) -> None:
        flag = self._flag(offset)
        deadline = time.monotonic() + WAIT_TIMEOUT_S
        while int(flag[0]) != value:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"hostmem-copy: no peer flag within {WAIT_TIMEOUT_S:.0f} s (is it alive?)"
                )
            os.sched_yield()


class _DriverOps(_Ops):
    """The CUDA driver's async copies and stream memory operations (through ctypes: no kernel,
    a few microseconds of host time each)."""

    def __init__(self, memory: torch.Tensor) -> None:
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

    def record(self, stream: Any) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def after(self, marker: torch.cuda.Event, stream: Any) -> None:
        stream.wait_event(marker)

    def _check(self, err: int, what: str) -> None:
        if err != 0:
            raise RuntimeError(f"hostmem-copy: {what} failed with CUDA driver error {err}")

    def d2h(self, dst: int, src: torch.Tensor, a: int, b: int, stream: Any) -> None:
        err = self.cuda.cuMemcpyDtoHAsync_v2(
            self.host + dst, src.data_ptr() + a, b - a, stream.cuda_stream
        )
        self._check(err, "cuMemcpyDtoHAsync")

    def h2d(self, dst: torch.Tensor, a: int, b: int, src: int, stream: Any) -> None:
        err = self.cuda.cuMemcpyHtoDAsync_v2(
            dst.data_ptr() + a, self.host + src, b - a, stream.cuda_stream
        )
        self._check(err, "cuMemcpyHtoDAsync")

    def write_flag(self, offset: int, value: int, stream: Any) -> None:
        # flags 0: the write is fenced after the stream's earlier work (the chunk's copy)
        err = self.cuda.cuStreamWriteValue32_v2(stream.cuda_stream, self.dev + offset, value, 0)
        self._check(err, "cuStreamWriteValue32")

    def wait_flag(self, offset: int, value: int, stream: Any) -> None:
        err = self.cuda.cuStreamWaitValue32_v2(
            stream.cuda_stream, self.dev + offset, value, _CU_STREAM_WAIT_VALUE_EQ
        )
        self._check(err, "cuStreamWaitValue32")


class HostMemCopyInt8AllReduce(HostMemCopyAllReduce):
    """``hostmem-copy`` with the int8 payload."""

    def __init__(self, ctx: CommContext, **options: Any) -> None:
        super().__init__(ctx, int8=True, **options)  # HostMemCopyAllReduce's options

    @staticmethod
    def available(ctx: CommContext) -> bool:
        return HostMemAllReduce.available(ctx)  # Triton kernels: a GPU or the interpreter
