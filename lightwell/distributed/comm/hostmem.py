"""All-reduce through pinned host memory, summed on the GPUs: for boxes without peer access.

A PCIe machine without P2P still lets every GPU read and write pinned host memory. Every rank
maps one shared segment (/dev/shm, registered with CUDA as portable + mapped) into its GPU's
address space; one Triton kernel per call (lightwell/kernels/hostmem_allreduce.py) writes the
rank's input into its slot over PCIe, raises a per-block flag, waits for the peers' flags and
sums their slots into the output. No CPU work, no host synchronisation, no copy engines: one
launch, capturable in CUDA graphs. Each GPU moves its message once up and (n - 1) times down
the PCIe link; NCCL's ring through host memory moves 2 (n - 1) / n of it each way, but in
several pipelined steps with their own latency.

Two payloads: ``hostmem`` sends x's dtype (exact: the fp32 sum in rank order, rounded once);
``hostmem-int8`` sends int8 values with one fp32 scale per 128 (about 0.52x the bytes of bf16;
each element off by at most the sum over ranks of its group's absmax / 254, one rounding).

On CPU the same kernel runs under the Triton interpreter (``TRITON_INTERPRET=1``, the tests)
with the segment in shared memory; without the interpreter the strategy is unavailable on CPU.

Segment layout: int32 flags [world, max_blocks] (padded to 4 KB), then the data slots
[2 parities, world, slot_bytes].
"""

from __future__ import annotations

import ctypes
import weakref
from typing import Any

import torch

from lightwell import envs
from lightwell.distributed.comm.base import CommContext, is_exact_sum, message_bytes
from lightwell.distributed.comm.shm import map_shared, pin

DEFAULT_MAX_BYTES = 16 * 1024 * 1024
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_HOST_REGISTER_PORTABLE_MAPPED = 3
# polls of a peer (~1 us each over PCIe; an ll poll re-reads a whole block) before the kernel
# gives up and traps: minutes, so only a peer that stopped trips it
_GPU_MAX_SPIN = 1 << 28
_CPU_MAX_SPIN = 1 << 22
DEFAULT_MAX_PROGRAMS = 1 << 30  # one program per block
# ``hostmem`` messages up to this use the ll protocol (the epoch in every word: lower latency,
# twice the bytes): 8 tokens x 4096 bf16, where the latency counts more than the bytes.
# hostmem-int8 has no ll lane: its ll form is slower at every size but 8 tokens.
LL_MAX_BYTES = 64 * 1024
# Fusing the residual add + RMSNorm into the kernel (all_reduce_add_rmsnorm) pays for small
# messages (decode) and costs for large ones (its epilogue's registers halve the programs
# resident on an SM), so prefills keep the all-reduce and the norm kernels apart.
FUSE_NORM_MAX_BYTES = 1 << 20


# hostmem-int8 messages above this (prefill sizes) go to an instance with blocks of 2,048
# elements (four warps a program: faster from 1 MiB up, slower at decode sizes).
INT8_LARGE_MIN_BYTES = 1 << 20
INT8_LARGE_BLOCK = 2048


def ll_max_bytes(max_bytes: int) -> int:
    """The largest message of the low-latency lane: ``LL_MAX_BYTES``, at most ``max_bytes``."""
    return min(LL_MAX_BYTES, max_bytes)


def lanes(choice: str, max_bytes: int) -> list[tuple[str, dict]]:
    """The selector's entries for ``hostmem``/``hostmem-int8``, each an instance with its own
    segment, the first that takes a message wins: ``hostmem``: an ``ll`` instance for the
    smallest messages, then the ``flag`` one; ``hostmem-int8``: blocks of 4,096 elements up to
    ``INT8_LARGE_MIN_BYTES``, then blocks of ``INT8_LARGE_BLOCK``."""
    if choice == "hostmem-int8":
        if max_bytes <= INT8_LARGE_MIN_BYTES:
            return [(choice, {"max_bytes": max_bytes})]
        large = {"max_bytes": max_bytes, "block": INT8_LARGE_BLOCK}
        return [(choice, {"max_bytes": INT8_LARGE_MIN_BYTES}), (choice, large)]
    small = ll_max_bytes(max_bytes)
    ll = [(choice, {"max_bytes": small, "protocol": "ll"})] if small > 0 else []
    return [*ll, (choice, {"max_bytes": max_bytes})]


