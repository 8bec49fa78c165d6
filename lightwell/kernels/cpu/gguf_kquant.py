"""GGUF K-quant blocks (Q4_K, Q5_K, Q6_K) times float32 activations on the CPU, in their file
layout: the K-quant counterpart of ``gguf_cpu`` (Q4_0, Q4_1, Q8_0), with the same functions.

``gguf_mm(x, w, qtype)`` is ``x @ dequantize(w).T`` without the float32 weights: each
super-block is unpacked and dequantized in registers (bit-exact with gguf-py's float32 values)
and accumulated in float32. ``gguf_dequant_rows(w, qtype, K, ids)`` dequantizes some rows (an
embedding lookup). ``gguf_kquant.c`` is part of ``gguf_cpu``'s compiled library (``cc -O3
-march=native -fopenmp``, once per machine); ``available()`` says whether it loaded.
"""

from __future__ import annotations

import torch

from lightwell.kernels.cpu.gguf_cpu import _lib, available, check_mm, check_rows
from lightwell.kernels.gguf_blocks import Q4_K, Q5_K, Q6_K

SUPPORTED = frozenset((Q4_K, Q5_K, Q6_K))  # the types gguf_kquant.c reads
__all__ = ["SUPPORTED", "available", "gguf_dequant_rows", "gguf_mm"]


def gguf_mm(
    x: torch.Tensor,  # [M, K] float32, rows contiguous
    w: torch.Tensor,  # [N, K / 256 * block bytes] uint8, contiguous
    qtype: int,
    out: torch.Tensor | None = None,  # [M, N] float32 (may be a column slice of a wider one)
) -> torch.Tensor:  # [M, N] float32
    M, K = x.shape
    N = w.shape[0]
    out = check_mm(x, w, out)
    rc = _lib().gguf_kq_mm(
        x.data_ptr(), M, K, x.stride(0), w.data_ptr(), N, w.shape[1], qtype,
        out.data_ptr(), out.stride(0), torch.get_num_threads(),
    )  # fmt: skip
    if rc:
        raise ValueError(f"gguf_mm: type {qtype} with K={K}, {w.shape[1]} bytes a row")
    return out


def gguf_dequant_rows(
    w: torch.Tensor,  # [N, K / 256 * block bytes] uint8, contiguous
    qtype: int,
    K: int,
    ids: torch.Tensor,  # [R] int64 row indices, each < N
) -> torch.Tensor:  # [R, K] float32
    ids = check_rows(w, ids)
    out = torch.empty(ids.numel(), K, dtype=torch.float32)
    rc = _lib().gguf_kq_dequant_rows(
        w.data_ptr(), K, w.shape[1], qtype, ids.data_ptr(), ids.numel(), out.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    if rc:
        raise ValueError(f"gguf_dequant_rows: type {qtype} with K={K}, {w.shape[1]} bytes a row")
    return out
