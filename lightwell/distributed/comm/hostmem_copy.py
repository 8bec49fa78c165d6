"""All-reduce through pinned host memory, moved by the copy engines: for prefill-sized messages
on boxes without peer access, where the all-reduce should hold no SMs (so that dual-stream
overlap leaves the compute every SM).

Every rank maps one shared segment (/dev/shm, registered with CUDA as portable + mapped). A
call, with the message cut into ``chunks`` pieces, writing slot ``p`` (calls alternate between
two slots a rank):

    up stream (the caller's): wait busy[p][me][r] == 0, then busy[p][me][r] = 1 (every reader
                              r: the claim, which a call in phases makes before its payload
                              is ready) | per chunk c: D2H chunk c -> my slot p,
                              flag[p][me][r][c] = 1
    down stream (a second):   per chunk c, per peer q: (after this rank raised chunks 0..c)
                              wait flag[p][q][me][c] == 1 | H2D q's chunk c -> stage | then
                              every flag[p][q][me][c] = 0, and busy[p][q][me] = 0
    then the stream that sums (the caller's) waits for the down stream's copies and sums x and
    the peers' copies. The up stream does not wait for the down stream in phases, so the
    next call's D2H copies follow this one's at once. With ``lanes`` L > 1, each direction's
    chunk c runs on lane c % L (the up stream and L - 1 more; L down streams), so that a
    chunk's copy runs while another lane handles the previous chunk's flag; the up stream
    and the first down stream join their lanes once the call's copies are issued.

Flags are handshakes with fixed values: a chunk flag is raised by the writer once the chunk is
in host memory and lowered by its reader after its last copy of the message; a slot's busy
word is raised by the writer when it starts a message and lowered by each reader after its
chunk flags. A writer reuses a slot only once every reader has lowered its busy
word, whatever the previous message's size and chunks, so calls that reuse a slot back to back
are safe: the slot's parity comes from a counter on the host, which CUDA-graph replays do not
advance. Every rank makes the same calls in the same order, so all agree on each call's slot,
and eager calls and replays mix freely. The reader of chunk c waits for this rank's own raises
of chunks 0..c (events), so a graph whose branches run one after the other still progresses.

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

In phases (``start`` / ``transfer`` / ``finish``, the dual-stream overlap's calls through
``CommStream``): the int8 quantize runs on the stream that produced x, the copies and flags on
the comm stream, the sum on the stream that consumes the result, so the comm stream runs no
kernel. A kernel there waits for the SMs, and the GEMM beside it holds every SM until it ends
(a short quantize beside a GEMM finishes only after the GEMM, at either stream priority). Calls
in flight in phases each own one of the stage sets (``phases``: this rank's packed message, the
peers' copies, each sized for a micro-batch's share of a step's message), taken at ``start``
and given back at ``finish``; with none free (or a message too large), ``start`` declines and
the call runs whole on the comm stream. Every call also waits, on its own up stream, for this
rank's flag writes of the previous call in phases of its parity in the same forward
(``end_forward`` forgets them), so a graph whose branches run one after the other still
progresses, also when a whole call follows calls in phases: the comm stream does not wait for
the down stream otherwise.

On CPU (tests) the same protocol runs on CPU tensors: the copies are memcpys, the flag writes
stores, the waits bounded spins; the int8 kernels run under the Triton interpreter.
"""

from __future__ import annotations

import ctypes
import os
import time
from typing import Any

import torch

from lightwell.distributed.comm.base import (
    CommContext,
    is_beside_compute,
    is_exact_sum,
    message_bytes,
)
from lightwell.distributed.comm.hostmem import (
    _DTYPES,
    DEFAULT_MAX_BYTES,
    HostMemAllReduce,
    _device_pointer,
    map_pinned,
)
from lightwell.distributed.comm.shm import rank_order_sum

