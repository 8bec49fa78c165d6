"""One-kernel all-reduce through pinned host memory, summed on the GPUs (no peer access needed).

Every rank's GPU maps the same pinned host segment (lightwell/distributed/comm/hostmem.py sets it
up). One launch per all-reduce, one program per block of ``BLOCK`` elements:

    1. publish: the program writes its block of x into this rank's slot in host memory (over
       PCIe: posted writes), as x's dtype or as int8 + one fp32 scale per GROUP elements;
    2. flag: a system-scope release store of the program's epoch into flags[rank, block];
    3. wait: acquire loads of flags[peer, block] until every peer has published this epoch;
    4. sum: the peers' blocks are read from host memory (cache-bypassing loads), this rank's own
       from x, summed in fp32 in rank order (every rank computes the same bytes), stored to out;
       or (NORM) added to the residual and RMS-normalised, both stored (``_finish``).

Epochs are counted per block in device memory, so a CUDA graph replays correctly. Slots alternate
between two buffers by epoch parity: a program writes buffer e % 2 at epoch e only after it has
seen every peer reach epoch e - 1 for the same block, and a peer's program for epoch e - 1 runs
after (stream order) its read of epoch e - 2; so nothing is overwritten while still being read.
Blocks of both ranks are dispatched in index order, so a program never waits for a peer block
that cannot be scheduled (the ranks' resident programs all publish before they wait).

Waits are bounded (``max_spin`` polls): a peer that never arrives makes the kernel set
``status`` and, on the GPU, trap: a CUDA error that the worker reports, instead of a hung GPU
or silently wrong sums (under the interpreter it returns, and the tests read ``status``).
Epochs are int32 and wrap after 2**31 calls of a block: the flag comparison is wrap-safe.

int8: each rank's block is quantized once (absmax / 127 per GROUP values, round half away from
zero) and every rank sums the same dequantized values, its own included: the result is identical
on every rank and each element is off by at most (sum over ranks of its group's absmax) / 254.

On the GPU the flag accesses are PTX ``ld.acquire.sys`` / ``st.release.sys`` by one thread per
program, fenced for the others by barriers; under the Triton interpreter (CPU tests, the slots in
shared memory between processes) volatile loads and plain stores.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from lightwell.kernels.int8_pack import GROUP, aligned, packed_row_bytes, quantize_groups
from lightwell.kernels.rmsnorm import norm_row

BLOCK = 4096  # elements per program: 8 KB of bf16, 4 KB + 128 B of int8 + scales


@triton.jit
def _wait_flag(ptr, epoch, max_spin, ASM: tl.constexpr):
    """Poll ``*ptr`` until it reaches ``epoch`` (acquire) or ``max_spin`` polls; returns 1 if it
    gave up. On the GPU one thread polls (a poll per thread would flood PCIe with reads) and
    the caller's barrier holds the others back."""
    if ASM:
        return tl.inline_asm_elementwise(
            """{
            .reg .pred p_other, p_done, p_out;
            .reg .b32 r_tid, r_val, r_n, r_d;
            mov.b32 $0, 0;
            mov.u32 r_tid, %tid.x;
            setp.ne.u32 p_other, r_tid, 0;
            @p_other bra WAIT_END;
            mov.b32 r_n, 0;
            WAIT_LOOP:
            ld.acquire.sys.global.b32 r_val, [$1];
            sub.s32 r_d, r_val, $2;
            setp.ge.s32 p_done, r_d, 0;
            @p_done bra WAIT_END;
            add.u32 r_n, r_n, 1;
            setp.ge.u32 p_out, r_n, $3;
            @!p_out bra WAIT_LOOP;
            mov.b32 $0, 1;
            WAIT_END:
            }""",
            "=r,l,r,r",
            [ptr, epoch, max_spin],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )
    else:
        spins = 0
        while (tl.load(ptr, volatile=True) - epoch < 0) & (spins < max_spin):
            spins += 1
        return (spins >= max_spin).to(tl.int32)


@triton.jit
def _give_up(status_ptr, ASM: tl.constexpr):
    """A wait ran out: note it in ``status``; on the GPU also abort the kernel (a CUDA error
    the worker reports: a peer that stopped must not turn into silently wrong sums)."""
    tl.store(status_ptr, 1)
    if ASM:
        tl.inline_asm_elementwise(
            "trap; mov.b32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1
        )


