"""Peer-memory all-reduce for small messages: torch symmetric memory, one-shot and two-shot.

Every rank copies its input into a buffer that all peers can read (CUDA IPC / fabric handles,
set up once by ``rendezvous``), then:
- one-shot: each rank reads every peer's whole buffer and sums (one step, (n-1)x the bytes);
  best for the smallest (decode) messages, where latency is everything;
- two-shot: reduce-scatter then all-gather through the same buffers (2 steps, 2(n-1)/n x the
  bytes); better once the message is a few hundred KB.
Both are single kernels with device-side signalling, so they are captured in CUDA graphs. The
buffer is allocated once, before any capture; larger messages are not supported (the selector
sends them to NCCL). NVLink multicast (``multimem``) is never used: the process environment has
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and only the unicast ops are called.
"""

from __future__ import annotations

import importlib

import torch

from lightwell.distributed.comm.base import CommContext, message_bytes

# At or below this many bytes one-shot, above it two-shot (tune with the all-reduce benchmark).
ONE_SHOT_MAX_BYTES = 256 * 1024
DEFAULT_BUFFER_BYTES = 8 * 1024 * 1024
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_ALIGN = 16  # bytes: the symmetric-memory kernels load 16-byte vectors


def _ops() -> object | None:
    ops = getattr(torch.ops, "symm_mem", None)
    try:
        ops.one_shot_all_reduce_out  # noqa: B018  (raises when this build lacks the op)
        ops.two_shot_all_reduce_  # noqa: B018
    except (AttributeError, RuntimeError):
        return None
    return ops


class SymmMemAllReduce:
    name = "oneshot"
    graph_safe = True

    def __init__(self, ctx: CommContext, max_bytes: int = DEFAULT_BUFFER_BYTES) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.ops = _ops()
        self.group_name = ctx.group.group_name
        self.max_bytes = -(-max_bytes // _ALIGN) * _ALIGN
        self.one_shot_max_bytes = ONE_SHOT_MAX_BYTES
        self.buffer = symm_mem.empty(self.max_bytes, dtype=torch.uint8, device=ctx.device)
        symm_mem.rendezvous(self.buffer, self.group_name)  # collective: maps the peers' buffers

    @staticmethod
    def available(ctx: CommContext) -> bool:
        if ctx.device.type != "cuda" or not torch.cuda.is_available():
            return False
        try:
            importlib.import_module("torch.distributed._symmetric_memory")
        except ImportError:
            return False
        return _ops() is not None

    def supports(self, x: torch.Tensor) -> bool:
        n = message_bytes(x)
        return x.is_cuda and x.dtype in _DTYPES and n <= self.max_bytes and n % _ALIGN == 0

    def _staging(self, x: torch.Tensor) -> torch.Tensor:  # like x, in the symmetric buffer
        return self.buffer[: message_bytes(x)].view(x.dtype).view(x.shape)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if message_bytes(x) <= self.one_shot_max_bytes:
            return self.one_shot(x)
        return self.two_shot(x)

    def one_shot(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        buf = self._staging(x)
        buf.copy_(x)
        out = torch.empty_like(x)
        self.ops.one_shot_all_reduce_out(buf, "sum", self.group_name, out)
        return out

    def two_shot(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        buf = self._staging(x)
        buf.copy_(x)
        self.ops.two_shot_all_reduce_(buf, "sum", self.group_name)
        return x.copy_(buf)

    def close(self) -> None:
        self.buffer = None