# Pieces a message is cut into so that its D2H and H2D copies overlap; messages below
# ``MIN_CHUNK_BYTES`` a piece use fewer. Every rank must cut alike.
CHUNKS = 4
MAX_CHUNKS = 16
# Streams a direction's copies take turns on, chunk by chunk: on one stream each copy waits for
# the flag operation after the previous one; on two, a chunk's copy runs while the other stream
# raises (or waits for) the previous chunk's flag.
LANES = 1
MAX_LANES = 4
MIN_CHUNK_BYTES = 256 * 1024
WAIT_TIMEOUT_S = 120.0  # CPU emulation only
# A stage set for a call in phases holds a micro-batch's message: at most the step's over the
# micro-batch count (the split is at equal token counts), plus a token row's worth of rounding.
PHASE_MARGIN_BYTES = 64 * 1024
_FLAG_ROW = 4 * (MAX_CHUNKS + 1)  # bytes per (slot, writer, reader): chunk flags, busy word
_CU_STREAM_WAIT_VALUE_EQ = 1


def _room(nbytes: int) -> int:
    """Bytes of a slot or stage row for messages of up to ``nbytes`` (a 2-byte dtype's as int8
    rows too, with their scales and padding), in whole pages."""
    return -(-(nbytes + 8 * MAX_CHUNKS * 132) // 4096) * 4096


def int8_layout(n: int, chunks: int) -> tuple[int, int]:
    """(rows, cols) of a message of ``n`` elements sent as int8: at most ``chunks`` rows of
    ``cols`` elements (a multiple of four 128-element groups, so that packed rows start 16
    bytes apart: int8_pack's vector loads), each at least MIN_CHUNK_BYTES of int8 (but one
    row at least)."""
    from lightwell.kernels.int8_pack import GROUP

    rows = max(1, min(chunks, n // MIN_CHUNK_BYTES))
    per = -(-n // rows)
    cols = -(-per // (4 * GROUP)) * 4 * GROUP
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
        chunks: int = CHUNKS,
        int8: bool = False,
        beside_compute_only: bool = False,
        phases: int = 0,
        lanes: int = LANES,
    ) -> None:
        """``min_bytes``: smaller messages are left to other strategies (``supports``);
        ``chunks``: pieces per message (every rank must pass the same); ``int8``: the int8
        payload; ``beside_compute_only``: take only the all-reduces issued beside compute
        (``comm.base.beside_compute``: the dual-stream overlap), leaving the rest to other
        strategies (the selector's rule: back to back, hostmem's kernel is faster);
        ``phases``: calls in phases in flight at once (the dual-stream overlap's
        micro-batches; 0: ``start`` always declines); ``lanes``: streams a direction's chunks
        take turns on."""
        if not 1 <= chunks <= MAX_CHUNKS:
            raise ValueError(f"hostmem-copy chunks must be 1..{MAX_CHUNKS}, got {chunks}")
        self.chunks = chunks
        if not 1 <= lanes <= MAX_LANES:
            raise ValueError(f"hostmem-copy lanes must be 1..{MAX_LANES}, got {lanes}")
        self.lanes = lanes
        self.beside_compute_only = beside_compute_only
        self.int8 = int8
        if int8:  # (imported here: no Triton on the exact path's CPU tests)
            from lightwell.kernels import int8_pack

            self._int8 = int8_pack
        self.name = "hostmem-copy-int8" if int8 else "hostmem-copy"
        self.rank, self.size = ctx.rank, ctx.size
        self.peers = [r for r in range(ctx.size) if r != ctx.rank]
        self.max_bytes, self.min_bytes = max_bytes, min_bytes
        self.slot_bytes = _room(max_bytes)
        self.flag_bytes = -(-(2 * _FLAG_ROW * ctx.size**2) // 4096) * 4096
        total = self.flag_bytes + 2 * ctx.size * self.slot_bytes
        self.on_gpu = ctx.device.type == "cuda"
        self.memory, self.registered = map_pinned(self, ctx, total)
        self.calls = 0
        self.device = ctx.device
        # What each peer sent, copied in (int8: this rank's own packed message too; ``_row``):
        # ``phases`` sets for calls in phases (``start``), then one for whole calls. A whole
        # call's copies into its set are on the down stream after the caller's stream, which
        # consumed the previous whole call's sum; a set in phases is reused only after the
        # consumer's stream has run the previous ``finish`` on it (and waited for its copies).
        if phases < 0:
            raise ValueError(f"phases must be >= 0, got {phases}")
        rows = ctx.size if int8 else ctx.size - 1
        share = _room(min(max_bytes, max_bytes // max(phases, 2) + PHASE_MARGIN_BYTES))

        def stage_set(nbytes: int) -> torch.Tensor:
            return torch.empty(rows, nbytes, dtype=torch.uint8, device=ctx.device)

        self.phases = phases
        self.stages = [stage_set(share) for _ in range(phases)] + [stage_set(self.slot_bytes)]
        self.in_use = [False] * phases
        self.next_set = 0
        # per slot parity: the marker of this rank's flag writes after the last call in phases
        # of this forward (``_transfer``; cleared by ``end_forward``)
        self.order: list[Any] = [None, None]
        # the copy streams: the D2H copies of chunk c on ups[c % lanes] (ups[0]: the caller's
        # stream, so ``up_extra`` holds the others), the H2D copies on downs[c % lanes]
        if self.on_gpu:
            self.ops: _Ops = _DriverOps(self.memory)
            self.up_extra = [torch.cuda.Stream(ctx.device) for _ in range(lanes - 1)]
            self.downs = [torch.cuda.Stream(ctx.device) for _ in range(lanes)]
        else:  # (in order on CPU: no streams)
            self.ops = _HostOps(self.memory)
            self.up_extra, self.downs = [None] * (lanes - 1), [None] * lanes

    @staticmethod
    def available(ctx: CommContext) -> bool:
        if not 2 <= ctx.size <= 8:
            return False
        return torch.cuda.is_available() if ctx.device.type == "cuda" else True

    def _prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int] | None]:
        """(x contiguous, its int8 layout or None)."""
        x = x.contiguous()
        return x, int8_layout(x.numel(), self.chunks) if self.int8 else None

    def _payload(
        self, flat: torch.Tensor, layout: tuple[int, int] | None, stage: int
    ) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """The bytes to send (uint8 [B]) and their [start, end) byte range a chunk; int8: the
        message quantized into ``layout``'s (rows, cols), in stage set ``stage`` (on the
        current stream)."""
        n = flat.numel()
        if layout is None:
            item = flat.element_size()
            bounds = chunk_bounds(n, item, self.chunks)
            return flat.view(torch.uint8), [(a * item, b * item) for a, b in bounds]
        if self._wire_bytes(flat, layout) > self.stages[stage].shape[1]:
            raise ValueError(f"{n} elements do not fit hostmem-copy's stage set {stage}")
        rows, cols = layout
        rb = self._int8.packed_row_bytes(cols)
        mine = self._row(stage, self.rank)[: rows * rb]
        self._int8.quantize_pack(flat, rows, cols, out=mine.view(rows, rb))
        return mine, [(r * rb, (r + 1) * rb) for r in range(rows)]

    def supports(self, x: torch.Tensor) -> bool:
        return (
            x.dtype in _DTYPES
            and x.device.type == self.device.type
            and self.min_bytes <= message_bytes(x) <= self.max_bytes
            and (is_beside_compute() or not self.beside_compute_only)
            # a guard: the exact calls (the embedding's) are not issued beside compute
            and not (self.int8 and is_exact_sum())
        )

    def _slot(self, parity: int, rank: int) -> int:  # byte offset of a slot in the segment
        return self.flag_bytes + (parity * self.size + rank) * self.slot_bytes

    def _flag(self, parity: int, writer: int, reader: int, chunk: int) -> int:  # byte offset
        """Chunk ``chunk``'s flag, or (chunk ``MAX_CHUNKS``) the slot's busy word."""
        return ((parity * self.size + writer) * self.size + reader) * _FLAG_ROW + 4 * chunk

    def _row(self, stage: int, rank: int) -> torch.Tensor:  # uint8 [set bytes]
        """Rank ``rank``'s bytes in stage set ``stage``."""
        return self.stages[stage][rank if self.int8 else rank - (rank > self.rank)]

    def _wire_bytes(self, flat: torch.Tensor, layout: tuple[int, int] | None) -> int:
        if layout is None:
            return flat.numel() * flat.element_size()
        return layout[0] * self._int8.packed_row_bytes(layout[1])

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The whole call on the current stream (the last stage set)."""
        x, layout = self._prepare(x)
        flat = x.view(-1)
        whole = self.phases
        payload, bounds = self._payload(flat, layout, whole)  # (int8: quantized here)
        marks = self._transfer(payload, bounds, whole, phased=False)
        return self._sum_after(x, layout, whole, marks)

    def start(self, x: torch.Tensor) -> _Phased | None:
        """The call in phases, begun on the current stream (the stream that produced x: the
        int8 quantize runs here); ``transfer`` then goes on the comm stream and ``finish`` on
        the consumer's. None when every stage set is in flight or x does not fit one (call
        ``all_reduce``)."""
        x, layout = self._prepare(x)
        flat = x.view(-1)
        if not self.phases or self._wire_bytes(flat, layout) > self.stages[0].shape[1]:
            return None
        order = [(self.next_set + i) % self.phases for i in range(self.phases)]
        stage = next((i for i in order if not self.in_use[i]), None)
        if stage is None:
            return None
        payload, bounds = self._payload(flat, layout, stage)
        self.in_use[stage] = True
        self.next_set = (stage + 1) % self.phases
        return _Phased(self, x, layout, payload, bounds, stage)

    def end_forward(self) -> None:
        """Forget the calls in phases of this forward (their flag writes are joined into the
        stream that runs the next one, or a CUDA-graph capture ended with them)."""
        self.order = [None, None]

    def _claim(self) -> int:
        """Take the next call's slot (its parity): on the current stream (up), wait until every
        reader is done with the slot's previous message, then mark it busy. Needs no payload,
        so a call in phases claims before its stream waits for the quantize (``_Phased.claim``:
        the handshake's round trips run while the main stream still computes)."""
        self.calls += 1
        p = self.calls % 2
        ops, up, me, busy = self.ops, self._here(), self.rank, MAX_CHUNKS
        if self.order[p] is not None:  # this rank's lowering for the last call in phases
            ops.after(self.order[p], up)  # of this parity, before waiting for the peers'
        for r in self.peers:  # every reader is done with this slot's previous message
            ops.wait_flag(self._flag(p, me, r, busy), 0, up)
        for r in self.peers:
            ops.write_flag(self._flag(p, me, r, busy), 1, up)
        return p

    def _transfer(
        self,
        payload: torch.Tensor,
        bounds: list[tuple[int, int]],
        stage: int,
        phased: bool,
        p: int | None = None,
    ) -> tuple[Any, Any]:
        """Send ``payload``'s chunks and copy every peer's into stage set ``stage``: the
        handshake above, on the current stream (up) and the down streams, chunk c on lane
        c % lanes of each direction, in slot ``p`` (claimed here when None). Returns markers
        (on the first down stream) of the copies' end and of the flags' lowering after them
        (``_sum_after``)."""
        if p is None:
            p = self._claim()
        ops = self.ops
        up = self._here()
        used = min(self.lanes, len(bounds))
        ups, downs = [up, *self.up_extra][:used], self.downs[:used]
        ready = ops.record(up)  # the slot is claimed and the payload ready; for the downs also:
        for stream in ups[1:] + downs:  # the set's last sum has read it
            ops.after(ready, stream)
        # every down lane after the first one's work so far: the lowering of this rank's flags
        # after the earlier calls (a wait must not see a flag of this slot's previous message)
        if used > 1:
            tail = ops.record(downs[0])
            for stream in downs[1:]:
                ops.after(tail, stream)
        me, peers = self.rank, self.peers
        mine, busy = self._slot(p, me), MAX_CHUNKS
        raised = []
        for c, (a, b) in enumerate(bounds):
            lane = ups[c % used]
            ops.d2h(mine + a, payload, a, b, lane)
            for r in peers:
                ops.write_flag(self._flag(p, me, r, c), 1, lane)
            raised.append(ops.record(lane))
        for lane in ups[1:]:  # the up stream goes on once every lane has raised its chunks
            ops.after(ops.record(lane), up)
        for c, (a, b) in enumerate(bounds):
            lane = downs[c % used]
            # progress if the graph runs the streams in series: a wait for the peers' chunk c
            # comes after this rank's raise of every chunk up to c (the last on each lane)
            for k in range(max(0, c - used + 1), c + 1):
                ops.after(raised[k], lane)
            for q in peers:
                ops.wait_flag(self._flag(p, q, me, c), 1, lane)
                ops.h2d(self._row(stage, q), a, b, self._slot(p, q) + a, lane)
        down = downs[0]
        for lane in downs[1:]:
            ops.after(ops.record(lane), down)
        landed = ops.record(down)
        # the flags lowered after the last copy (off the copies' path): the writer raises them
        # again only once it sees the busy word down, lowered last
        for q in peers:
            for c in range(len(bounds)):
                ops.write_flag(self._flag(p, q, me, c), 0, down)
            ops.write_flag(self._flag(p, q, me, busy), 0, down)
        lowered = ops.record(down)
        if phased:
            self.order[p] = lowered
        return landed, lowered

    def _here(self) -> torch.cuda.Stream | None:  # the current stream (None on CPU)
        return torch.cuda.current_stream(self.device) if self.on_gpu else None

    def _sum_after(
        self,
        x: torch.Tensor,
        layout: tuple[int, int] | None,
        stage: int,
        marks: tuple[Any, Any],
        join: bool = True,
    ) -> torch.Tensor:
        """``_sum`` on the current stream once the copies have landed; with ``join``, the
        current stream then also waits for the down stream's flag writes (which joins a
        CUDA-graph capture's fork); without, the caller joins later (``_Phased.join``)."""
        here = self._here()
        landed, lowered = marks
        self.ops.after(landed, here)
        out = self._sum(x, layout, stage)
        if join:
            self.ops.after(lowered, here)
        return out

    def _sum(self, x: torch.Tensor, layout: tuple[int, int] | None, stage: int) -> torch.Tensor:
        """x plus every peer's copy in stage set ``stage``, in rank order, into x (on the
        current stream, after the copies)."""
        if layout is not None:
            rows, cols = layout
            self._int8.dequant_sum(self.stages[stage], cols, rows, x.view(-1))  # rank order
            return x
        nbytes = x.numel() * x.element_size()
        received = [self._row(stage, q)[:nbytes].view(x.dtype).view(x.shape) for q in self.peers]
        return rank_order_sum(received[: self.rank] + [x] + received[self.rank :], x)

    def close(self) -> None:
        if self.on_gpu and self.registered:
            torch.cuda.synchronize(self.device)  # no copy may still use it
        self.ops = self.memory = self.stages = None
        self._release()


class _Phased:
    """One call in phases (``HostMemCopyAllReduce.start``)."""

    def __init__(
        self,
        owner: HostMemCopyAllReduce,
        x: torch.Tensor,
        layout: tuple[int, int] | None,
        payload: torch.Tensor,
        bounds: list[tuple[int, int]],
        stage: int,
    ) -> None:
        self.owner, self.x, self.layout = owner, x, layout
        self.payload, self.bounds, self.stage = payload, bounds, stage
        self.marks: tuple[Any, Any] = (None, None)  # set by transfer
        self.held = True  # the stage set, until finish (or release)
        self.parity: int | None = None  # the slot, once claimed

    def claim(self) -> None:
        """The slot handshake, on the current stream (the comm stream, before it waits for
        the stream that quantizes, so its round trips overlap the quantize). Once a call."""
        if self.parity is not None:
            raise RuntimeError("this call has claimed its slot already")
        self.parity = self.owner._claim()

    def transfer(self) -> None:
        """The copies and flags, on the current stream (the comm stream) and the strategy's
        down stream: no kernel; the current stream does not wait for the down stream.
        Claims the slot first unless ``claim`` did."""
        self.marks = self.owner._transfer(
            self.payload, self.bounds, self.stage, phased=True, p=self.parity
        )

    def finish(self) -> torch.Tensor:
        """The sum, on the current stream (the consumer's, after it waited for the current
        stream of ``transfer``), once the peers' copies have landed; gives the set back. The
        flags' lowering after the copies is left to ``join`` (waiting for it here would hold
        the consumer for a round trip a call)."""
        try:
            return self.owner._sum_after(self.x, self.layout, self.stage, self.marks, join=False)
        finally:
            self.release()

    def release(self) -> None:
        """Give the stage set back (``finish`` does; a forward that failed midway calls it),
        and drop the tensors (the caller holds the sum)."""
        if self.held:
            self.held = False
            self.owner.in_use[self.stage] = False
            self.x = self.payload = None

    def join(self) -> None:
        """The current stream waits for the down stream's last writes of this call (done long
        since, as a rule): before a CUDA-graph capture ends, every call must be joined."""
        self.owner.ops.after(self.marks[1], self.owner._here())


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
