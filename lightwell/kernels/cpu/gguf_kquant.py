"""GGUF K-quant blocks (Q4_K, Q5_K, Q6_K) times float32 activations on the CPU, in their file
layout: the K-quant counterpart of ``gguf_cpu`` (Q4_0, Q4_1, Q8_0), with the same functions.

``gguf_mm(x, w, qtype)`` is ``x @ dequantize(w).T`` without the float32 weights: each
super-block is unpacked and dequantized in registers (bit-exact with gguf-py's float32 values)
and accumulated in float32. ``gguf_dequant_rows(w, qtype, K, ids)`` dequantizes some rows (an
embedding lookup). ``gguf_kquant.c`` is compiled once per machine like ``gguf_cpu.c`` (same
cache folder and CPU key, ``cc -O3 -march=native -fopenmp``) and loaded with ctypes;
``available()`` says whether that worked.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import subprocess
import sys
import tempfile

import torch

from lightwell.kernels.cpu.gguf_cpu import _cache_dir, _cpu_key
from lightwell.kernels.gguf_blocks import Q4_K, Q5_K, Q6_K

logger = logging.getLogger(__name__)
SOURCE = os.path.join(os.path.dirname(__file__), "gguf_kquant.c")
SUPPORTED = frozenset((Q4_K, Q5_K, Q6_K))  # the types gguf_kquant.c reads


def _compile(target: str) -> None:
    os.makedirs(os.path.dirname(target), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(target))
    os.close(fd)
    cmd = ["cc", "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", SOURCE, "-o", tmp]
    try:
        subprocess.run(cmd, check=True, capture_output=True, timeout=120)
        os.replace(tmp, target)  # atomic: a concurrent process loads a whole library or none
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.lru_cache(maxsize=1)
def _lib() -> ctypes.CDLL | None:
    with open(SOURCE, "rb") as f:
        key = hashlib.sha256(f.read() + _cpu_key().encode() + sys.version.encode()).hexdigest()
    target = os.path.join(_cache_dir(), f"gguf_kquant_{key[:16]}.so")
    try:
        if not os.path.exists(target):
            _compile(target)
        lib = ctypes.CDLL(target)
    except (OSError, subprocess.SubprocessError) as e:
        logger.warning("the GGUF K-quant CPU kernels did not compile or load (%s)", e)
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.gguf_kq_mm.argtypes = [
        ptr, i64, i64, i64, ptr, i64, i64, ctypes.c_int, ptr, i64, ctypes.c_int
    ]  # fmt: skip
    lib.gguf_kq_dequant_rows.argtypes = [ptr, i64, i64, ctypes.c_int, ptr, i64, ptr, ctypes.c_int]
    return lib


def available() -> bool:
    """Whether the compiled kernels load on this machine (a C compiler with OpenMP)."""
    return _lib() is not None


def gguf_mm(
    x: torch.Tensor,  # [M, K] float32, rows contiguous
    w: torch.Tensor,  # [N, K / 256 * block bytes] uint8, contiguous
    qtype: int,
    out: torch.Tensor | None = None,  # [M, N] float32 (may be a column slice of a wider one)
) -> torch.Tensor:  # [M, N] float32
    M, K = x.shape
    N = w.shape[0]
    if x.dtype != torch.float32 or x.stride(1) != 1 or not w.is_contiguous():
        raise ValueError("gguf_mm takes float32 x with contiguous rows and contiguous blocks")
    if w.dtype != torch.uint8:
        raise ValueError(f"gguf_mm takes uint8 blocks, got {w.dtype}")
    if out is None:
        out = torch.empty(M, N, dtype=torch.float32)
    if out.dtype != torch.float32 or tuple(out.shape) != (M, N) or out.stride(1) != 1:
        raise ValueError(f"gguf_mm: out must be float32 [{M}, {N}] with contiguous rows")
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
    ids = ids.to(torch.int64).contiguous()
    if w.dtype != torch.uint8 or not w.is_contiguous():
        raise ValueError("gguf_dequant_rows takes contiguous uint8 blocks")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= w.shape[0]):
        raise IndexError(f"gguf_dequant_rows: row ids must be in [0, {w.shape[0]})")
    out = torch.empty(ids.numel(), K, dtype=torch.float32)
    rc = _lib().gguf_kq_dequant_rows(
        w.data_ptr(), K, w.shape[1], qtype, ids.data_ptr(), ids.numel(), out.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    if rc:
        raise ValueError(f"gguf_dequant_rows: type {qtype} with K={K}, {w.shape[1]} bytes a row")
    return out
