"""GGUF blocks times float32 activations on the CPU, in their file layout: Q4_0, Q4_1, Q5_0,
Q5_1, Q8_0 (``gguf_cpu.c``, blocks of 32) and the K-quants Q4_K, Q5_K, Q6_K (``gguf_kquant.c``,
super-blocks of 256), one entry point for all eight types.

``gguf_mm(x, w, qtype)`` is ``x @ dequantize(w).T`` without the float32 weights: each block is
dequantized in registers (bit-exact with gguf-py's float32 values) and accumulated in float32;
with ``int8_act`` (blocks of 32 only) x is first rounded to int8 by blocks of 32 and each block
is an integer dot product. ``gguf_dequant_rows(w, qtype, K, ids)`` dequantizes some rows (an
embedding lookup). The C sources beside this file (``gguf_cpu.c``, ``gguf_kquant.c`` and
``llama_decode.c``, which ``llama_decode.py`` calls) are compiled into one library once per
machine with the system C compiler (``cc``, ``-O3 -march=native -fopenmp``) into a cache folder
and loaded with ctypes; ``available()`` says whether that worked (the callers fall back to torch
ops otherwise). ``gguf_mm_ref`` is the torch reference, on ``kernels/gguf_blocks.py``'s block
layouts and dequantize reference.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import sys
import tempfile

import torch

from lightwell.kernels.gguf_blocks import (
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_0,
    Q5_1,
    Q5_K,
    Q6_K,
    Q8_0,
    gguf_dequantize_ref,
)

logger = logging.getLogger(__name__)
_HERE = os.path.dirname(__file__)
SOURCES = [os.path.join(_HERE, f) for f in ("gguf_cpu.c", "gguf_kquant.c", "llama_decode.c")]
HEADERS = [os.path.join(_HERE, "gguf_blocks.h")]
BLOCK32 = frozenset((Q4_0, Q4_1, Q5_0, Q5_1, Q8_0))  # gguf_cpu.c's types (int8_act applies)
KQUANT = frozenset((Q4_K, Q5_K, Q6_K))  # gguf_kquant.c's
SUPPORTED = BLOCK32 | KQUANT


def _cpu_key() -> str:
    """The compiled library fits this CPU: -march=native depends on its flags."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return platform.machine() + flags


NATIVE = ("-march=native",)  # what the library is compiled for: this CPU


def _compile(target: str, arch: tuple[str, ...] = NATIVE) -> None:
    os.makedirs(os.path.dirname(target), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(target))
    os.close(fd)
    cmd = ["cc", "-O3", *arch, "-fopenmp", "-shared", "-fPIC", *SOURCES, "-o", tmp]
    try:
        subprocess.run(cmd, check=True, capture_output=True, timeout=120)
        os.replace(tmp, target)  # atomic: a concurrent process loads a whole library or none
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.lru_cache(maxsize=1)
def _lib() -> ctypes.CDLL | None:
    digest = hashlib.sha256(_cpu_key().encode() + sys.version.encode())
    for path in SOURCES + HEADERS:
        with open(path, "rb") as f:
            digest.update(f.read())
    key = digest.hexdigest()
    from lightwell.envs import cache_dir

    target = os.path.join(cache_dir("kernels"), f"gguf_cpu_{key[:16]}.so")
    try:
        if not os.path.exists(target):
            _compile(target)
        return _load(target)
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        tail = detail.decode(errors="replace").strip().splitlines()[-1:] if detail else []
        logger.warning(
            "the GGUF CPU kernels did not compile or load (%s%s): GGUF files are dequantized "
            "at load instead",
            e,
            f"; {tail[0]}" if tail else "",
        )
        return None


def compile_for(arch: tuple[str, ...], target: str) -> ctypes.CDLL:
    """The kernels compiled with ``arch`` flags instead of this CPU's (e.g. ``()``: the portable
    C, ``("-mavx2", "-mfma", "-mf16c")``: AVX2 without AVX-512) into ``target``, loaded: the
    tests run each code path of the sources on one machine through it."""
    _compile(target, arch)
    return _load(target)