class HostMemAllReduce:
    name = "hostmem"
    graph_safe = True

    def __init__(
        self,
        ctx: CommContext,
        max_bytes: int = DEFAULT_MAX_BYTES,
        int8: bool = False,
        max_programs: int = DEFAULT_MAX_PROGRAMS,
        block: int | None = None,
        protocol: str = "flag",
        fuse_norm: str = "auto",
    ) -> None:
        """``max_programs``: how many kernel programs share a message's blocks (every rank
        must pass the same); ``block``: elements
        per program and flag (a multiple of 128; default the kernel's ``BLOCK``); ``protocol``:
        ``flag`` (a release flag per block after the payload) or ``ll`` (the epoch in every
        8-byte word: lower latency, twice the bytes; the selector's small-message lane);
        ``fuse_norm``: when ``all_reduce_add_rmsnorm`` fuses (``auto``: the measured rule,
        ``1``: always, ``0``: never)."""
        if protocol not in ("flag", "ll"):
            raise ValueError(f"hostmem protocol must be flag or ll, got {protocol!r}")
        self.protocol = protocol
        from lightwell.kernels import hostmem_allreduce as kernel

        self.int8 = int8
        self.name = "hostmem-int8" if int8 else "hostmem"
        self.max_bytes = max_bytes
        block = block or kernel.BLOCK
        if block % 128 or block & (block - 1):
            raise ValueError(f"hostmem block must be a power of two >= 128, got {block}")
        # the most blocks a message can have (2-byte dtypes), and slot room for any dtype
        max_blocks = -(-max_bytes // (2 * block)) + 1
        slot_bytes = (-(-max_bytes // (4 * block)) + 1) * 4 * block
        if protocol == "ll":  # a payload word is half of an 8-byte word
            slot_bytes *= 2
        flag_bytes = -(-(4 * ctx.size * max_blocks) // 4096) * 4096
        total = flag_bytes + 2 * ctx.size * slot_bytes
        self.on_gpu = ctx.device.type == "cuda"
        segment, dst = self._segments(ctx, total)
        if dst is not None and protocol != "ll":  # (the flag kernel reads and writes one place)
            raise ValueError("a separate write segment needs the ll protocol")
        self.bufs = kernel.HostMemBuffers(
            data=segment[flag_bytes:],
            dst=None if dst is None else dst[flag_bytes:],
            flags=segment[:flag_bytes].view(torch.int32)[: ctx.size * max_blocks],
            epochs=torch.zeros(max_blocks, dtype=torch.int32, device=ctx.device),
            status=torch.zeros(1, dtype=torch.int32, device=ctx.device),
            rank=ctx.rank,
            world=ctx.size,
            max_spin=_GPU_MAX_SPIN if self.on_gpu else _CPU_MAX_SPIN,
            use_asm=self.on_gpu,
            max_programs=max(1, max_programs),
            block=block,
        )
        self._run = kernel.hostmem_ll_all_reduce if protocol == "ll" else kernel.hostmem_all_reduce
        self._kernel = kernel
        fuse = fuse_norm
        if fuse not in ("auto", "0", "1"):
            raise ValueError(f"hostmem fuse_norm must be auto, 0 or 1, got {fuse!r}")
        # the largest message whose norm is fused
        self.fuse_norm_max_bytes = {
            "auto": FUSE_NORM_MAX_BYTES,
            "0": -1,
            "1": max_bytes,
        }[fuse]

    def _segments(self, ctx: CommContext, nbytes: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the segment the kernel reads, and the one it writes when that differs: None): one
        pinned host segment that every rank maps, GPU-addressed on a GPU."""
        self.memory, self.registered = map_pinned(self, ctx, nbytes)
        if self.on_gpu:
            return _device_view(self.memory, ctx.device), None  # the same bytes, GPU-addressed
        return self.memory, None

    @staticmethod
    def available(ctx: CommContext) -> bool:
        if not 2 <= ctx.size <= 8:
            return False
        if ctx.device.type == "cuda":
            return torch.cuda.is_available()
        return envs.triton_interpret()

    def supports(self, x: torch.Tensor) -> bool:
        return (
            x.dtype in _DTYPES
            and x.device.type == self.bufs.epochs.device.type
            and message_bytes(x) <= self.max_bytes
        )

    def _int8_now(self) -> bool:
        """The int8 payload for this call (not under ``exact_sum``: the buffers hold any
        message in full precision, so an exact call needs no other)."""
        return self.int8 and not is_exact_sum()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self._run(x, self.bufs, self._int8_now())

    def all_reduce_add_rmsnorm(
        self,
        x: torch.Tensor,  # [T, H] this rank's partial sum
        residual: torch.Tensor,  # [T, H]
        weight: torch.Tensor,  # [H]
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(rmsnorm(sum + residual) * weight, sum + residual)`` in the all-reduce's own kernel
        (one launch and one pass fewer), or None where it cannot fuse (H not dividing the
        block, dtypes or layouts that differ): the caller then reduces and norms apart."""
        if message_bytes(x) > self.fuse_norm_max_bytes:
            return None
        norm = self._kernel.AddRMSNorm(residual, weight, eps)
        if not self._kernel.can_fuse_norm(x, norm, self.bufs.block):
            return None
        return self._run(x, self.bufs, self._int8_now(), norm)

    def timed_out(self) -> bool:
        """Whether any wait gave up on a peer (synchronises with the device)."""
        return bool(self.bufs.status.item())

    def close(self) -> None:
        if self.on_gpu and self.registered:
            torch.cuda.synchronize(self.bufs.epochs.device)  # no kernel may still use it
        self.bufs = self.memory = None
        self._release()


def map_pinned(owner: Any, ctx: CommContext, nbytes: int) -> tuple[torch.Tensor, bool]:
    """(memory, registered): ``map_shared``'s segment, on a GPU registered with CUDA as
    portable + mapped (page-locked, GPU-addressable), and ``owner._release`` set to unregister
    it before the mapping goes (called at close, or run when ``owner`` is dropped unclosed).
    Raises if registration fails on a GPU."""
    memory = map_shared(ctx, nbytes)  # CPU view, uint8 [nbytes]
    registered = ctx.device.type == "cuda" and pin(memory, _HOST_REGISTER_PORTABLE_MAPPED)
    owner._release = weakref.finalize(owner, _unregister, memory, registered)
    if ctx.device.type == "cuda" and not registered:
        raise RuntimeError("cudaHostRegister of a host all-reduce segment failed")
    return memory, registered


def _unregister(memory: torch.Tensor, registered: bool) -> None:
    """Before the mapping goes: an address range left registered would make the next mapping
    that reuses it fail to register."""
    if registered:
        torch.cuda.cudart().cudaHostUnregister(memory.data_ptr())


def _device_view(memory: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CUDA tensor over registered + mapped host memory (uint8, same length)."""
    ptr = _device_pointer(memory.data_ptr())

    class _Interface:
        __cuda_array_interface__ = {
            "shape": (memory.numel(),),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 2,
        }

    with torch.cuda.device(device):
        return torch.as_tensor(_Interface(), device=device)


def _device_pointer(host_ptr: int) -> int:
    """The device address of registered host memory (the driver's cuMemHostGetDevicePointer;
    equal to the host address on UVA systems)."""
    libcuda = ctypes.CDLL("libcuda.so.1")
    out = ctypes.c_uint64()
    err = libcuda.cuMemHostGetDevicePointer_v2(ctypes.byref(out), ctypes.c_void_p(host_ptr), 0)
    if err != 0:
        raise RuntimeError(f"cuMemHostGetDevicePointer failed with CUDA driver error {err}")
    return int(out.value)


class HostMemInt8AllReduce(HostMemAllReduce):
    """``hostmem`` with the int8 payload."""

    def __init__(self, ctx: CommContext, **options: Any) -> None:
        super().__init__(ctx, int8=True, **options)  # HostMemAllReduce's options