@triton.jit
def _release(ptr, value, ASM: tl.constexpr):
    """``*ptr = value`` with release semantics at system scope, by one thread (after the
    caller's barrier, which orders the other threads' stores before it)."""
    if ASM:
        tl.inline_asm_elementwise(
            """{
            .reg .pred p_zero;
            .reg .b32 r_tid;
            mov.u32 r_tid, %tid.x;
            setp.eq.u32 p_zero, r_tid, 0;
            @p_zero st.release.sys.global.b32 [$1], $2;
            mov.b32 $0, 0;
            }""",
            "=r,l,r",
            [ptr, value],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )
    else:
        tl.store(ptr, value)


@triton.jit
def _quantize(v, BLOCK: tl.constexpr, GROUP: tl.constexpr):
    """fp32 [BLOCK] -> (int8-valued fp32 [BLOCK // GROUP, GROUP], scales [BLOCK // GROUP])."""
    return quantize_groups(tl.reshape(v, (BLOCK // GROUP, GROUP)))


@triton.jit
def _norm_inputs(res_ptr, w_ptr, offs, mask, NORM: tl.constexpr, HIDDEN: tl.constexpr):
    """The residual block and the norm weight (the flag kernel loads them before its wait, so
    their HBM latency hides behind the PCIe round trip); placeholders without NORM."""
    if NORM:
        return tl.load(res_ptr + offs, mask=mask, other=0.0), tl.load(w_ptr + tl.arange(0, HIDDEN))
    else:
        return 0.0, 0.0


@triton.jit
def _finish(
    acc,  # fp32 [BLOCK]: the block's sum
    offs,  # int64 [BLOCK]: its element offsets
    mask,
    out_ptr,
    r,  # NORM: the residual block (_norm_inputs)
    w,  # NORM: the weight [HIDDEN]
    res_out_ptr,
    eps,
    BLOCK: tl.constexpr,
    NORM: tl.constexpr,
    HIDDEN: tl.constexpr,
):
    """Store the sum, rounded to the output dtype; with NORM (the block holds BLOCK // HIDDEN
    whole rows) store instead ``h = sum + residual`` to res_out and RMSNorm(h) * w to out, with
    the rounding of lightwell/kernels/rmsnorm.py's fused_add_rmsnorm applied to the rounded
    sum: the all-reduce followed by that kernel, in one pass (the new residual bit for bit;
    the norm's sum of squares may differ in the last bit, being reduced in another order)."""
    s = acc.to(out_ptr.dtype.element_ty)
    if NORM:
        h = (s.to(tl.float32) + r.to(tl.float32)).to(out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + offs, h, mask=mask)
        if BLOCK == HIDDEN:  # one row a block: the norm kernel's own row math
            y = norm_row(h, w.to(tl.float32), eps, HIDDEN)
        else:
            hf = tl.reshape(h.to(tl.float32), (BLOCK // HIDDEN, HIDDEN))
            rstd = 1.0 / tl.sqrt(tl.sum(hf * hf, 1) / HIDDEN + eps)
            normed = (hf * rstd[:, None]).to(out_ptr.dtype.element_ty).to(tl.float32)
            y = tl.reshape(normed * w.to(tl.float32)[None, :], (BLOCK,))
        tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + offs, s, mask=mask)


@triton.jit(do_not_specialize=["n", "rank", "max_spin"])
def _hostmem_all_reduce_kernel(
    x_ptr,  # [n] this rank's input (device)
    out_ptr,  # [n] the sum (device)
    slot_ptr,  # host slots in x's dtype (plain) or int8 (INT8): [2, WORLD, slot_elems]
    scale_ptr,  # the same host slots as fp32 (INT8 scales); unused otherwise
    flag_ptr,  # int32 [WORLD, max_blocks] in host memory
    epoch_ptr,  # int32 [max_blocks] in device memory: epochs this rank has completed
    status_ptr,  # int32 [1] device memory: set to 1 when a wait gave up
    res_ptr,  # NORM: [n] the residual (device)
    res_out_ptr,  # NORM: [n] the new residual, sum + residual (device)
    w_ptr,  # NORM: [HIDDEN] the RMSNorm weight
    eps,
    n,
    rank,
    max_spin,
    SLOT_ELEMS: tl.constexpr,  # elements (bytes when INT8) per rank slot
    MAX_BLOCKS: tl.constexpr,
    WORLD: tl.constexpr,
    BLOCK: tl.constexpr,
    GROUP: tl.constexpr,
    INT8: tl.constexpr,
    ASM: tl.constexpr,
    NORM: tl.constexpr,  # fuse the residual add + RMSNorm that consumes the sum (_finish)
    HIDDEN: tl.constexpr,  # NORM: the row length, a divisor of BLOCK
    ALIGN: tl.constexpr = False,  # n % 16 == 0: the masked loads and stores become vectors
):
    if ALIGN:  # (a bare multiple_of hint on a scalar argument does not reach the loads)
        n = n // 16 * 16
    # persistent programs: program i takes blocks i, i + P, ... (the same blocks on every rank)
    nblocks = tl.cdiv(n, BLOCK)
    BLOCK_BYTES: tl.constexpr = BLOCK + 4 * (BLOCK // GROUP)
    for b in range(tl.program_id(0), nblocks, tl.num_programs(0)):
        offs = tl.cast(b, tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        epoch = tl.load(epoch_ptr + b) + 1
        buf = epoch & 1  # (epochs wrap at 2**31: & keeps the parity non-negative)
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)

        # 1. publish this rank's block
        mine = (buf * WORLD + rank).to(tl.int64) * SLOT_ELEMS
        if INT8:
            q, scale = _quantize(x.to(tl.float32), BLOCK, GROUP)
            base = mine + tl.cast(b, tl.int64) * BLOCK_BYTES
            tl.store(slot_ptr + base + tl.arange(0, BLOCK), tl.reshape(q, (BLOCK,)).to(tl.int8))
            tl.store(scale_ptr + (base + BLOCK) // 4 + tl.arange(0, BLOCK // GROUP), scale)
        else:
            tl.store(slot_ptr + mine + offs, x)  # whole blocks (zeros past n): unmasked, vectorised
        r, w = _norm_inputs(res_ptr, w_ptr, offs, mask, NORM, HIDDEN)

        # 2. flag it (every thread's stores above come before the release)
        tl.debug_barrier()
        _release(flag_ptr + rank * MAX_BLOCKS + b, epoch, ASM)

        # 3. wait for every peer's block of this epoch
        gave_up = 0
        for p in tl.static_range(WORLD):
            if p != rank:
                gave_up += _wait_flag(flag_ptr + p * MAX_BLOCKS + b, epoch, max_spin, ASM)
        tl.debug_barrier()
        if gave_up > 0:
            _give_up(status_ptr, ASM)

        # 4. sum in rank order
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for p in tl.static_range(WORLD):
            if INT8:
                if p == rank:
                    v = q * scale[:, None]
                else:
                    base = (buf * WORLD + p).to(tl.int64) * SLOT_ELEMS
                    base += tl.cast(b, tl.int64) * BLOCK_BYTES
                    pq = tl.load(slot_ptr + base + tl.arange(0, BLOCK), cache_modifier=".cv")
                    ps = tl.load(
                        scale_ptr + (base + BLOCK) // 4 + tl.arange(0, BLOCK // GROUP),
                        cache_modifier=".cv",
                    )
                    v = tl.reshape(pq, (BLOCK // GROUP, GROUP)).to(tl.float32) * ps[:, None]
                acc += tl.reshape(v, (BLOCK,))
            else:
                if p == rank:
                    acc += x.to(tl.float32)
                else:
                    peer = (buf * WORLD + p).to(tl.int64) * SLOT_ELEMS
                    v = tl.load(slot_ptr + peer + offs, cache_modifier=".cv")
                    acc += v.to(tl.float32)
        _finish(acc, offs, mask, out_ptr, r, w, res_out_ptr, eps, BLOCK, NORM, HIDDEN)
        tl.store(epoch_ptr + b, epoch)


def num_blocks(n: int, block: int = BLOCK) -> int:
    return -(-n // block)


@dataclass(frozen=True)
class HostMemBuffers:
    """What one all-reduce instance hands its kernel: the host segment's views (GPU-addressed
    on a GPU), this rank's counters and the launch shape. Every rank must hold the same
    ``world``, ``max_programs`` and ``block`` (elements per block, a power of two >= GROUP)."""

    data: torch.Tensor  # uint8: the slots, [2 parities, world, slot bytes]
    flags: torch.Tensor  # int32 [world, max_blocks] (flag protocol)
    epochs: torch.Tensor  # int32 [max_blocks], device memory
    status: torch.Tensor  # int32 [1], device memory: 1 once a wait gave up
    rank: int
    world: int
    max_spin: int
    use_asm: bool  # compiled for a GPU (PTX acquire/release, trap)
    max_programs: int = 1 << 30  # programs sharing the blocks (fewer leave SMs to compute)
    block: int = BLOCK
    # ll protocol: where this rank's words go, laid out like ``data`` (peer memory: the peer's
    # buffer, while ``data`` is this rank's own, which the peer writes); None: ``data`` itself
    dst: torch.Tensor | None = None
    _views: dict = field(default_factory=dict, repr=False, compare=False)

    def view(self, dtype: torch.dtype, dst: bool = False) -> torch.Tensor:
        """``data`` (``dst``: the write side) as ``dtype``, made once (not on every launch)."""
        key = (dtype, dst and self.dst is not None)
        v = self._views.get(key)
        if v is None:
            v = self._views[key] = (self.dst if key[1] else self.data).view(dtype)
        return v

    def check_fits(self, x: torch.Tensor, bytes_per_block: int) -> int:
        """Blocks of ``x``; raises if they exceed the counters or a rank's slot."""
        blocks = num_blocks(x.numel(), self.block)
        if blocks > self.epochs.numel() or blocks * bytes_per_block > self.data.numel() // (
            2 * self.world
        ):
            raise ValueError(
                f"message of {x.numel()} elements does not fit the host all-reduce buffers"
            )
        return blocks


@dataclass(frozen=True)
class AddRMSNorm:
    """The residual add + RMSNorm that consumes an all-reduce's sum, fused into its kernel:
    the call returns ``(rmsnorm(sum + residual) * weight, sum + residual)``."""

    residual: torch.Tensor  # like x
    weight: torch.Tensor  # [x.shape[-1]]
    eps: float


def can_fuse_norm(x: torch.Tensor, norm: AddRMSNorm, block: int = BLOCK) -> bool:
    """Whether the kernels can fuse ``norm`` for ``x``: x is [T, H] with H dividing ``block``
    (every block holds whole rows), residual like x, weight [H] of x's dtype, all contiguous."""
    if x.dim() != 2 or x.shape[1] == 0 or block % x.shape[1] or not x.is_contiguous():
        return False
    r, w = norm.residual, norm.weight
    return (
        r.shape == x.shape
        and r.dtype == x.dtype
        and r.is_contiguous()
        and w.shape == (x.shape[1],)
        and w.dtype == x.dtype
        and w.is_contiguous()
    )


def _norm_launch(x: torch.Tensor, out: torch.Tensor, norm: AddRMSNorm | None):
    """The kernels' NORM arguments: (pointer args, constexprs, the new-residual tensor). The
    caller has checked ``can_fuse_norm`` (once per call: this is the launch path)."""
    if norm is None:
        return (x, out, x, 0.0), {"NORM": False, "HIDDEN": 1}, None
    res_out = torch.empty_like(x)
    args = (norm.residual, res_out, norm.weight, float(norm.eps))
    return args, {"NORM": True, "HIDDEN": x.shape[1]}, res_out


def _result(out: torch.Tensor, res_out: torch.Tensor | None):
    return out if res_out is None else (out, res_out)


def hostmem_all_reduce(
    x: torch.Tensor, bufs: HostMemBuffers, int8: bool, norm: AddRMSNorm | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Sum of ``x`` over the ranks (a new tensor shaped like x), flag protocol; with ``norm``
    (one that ``can_fuse_norm`` accepts), ``(rmsnorm(sum + residual) * weight, sum +
    residual)`` instead (``AddRMSNorm``). Every rank calls with the same shape and dtype, in
    the same order."""
    x = x.contiguous()
    size = 1 if int8 else x.element_size()
    per_block = packed_row_bytes(bufs.block) if int8 else bufs.block * size  # int8: + scales
    blocks = bufs.check_fits(x, per_block)
    slots = bufs.view(torch.int8 if int8 else x.dtype)
    out = torch.empty_like(x)
    norm_args, norm_consts, res_out = _norm_launch(x, out, norm)
    _hostmem_all_reduce_kernel[(min(blocks, bufs.max_programs),)](
        x,
        out,
        slots,
        bufs.view(torch.float32),
        bufs.flags,
        bufs.epochs,
        bufs.status,
        *norm_args,
        x.numel(),
        bufs.rank,
        bufs.max_spin,
        SLOT_ELEMS=slots.numel() // (2 * bufs.world),
        MAX_BLOCKS=bufs.flags.numel() // bufs.world,
        WORLD=bufs.world,
        BLOCK=bufs.block,
        GROUP=GROUP,
        INT8=int8,
        ASM=bufs.use_asm,
        **norm_consts,
        ALIGN=aligned(x.numel()),
        num_warps=8 if bufs.block >= 4096 else 4,
    )
    return _result(out, res_out)


# ---- the low-latency protocol (small messages) ------------------------------------------------
# Every 8-byte word in host memory carries 4 bytes of payload and, in its high half, the epoch
# it was written in. Aligned 8-byte stores reach host memory whole, so a reader that sees the
# expected epoch in a word also sees that word's payload: no flag, no system fence, no second
# round trip; the reader polls the data itself. Twice the bytes: for decode-sized messages,
# where latency is everything.


def ll_words_per_block(block: int, int8: bool, elem_size: int) -> int:
    """8-byte words one block takes in a slot: payload words, then (int8) scale words."""
    if int8:
        return block // 4 + block // GROUP
    return block * elem_size // 4


@triton.jit
def _ll_pack(v, COMP: tl.constexpr, BITS: tl.constexpr):
    """Integer [N] whose low BITS bits are payload -> int32 [N // COMP], COMP fields a word."""
    if COMP == 1:
        return v.to(tl.int32)
    else:
        fields = tl.reshape(v.to(tl.int32) & ((1 << BITS) - 1), (v.shape[0] // COMP, COMP))
        return tl.sum(fields << (tl.arange(0, COMP) * BITS)[None, :], 1)


@triton.jit
def _ll_words(data, epoch):
    """int32 payload [N] -> int64 LL words [N]: (epoch << 32) | payload."""
    return (epoch.to(tl.int64) << 32) | (data.to(tl.int64) & 0xFFFFFFFF)


@triton.jit
def _ll_poll(ptrs, epoch, max_spin):
    """Load LL words until every one carries ``epoch`` (or ``max_spin`` reloads): (payload
    int32 [N], 1 if it gave up)."""
    w = tl.load(ptrs, volatile=True)
    ok = tl.min(((w >> 32).to(tl.int32) == epoch).to(tl.int32), 0)
    spins = 0
    while (ok == 0) & (spins < max_spin):
        spins += 1
        w = tl.load(ptrs, volatile=True)
        ok = tl.min(((w >> 32).to(tl.int32) == epoch).to(tl.int32), 0)
    return w.to(tl.int32), (spins >= max_spin).to(tl.int32)


@triton.jit
def _ll_unpack(data, COMP: tl.constexpr, BITS: tl.constexpr, INT_TY: tl.constexpr):
    """int32 [N] -> INT_TY [N * COMP]: the fields back in element order."""
    fields = (data[:, None] >> (tl.arange(0, COMP) * BITS)[None, :]).to(INT_TY)
    return tl.reshape(fields, (data.shape[0] * COMP,))


@triton.jit(do_not_specialize=["n", "rank", "max_spin"])
def _hostmem_ll_kernel(
    x_ptr,  # [n] this rank's input (device)
    out_ptr,  # [n] the sum (device)
    slot_ptr,  # int64 LL words in host (peermem: this GPU's) memory: [2, WORLD, SLOT_WORDS]
    dst_ptr,  # where this rank writes its words: slot_ptr, or the peer's buffer (peermem)
    epoch_ptr,  # int32 [max_blocks] device memory
    status_ptr,  # int32 [1] device memory: set to 1 when a wait gave up
    res_ptr,  # NORM: as in _hostmem_all_reduce_kernel
    res_out_ptr,
    w_ptr,
    eps,
    n,
    rank,
    max_spin,
    SLOT_WORDS: tl.constexpr,
    WPB: tl.constexpr,  # words per block: ll_words_per_block
    WORLD: tl.constexpr,
    BLOCK: tl.constexpr,
    GROUP: tl.constexpr,
    INT8: tl.constexpr,
    COMP: tl.constexpr,  # payload fields per 32-bit word: 4 (int8), 2 (16-bit x), 1 (fp32)
    INT_TY: tl.constexpr,  # the integer type of one field
    ASM: tl.constexpr,  # on a GPU: trap when a wait gives up
    NORM: tl.constexpr,
    HIDDEN: tl.constexpr,
    ALIGN: tl.constexpr = False,  # as in _hostmem_all_reduce_kernel
):
    if ALIGN:
        n = n // 16 * 16
    BITS: tl.constexpr = 32 // COMP
    NDATA: tl.constexpr = BLOCK // COMP
    nblocks = tl.cdiv(n, BLOCK)
    for b in range(tl.program_id(0), nblocks, tl.num_programs(0)):
        offs = tl.cast(b, tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        epoch = tl.load(epoch_ptr + b) + 1
        buf = epoch & 1
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
        block_base = tl.cast(b, tl.int64) * WPB
        mine = (buf * WORLD + rank).to(tl.int64) * SLOT_WORDS + block_base
        if INT8:
            q, scale = _quantize(x.to(tl.float32), BLOCK, GROUP)
            data = _ll_pack(tl.reshape(q, (BLOCK,)), COMP, BITS)
            sdata = scale.to(tl.int32, bitcast=True)
            tl.store(
                dst_ptr + mine + NDATA + tl.arange(0, BLOCK // GROUP),
                _ll_words(sdata, epoch),
                cache_modifier=".wt",
            )
        else:
            data = _ll_pack(x.to(INT_TY, bitcast=True), COMP, BITS)
        # write-through: the words must leave the GPU's caches for host memory (a plain store
        # to a peer GPU's memory: it goes over NVLink to that GPU's L2, which its polls read)
        tl.store(dst_ptr + mine + tl.arange(0, NDATA), _ll_words(data, epoch), cache_modifier=".wt")

        acc = tl.zeros([BLOCK], dtype=tl.float32)
        gave_up = 0
        for p in tl.static_range(WORLD):
            if p == rank:
                if INT8:
                    acc += tl.reshape(q * scale[:, None], (BLOCK,))
                else:
                    acc += x.to(tl.float32)
            else:
                peer = (buf * WORLD + p).to(tl.int64) * SLOT_WORDS + block_base
                pdata, g1 = _ll_poll(slot_ptr + peer + tl.arange(0, NDATA), epoch, max_spin)
                gave_up += g1
                vals = _ll_unpack(pdata, COMP, BITS, INT_TY)
                if INT8:
                    sw, g2 = _ll_poll(
                        slot_ptr + peer + NDATA + tl.arange(0, BLOCK // GROUP), epoch, max_spin
                    )
                    gave_up += g2
                    pscale = sw.to(tl.float32, bitcast=True)
                    v = tl.reshape(vals, (BLOCK // GROUP, GROUP)).to(tl.float32) * pscale[:, None]
                    acc += tl.reshape(v, (BLOCK,))
                else:
                    acc += vals.to(x_ptr.dtype.element_ty, bitcast=True).to(tl.float32)
        if gave_up > 0:
            _give_up(status_ptr, ASM)
        # loaded after the polls, unlike the flag kernel: loaded before, they make batch-1
        # decode (one program) slower
        r, w = _norm_inputs(res_ptr, w_ptr, offs, mask, NORM, HIDDEN)
        _finish(acc, offs, mask, out_ptr, r, w, res_out_ptr, eps, BLOCK, NORM, HIDDEN)
        tl.store(epoch_ptr + b, epoch)


_INT_OF_SIZE = {1: tl.int8, 2: tl.int16, 4: tl.int32}


def hostmem_ll_all_reduce(
    x: torch.Tensor, bufs: HostMemBuffers, int8: bool, norm: AddRMSNorm | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``hostmem_all_reduce`` with the low-latency protocol (the slots hold int64 words)."""
    x = x.contiguous()
    size = x.element_size()
    wpb = ll_words_per_block(bufs.block, int8, size)
    blocks = bufs.check_fits(x, 8 * wpb)
    words = bufs.view(torch.int64)
    out = torch.empty_like(x)
    norm_args, norm_consts, res_out = _norm_launch(x, out, norm)
    _hostmem_ll_kernel[(min(blocks, bufs.max_programs),)](
        x,
        out,
        words,
        bufs.view(torch.int64, dst=True),
        bufs.epochs,
        bufs.status,
        *norm_args,
        x.numel(),
        bufs.rank,
        bufs.max_spin,
        SLOT_WORDS=words.numel() // (2 * bufs.world),
        WPB=wpb,
        WORLD=bufs.world,
        BLOCK=bufs.block,
        GROUP=GROUP,
        INT8=int8,
        COMP=4 if int8 else 4 // size,
        INT_TY=_INT_OF_SIZE[1 if int8 else size],
        ASM=bufs.use_asm,
        **norm_consts,
        ALIGN=aligned(x.numel()),
        num_warps=8 if bufs.block >= 4096 else 4,
    )
    return _result(out, res_out)