def _load(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    c_int = ctypes.c_int
    lib.gguf_mm.argtypes = [ptr, i64, i64, i64, ptr, i64, i64, c_int, ptr, i64, c_int, c_int]
    lib.gguf_dequant_rows.argtypes = [ptr, i64, i64, ctypes.c_int, ptr, i64, ptr, ctypes.c_int]
    lib.lw_llama_decode.argtypes = [ptr, ptr, ptr, ptr, ctypes.c_int]  # llama_decode.py
    lib.gguf_kq_mm.argtypes = [ptr, i64, i64, i64, ptr, i64, i64, c_int, ptr, i64, c_int]
    lib.gguf_kq_dequant_rows.argtypes = [ptr, i64, i64, c_int, ptr, i64, ptr, c_int]  # kquant
    return lib


def available() -> bool:
    """Whether the compiled kernels load on this machine (a C compiler with OpenMP)."""
    return _lib() is not None


def _check_mm(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """The arguments of a block matmul, and its output."""
    M, N = x.shape[0], w.shape[0]
    if x.dtype != torch.float32 or x.stride(1) != 1 or not w.is_contiguous():
        raise ValueError("gguf_mm takes float32 x with contiguous rows and contiguous blocks")
    if w.dtype != torch.uint8:
        raise ValueError(f"gguf_mm takes uint8 blocks, got {w.dtype}")
    if out is None:
        out = torch.empty(M, N, dtype=torch.float32)
    if out.dtype != torch.float32 or tuple(out.shape) != (M, N) or out.stride(1) != 1:
        raise ValueError(f"gguf_mm: out must be float32 [{M}, {N}] with contiguous rows")
    return out


def value_range(t: torch.Tensor) -> tuple[int, int]:
    """(min, max) of a non-empty integer tensor; a decode step's few values through a list,
    cheaper than two reductions."""
    if t.numel() <= 64:
        values = t.flatten().tolist()
        return min(values), max(values)
    return int(t.min()), int(t.max())


def _check_rows(w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:  # [R] int64, contiguous
    """The arguments of a row dequantization."""
    ids = ids.to(torch.int64).contiguous()
    if w.dtype != torch.uint8 or not w.is_contiguous():
        raise ValueError("gguf_dequant_rows takes contiguous uint8 blocks")
    lo, hi = value_range(ids) if ids.numel() else (0, -1)
    if lo < 0 or hi >= w.shape[0]:
        raise IndexError(f"gguf_dequant_rows: row ids must be in [0, {w.shape[0]})")
    return ids


def gguf_mm(
    x: torch.Tensor,  # [M, K] float32, rows contiguous
    w: torch.Tensor,  # [N, K / block values * block bytes] uint8, contiguous
    qtype: int,
    out: torch.Tensor | None = None,  # [M, N] float32 (may be a column slice of a wider one)
    int8_act: bool = False,  # x rounded to int8 by blocks of 32 first (``quantize_q8_ref``)
) -> torch.Tensor:  # [M, N] float32
    """x @ W.T for any type of ``SUPPORTED``; ``int8_act`` applies to ``BLOCK32`` types (the
    K-quants take float32 x)."""
    M, K = x.shape
    N = w.shape[0]
    out = _check_mm(x, w, out)
    if qtype not in SUPPORTED:
        raise ValueError(f"gguf_mm: type {qtype} is not one of {sorted(SUPPORTED)}")
    lib, threads = _lib(), torch.get_num_threads()
    args = (x.data_ptr(), M, K, x.stride(0), w.data_ptr(), N, w.shape[1], qtype)
    args += (out.data_ptr(), out.stride(0), threads)
    rc = lib.gguf_kq_mm(*args) if qtype in KQUANT else lib.gguf_mm(*args, int(int8_act))
    if rc == -2:
        raise MemoryError("gguf_mm: no memory for the int8 activations")
    if rc:
        raise ValueError(f"gguf_mm: type {qtype} with K={K}, {w.shape[1]} bytes a row")
    return out


def gguf_dequant_rows(
    w: torch.Tensor,  # [N, K / block values * block bytes] uint8, contiguous
    qtype: int,
    K: int,
    ids: torch.Tensor,  # [R] int64 row indices, each < N
) -> torch.Tensor:  # [R, K] float32
    ids = _check_rows(w, ids)
    if qtype not in SUPPORTED:
        raise ValueError(f"gguf_dequant_rows: type {qtype} is not one of {sorted(SUPPORTED)}")
    out = torch.empty(ids.numel(), K, dtype=torch.float32)
    fn = _lib().gguf_kq_dequant_rows if qtype in KQUANT else _lib().gguf_dequant_rows
    rc = fn(
        w.data_ptr(), K, w.shape[1], qtype, ids.data_ptr(), ids.numel(), out.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    if rc:
        raise ValueError(f"gguf_dequant_rows: type {qtype} with K={K}, {w.shape[1]} bytes a row")
    return out


def quantize_q8_ref(x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, K] float32
    """x as the int8 activations represent it: per block of 32, q = round(x / d) with
    d = max|x| / 127 (ties to even), returned as q * d."""
    blocks = x.float().reshape(x.shape[0], -1, 32)  # [M, K / 32, 32]
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(blocks * inv).clamp(-127, 127)
    return (q * (amax / 127.0)).reshape(x.shape)


def gguf_mm_ref(
    x: torch.Tensor, w: torch.Tensor, qtype: int, int8_act: bool = False
) -> torch.Tensor:  # [M, N]
    return (quantize_q8_ref(x) if int8_act else x) @ gguf_dequantize_ref(w, qtype).T
