"""Fused kernels of the int8-quantized all-reduces (hostmem-copy-int8; the torch reference is
lightwell/experimental/comm/int8_nccl.py).

The wire format is the one of ``int8.pack``: per chunk (row), C int8 values, then C / GROUP
fp32 scales (absmax / 127 of each group of GROUP values). Three kernels replace a dozen torch
ops each way:

    quantize_pack(x, w, C)           x [N] float -> uint8 [w, C + 4 C / GROUP] (zero-padded)
    dequant_sum_requant(recv, C)     uint8 [w, bytes] -> uint8 [1, bytes]: sum of the w chunks
                                     in fp32, requantized
    unpack_dequant(gathered, C, n)   uint8 [w, bytes] -> [n] in the output dtype
    dequant_sum(stage, C, R, out)    uint8 [w, >= R bytes] (every rank's R packed chunks) ->
                                     out [n]: the sum over ranks in fp32, rounded once
                                     (hostmem-copy-int8)

Rounding is half away from zero (torch.round in the reference rounds half to even): the same
bound, half a step per rounding, and every rank computes the same bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

GROUP = 128  # elements per scale: equals lightwell.experimental.comm.int8_nccl.GROUP (tested)
# Groups a program of quantize_pack / dequant_sum: one group a program (a warp's worth of
# work) is far from the bandwidth; of 4-32 groups x 2-8 warps, 16 x 4 is the fastest for both.
GROUPS_PER_PROGRAM = 16
TILE_WARPS = 4  # warps a program of those two kernels


@triton.jit
def _round_clamp(y):
    r = tl.where(y >= 0, tl.floor(y + 0.5), tl.ceil(y - 0.5))
    return tl.minimum(tl.maximum(r, -127.0), 127.0)


@triton.jit
def _store_group(q_ptr, s_ptr, row, g, vals, row_bytes, cols, GROUP: tl.constexpr):
    """Quantize one group of fp32 ``vals`` into chunk ``row`` of a packed buffer."""
    offs = tl.arange(0, GROUP)
    scale = tl.maximum(tl.max(tl.abs(vals), 0), 1e-30) / 127.0
    q = _round_clamp(vals / scale).to(tl.int8)
    base = row.to(tl.int64) * row_bytes
    tl.store(q_ptr + base + g * GROUP + offs, q)
    tl.store(s_ptr + (base + cols) // 4 + g, scale)


@triton.jit
def quantize_groups(g):
    """fp32 [G, GROUP] -> (int8-valued fp32 [G, GROUP], scales [G]): each row's absmax / 127,
    rounded half away from zero (the hostmem kernel quantizes its blocks with this too)."""
    scale = tl.maximum(tl.max(tl.abs(g), 1), 1e-30) / 127.0
    return _round_clamp(g / scale[:, None]), scale


@triton.jit
def _group_tile(gp, cols, GROUP: tl.constexpr, GPP: tl.constexpr):
    """Program ``gp``'s GPP groups of a packed row: (group indices [GPP], which exist [GPP],
    element offsets in the row [GPP, GROUP])."""
    gi = gp * GPP + tl.arange(0, GPP)
    offs = gi[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    return gi, gi < cols // GROUP, offs


# Sizes change with every message: not specialised (no compile per new "divisible by 16" mix).
@triton.jit(do_not_specialize=["n", "row_bytes", "cols"])
def _quantize_pack_kernel(
    x_ptr, q_ptr, s_ptr, n, row_bytes, cols,
    GROUP: tl.constexpr, GPP: tl.constexpr, ALIGN: tl.constexpr,
):  # fmt: skip
    """GPP groups a program (a [GPP, GROUP] tile; each group's math as ``_store_group``)."""
    if ALIGN:  # see aligned: lets the loads and stores be 16-byte vectors
        n, row_bytes, cols = n // 16 * 16, row_bytes // 16 * 16, cols // 16 * 16
    gp, row = tl.program_id(0), tl.program_id(1)  # groups on axis 0 (no 65,535 cap)
    gi, g_ok, offs = _group_tile(gp, cols, GROUP, GPP)
    idx = row.to(tl.int64) * cols + offs
    vals = tl.load(x_ptr + idx, mask=g_ok[:, None] & (idx < n), other=0.0).to(tl.float32)
    q, scale = quantize_groups(vals)
    q = q.to(tl.int8)
    base = row.to(tl.int64) * row_bytes
    tl.store(q_ptr + base + offs, q, mask=g_ok[:, None])
    tl.store(s_ptr + (base + cols) // 4 + gi, scale, mask=g_ok)


@triton.jit(do_not_specialize=["num_rows", "row_bytes", "cols"])
def _dequant_sum_requant_kernel(
    q_in_ptr, s_in_ptr, q_out_ptr, s_out_ptr, num_rows, row_bytes, cols, GROUP: tl.constexpr
):
    g = tl.program_id(0)
    offs = tl.arange(0, GROUP)
    acc = tl.zeros([GROUP], dtype=tl.float32)
    for r in range(num_rows):
        base = r * row_bytes
        q = tl.load(q_in_ptr + base + g * GROUP + offs).to(tl.float32)
        acc += q * tl.load(s_in_ptr + (base + cols) // 4 + g)
    _store_group(q_out_ptr, s_out_ptr, g * 0, g, acc, row_bytes, cols, GROUP)


@triton.jit(do_not_specialize=["n", "row_bytes", "cols"])
def _unpack_dequant_kernel(q_ptr, s_ptr, out_ptr, n, row_bytes, cols, GROUP: tl.constexpr):
    g, row = tl.program_id(0), tl.program_id(1)  # groups on axis 0 (no 65,535 cap)
    offs = tl.arange(0, GROUP)
    base = row.to(tl.int64) * row_bytes
    q = tl.load(q_ptr + base + g * GROUP + offs).to(tl.float32)
    vals = q * tl.load(s_ptr + (base + cols) // 4 + g)
    idx = row.to(tl.int64) * cols + g * GROUP + offs
    tl.store(out_ptr + idx, vals.to(out_ptr.dtype.element_ty), mask=idx < n)


@triton.jit(do_not_specialize=["n", "world", "rank_stride", "row_bytes", "cols"])
def _dequant_sum_kernel(
    q_ptr, s_ptr, out_ptr, n, world, rank_stride, row_bytes, cols,
    GROUP: tl.constexpr, GPP: tl.constexpr, ALIGN: tl.constexpr,
):  # fmt: skip
    if ALIGN:  # see aligned
        n, row_bytes, cols = n // 16 * 16, row_bytes // 16 * 16, cols // 16 * 16
        rank_stride = rank_stride // 16 * 16
    gp, row = tl.program_id(0), tl.program_id(1)  # groups on axis 0 (no 65,535 cap)
    gi, g_ok, offs = _group_tile(gp, cols, GROUP, GPP)
    acc = tl.zeros([GPP, GROUP], dtype=tl.float32)
    base = row.to(tl.int64) * row_bytes  # rank 0's row
    for r in range(world):  # rank order: every rank adds the same values the same way
        at = base + tl.cast(r, tl.int64) * rank_stride
        q = tl.load(q_ptr + at + offs, mask=g_ok[:, None], other=0).to(tl.float32)
        acc += q * tl.load(s_ptr + (at + cols) // 4 + gi, mask=g_ok, other=0.0)[:, None]
    idx = row.to(tl.int64) * cols + offs
    tl.store(out_ptr + idx, acc.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & (idx < n))


# Sizes are not specialised (above), so Triton cannot tell that a message's rows start 16
# bytes apart. Where the sizes are multiples of 16, the kernels round them down to a multiple
# of 16 (a no-op that Triton can see through; a tl.multiple_of hint on a scalar argument does
# not reach the loads), so the masked loads and stores become 16-byte vectors: one more
# compiled variant.


def aligned(*sizes: int) -> bool:
    return all(size % 16 == 0 for size in sizes)


def packed_row_bytes(cols: int) -> int:
    return cols + 4 * (cols // GROUP)


def _views(buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 and fp32 views of a packed uint8 buffer (the same bytes)."""
    return buf.view(torch.int8), buf.view(-1).view(torch.float32)


def _check_cols(cols: int) -> None:
    if cols <= 0 or cols % GROUP:
        raise ValueError(f"chunk length must be a positive multiple of {GROUP}, got {cols}")


def quantize_pack(
    x: torch.Tensor, num_rows: int, cols: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """x (any shape, contiguous, numel <= num_rows * cols) -> uint8 [num_rows, bytes] (into
    ``out`` when given: contiguous, that shape); the elements past x's end count as zeros."""
    _check_cols(cols)
    if not x.is_contiguous() or x.numel() > num_rows * cols:
        raise ValueError("x must be contiguous and fit num_rows x cols")
    rb = packed_row_bytes(cols)
    if out is not None and (out.shape != (num_rows, rb) or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous [{num_rows}, {rb}] uint8 buffer")
    buf = torch.empty((num_rows, rb), dtype=torch.uint8, device=x.device) if out is None else out
    q, s = _views(buf)
    _quantize_pack_kernel[(triton.cdiv(cols // GROUP, GROUPS_PER_PROGRAM), num_rows)](
        x, q, s, x.numel(), rb, cols, GROUP=GROUP, GPP=GROUPS_PER_PROGRAM,
        ALIGN=aligned(x.numel(), rb, cols), num_warps=TILE_WARPS,
    )  # fmt: skip
    return buf


def dequant_sum_requant(recv: torch.Tensor, cols: int) -> torch.Tensor:
    """uint8 [w, bytes] (one chunk from each rank) -> uint8 [1, bytes]: their sum."""
    _check_cols(cols)
    rb = packed_row_bytes(cols)
    if recv.shape[1] != rb or not recv.is_contiguous():
        raise ValueError(f"want a contiguous [w, {rb}] packed buffer, got {tuple(recv.shape)}")
    out = torch.empty((1, rb), dtype=torch.uint8, device=recv.device)
    (qi, si), (qo, so) = _views(recv), _views(out)
    _dequant_sum_requant_kernel[(cols // GROUP,)](
        qi, si, qo, so, recv.shape[0], rb, cols, GROUP=GROUP, num_warps=1
    )
    return out


def unpack_dequant(
    gathered: torch.Tensor, cols: int, n: int, dtype: torch.dtype
) -> torch.Tensor:  # [n]
    """uint8 [w, bytes] -> the first ``n`` values of the w dequantized chunks, in ``dtype``."""
    _check_cols(cols)
    rb = packed_row_bytes(cols)
    if gathered.shape[1] != rb or not gathered.is_contiguous():
        raise ValueError(f"want a contiguous [w, {rb}] packed buffer, got {tuple(gathered.shape)}")
    out = torch.empty(n, dtype=dtype, device=gathered.device)
    q, s = _views(gathered)
    _unpack_dequant_kernel[(cols // GROUP, gathered.shape[0])](
        q, s, out, n, rb, cols, GROUP=GROUP, num_warps=1
    )
    return out


def _check_stage(stage: torch.Tensor, nbytes: int) -> None:
    if not stage.is_contiguous() or stage.shape[1] < nbytes or stage.shape[1] % 4:
        raise ValueError(f"want a contiguous [w, >= {nbytes}] uint8 stage (4-byte rows)")


def dequant_sum(
    stage: torch.Tensor,  # uint8 [w, S]: row r holds rank r's packed chunks in its first bytes
    cols: int,
    num_rows: int,  # packed chunks a rank
    out: torch.Tensor,  # [n], contiguous: the sum's first n values, in out's dtype
) -> torch.Tensor:
    """The sum over ranks of every rank's dequantized chunks, in fp32 in rank order, rounded
    once into ``out`` (every rank that holds the same bytes gets the same values)."""
    _check_cols(cols)
    rb = packed_row_bytes(cols)
    _check_stage(stage, num_rows * rb)
    if not out.is_contiguous() or out.numel() > num_rows * cols:
        raise ValueError("out must be contiguous and fit num_rows x cols")
    q, s = _views(stage)
    _dequant_sum_kernel[(triton.cdiv(cols // GROUP, GROUPS_PER_PROGRAM), num_rows)](
        q, s, out, out.numel(), stage.shape[0], stage.shape[1], rb, cols,
        GROUP=GROUP, GPP=GROUPS_PER_PROGRAM,
        ALIGN=aligned(out.numel(), stage.shape[1], rb, cols), num_warps=TILE_WARPS,
    )  # fmt: skip
    return out
