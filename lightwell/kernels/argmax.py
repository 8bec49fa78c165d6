"""Greedy sampling's argmax over a few long rows (logits over the vocabulary): ``argmax_rows``.

torch's argmax reduces a row in one thread block: for the one to few rows of a decode step over
a vocabulary of 100k+ words, one SM streams each row while the others idle. Here a row is cut
into ``PIECE``-wide pieces, one program each; a program writes its piece's largest value and
first index as a partial, and the last of the row's programs to finish
(kernels/split_counters.py) reduces the partials in piece order. The answer is torch.argmax's:
the first index of the largest value, a NaN counting above every number (the first NaN wins),
-0.0 equal to 0.0.

Values are compared as int32 order keys (``_order_key``: the float's bits with a negative's
magnitude bits flipped, every NaN the largest key, above +inf's), so ties and NaNs need no
float special cases. 16- and 32-bit floats only (fp32 holds them exactly); other dtypes go to
torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lightwell.kernels import pdl as _pdl
from lightwell.kernels.pdl_sync import wait_then_signal
from lightwell.kernels.split_counters import COUNTER_CAPACITY, last_to_arrive, split_counters

PIECE = 4096  # values a program reads

_BIG = 2**31 - 1  # an index past every row; also the NaN key
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _order_key(x):
    """int32 keys ordered as the fp32 values ``x``, every NaN above +inf, -0.0 as 0.0."""
    bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return tl.where(x != x, 0x7FFFFFFF, key)


@triton.jit
def _first_max(key, idx):
    """(largest key, the smallest index holding it) of 1-D ``key`` / ``idx``."""
    best = tl.max(key, axis=0)
    return best, tl.min(tl.where(key == best, idx, 0x7FFFFFFF), axis=0)


@triton.jit
def _argmax_kernel(
    x_ptr,  # [R, V]
    key_ptr,  # [R, pieces] int32 partials
    idx_ptr,  # [R, pieces] int32 partials
    cnt_ptr,  # [R] zeroed int32 counters (kernels/split_counters.py)
    out_ptr,  # [R] int64
    stride, n_cols, pieces,
    PIECE: tl.constexpr,
    PIECES: tl.constexpr,  # next_power_of_2(pieces)
    FENCE: tl.constexpr,  # compiled for a GPU: split_counters.last_to_arrive's fence
    GDC: tl.constexpr,  # launched with PDL (kernels/pdl.py): waits first (launch overlapped)
):  # fmt: skip
    wait_then_signal(GDC)
    row = tl.program_id(0)
    piece = tl.program_id(1)
    cols = piece * PIECE + tl.arange(0, PIECE)
    ok = cols < n_cols
    x = tl.load(x_ptr + row.to(tl.int64) * stride + cols, mask=ok, other=0.0)
    key = tl.where(ok, _order_key(x.to(tl.float32)), -2147483648)
    best, first = _first_max(key, tl.where(ok, cols, 0x7FFFFFFF))
    part = row * pieces + piece
    tl.store(key_ptr + part, best)
    tl.store(idx_ptr + part, first)
    if last_to_arrive(cnt_ptr + row, pieces, cols, FENCE):
        p = tl.arange(0, PIECES)
        have = p < pieces
        keys = tl.load(key_ptr + row * pieces + p, mask=have, other=-2147483648,
                       cache_modifier=".cg")  # fmt: skip
        idxs = tl.load(idx_ptr + row * pieces + p, mask=have, other=0x7FFFFFFF,
                       cache_modifier=".cg")  # fmt: skip
        best, first = _first_max(keys, idxs)
        tl.atomic_xchg(cnt_ptr + row, 0)
        tl.store(out_ptr + row, first.to(tl.int64))


def argmax_rows(x: torch.Tensor) -> torch.Tensor:  # x [R, V] float -> [R] int64
    """``x.argmax(dim=-1)`` (see the module docstring), in one launch. Rows past the split
    counters' capacity, ``V`` past int32, or a dtype other than fp32/fp16/bf16 go to torch."""
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"argmax_rows: want float x [R, V]; got {x.dtype} {tuple(x.shape)}")
    rows, cols = x.shape
    too_big = rows > COUNTER_CAPACITY or cols >= _BIG
    if rows == 0 or cols == 0 or too_big or x.dtype not in _KERNEL_DTYPES:
        return x.argmax(dim=-1)
    if x.stride(1) != 1:
        x = x.contiguous()
    pieces = triton.cdiv(cols, PIECE)
    keys = torch.empty(rows, pieces, dtype=torch.int32, device=x.device)
    idxs = torch.empty(rows, pieces, dtype=torch.int32, device=x.device)
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    _argmax_kernel[(rows, pieces)](
        x, keys, idxs, split_counters(x.device, rows), out, x.stride(0), cols, pieces,
        PIECE=PIECE, PIECES=triton.next_power_of_2(pieces), FENCE=x.is_cuda, num_warps=4,
        **_pdl.kernel_args(x.device),
    )  # fmt: skip
    return out


def argmax_rows_ref(x: torch.Tensor) -> torch.Tensor:  # [R, V] -> [R] int64
    return x.argmax(dim=-1)
