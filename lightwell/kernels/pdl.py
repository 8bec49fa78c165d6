"""Programmatic dependent launch (PDL, Hopper and later): on by default, ``LIGHTWELL_PDL=0``
turns it off.

A kernel launched with PDL may start while the kernel before it in the stream is still running,
once every program of that kernel has signalled (``gdc_launch_dependents``) or exited. It must
then wait (``gdc_wait``: the previous kernel has finished and its writes are visible) before it
reads anything an earlier kernel wrote and before it writes anything: only work on memory no
kernel of the step writes (a layer's weights) may come first. Our users:

- ``kernels/gemv.py`` (batch-1 decode matmuls): before waiting, loads its first K tile of
  weights into registers (and asks L2 for the next ``PREFETCH_TILES`` tiles, none by default:
  with the whole first wave of programs doing it at once the prefetches crowd out the loads
  that count), so the weight stream starts under the previous kernel's tail (a norm, the
  attention, the other MLP matmul);
- ``kernels/rmsnorm.py``: waits first thing, so only its launch overlaps;
- both signal at their start, and so does the decode attention kernel, so the next kernel's
  programs can start early; with ``LIGHTWELL_PDL_ALLREDUCE=1`` the low-latency all-reduce
  kernel too (``allreduce_signal``): at TP=2 the GEMVs after the all-reduces then start
  their weight streams while it waits for the peer.

Kernels that do not wait are never launched with PDL: they start only after the kernel before
them has finished, as without it. Measured on the H200 (benchmarks/results/tp_run12): llama-3-8b
W1 at TP=1 225.6 -> 234.1 tok/s, the same 32 tokens; read at import.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

ENABLED = os.environ.get("LIGHTWELL_PDL", "1") != "0"
# K tiles a GEMV program prefetches toward L2 before its wait, past the one it loads: with 1,
# a first wave of gate_up programs asks for ~34 MB (of the H200's 50 MB of L2). None by default:
# on the H200 (tp_run12, 32 layers of norm + GEMV) 0 tiles gained 5.7 us a layer over PDL off,
# 1 tile -1.6 and 3 tiles -10.5 (the prefetches compete with the loads that count)
PREFETCH_TILES = int(os.environ.get("LIGHTWELL_PDL_PREFETCH_TILES", "0"))
LINE_BYTES = 128  # an L2 prefetch brings one line
ALLREDUCE_SIGNAL = os.environ.get("LIGHTWELL_PDL_ALLREDUCE", "0") == "1"  # see allreduce_signal


@functools.cache
def _device_supports(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def device_supports(device: torch.device) -> bool:
    """An sm_90+ GPU (never the CPU, where Triton runs as its interpreter, which has no grid
    dependency ops)."""
    if device.type != "cuda" or torch.version.hip is not None:  # (the PTX is NVIDIA's)
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _device_supports(index)


def use_pdl(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch with PDL: ``LIGHTWELL_PDL`` not 0 and an sm_90+ GPU.
    The same for every token count, so each kernel keeps one compiled form (start-up compiles
    what serving launches); where the kernel next to one of ours is cuBLAS's (prefills, decode
    batches past the GEMV's rows), nothing overlaps, and nothing is lost (tp_run12: a batch-64
    decode step 5.58 ms with PDL, 5.59-5.69 without)."""
    return ENABLED and device_supports(device)


def allreduce_signal(device: torch.device) -> bool:
    """Whether the low-latency all-reduce kernel (kernels/hostmem_allreduce.py, the lane of
    ``hostmem`` and ``peermem``) signals at its start, so that the GEMV after it (its norm
    fused in) loads its first weight tile while the all-reduce waits for the peers:
    ``LIGHTWELL_PDL_ALLREDUCE=1`` (off by default: written 2026-12-01 without two GPUs,
    unmeasured) and ``use_pdl``."""
    return ALLREDUCE_SIGNAL and use_pdl(device)


def launch_options(gdc: bool) -> dict:
    """Extra keyword arguments of a Triton launch that waits (``gdc_wait``) when ``gdc``."""
    return {"launch_pdl": True} if gdc else {}


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 for the 128-byte line at each pointer (no registers, no wait; a hint)."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;",
        "=r,l",
        [ptrs],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )
