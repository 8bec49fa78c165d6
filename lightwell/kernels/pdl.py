"""Programmatic dependent launch (PDL, Hopper and later), on unless ``--no-pdl``.

A kernel launched with PDL may start while the kernel before it in the stream is still running,
once every program of that kernel has signalled (``gdc_launch_dependents``) or exited. It must
then wait (``gdc_wait``: the previous kernel has finished and its writes are visible) before it
reads anything an earlier kernel wrote and before it writes anything: only work on memory no
kernel of the step writes (a layer's weights) may come first. Our users:

- ``kernels/gemv.py`` (batch-1 decode matmuls, with the residual add + norm before them
  too): loads its first K tile of weights into registers before waiting, so the weight stream
  starts under the previous kernel's tail (a norm, the attention, the other MLP matmul);
  ``kernels/w4a16.py``'s 4-bit GEMV likewise;
- ``kernels/rmsnorm.py`` and ``kernels/argmax.py`` (greedy tokens after the LM head's GEMV):
  wait first thing, so only their launch overlaps;
- both signal at their start, and so do the decode attention kernel and the MoE router
  kernel (below), so the next kernel's programs can start early;
- MLA decode (``kernels/mla_prepare.py``, ``mla_decode.py``, ``mla_output.py``): the prepare
  and output kernels load their first ``kv_b_proj`` weight chunk before waiting (the output
  for one token, its whole ``W_UV`` slice), the attention and split-combine kernels wait
  first; each signals after its wait;
- MoE decode (``kernels/moe_router.py``, ``kernels/moe_gemv.py``): the router signals, then
  waits, so the gate/up GEMV's shared-expert programs load their first weight tile under it
  (their expert needs no router); the gate/up GEMV waits, then signals; the down GEMV over a
  token's pairs loads its first weight tile before waiting. The expert ids that tile needs are
  the router's output, two kernels back: the gate/up kernel signals only after its own wait,
  so when the down kernel starts the router has finished (ids are read through L2, ``.cg``).
  This is the one read of a step's output before a wait; it relies on that order of the
  three launches.

The MLA and MoE kernels wait and signal through ``kernels/pdl_sync.py``'s
``wait_then_signal`` (the router: ``signal_then_wait``) and take their launch arguments from
``kernel_args`` (the gate/up GEMV, like the GEMVs, from ``launch_options``).

Kernels that do not wait are never launched with PDL: they start only after the kernel before
them has finished, as without it. The worker calls ``set_enabled`` once at start-up from the
engine config (``DeviceConfig.pdl``); the setting is per process.
"""

from __future__ import annotations

import functools

import torch

_enabled = True


def set_enabled(enabled: bool) -> None:
    """Turn PDL on or off for the kernels this process launches from now on (start-up only)."""
    global _enabled
    _enabled = bool(enabled)


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
    """Whether kernels on ``device`` launch with PDL: enabled and an sm_90+ GPU. The same for
    every token count, so each kernel keeps one compiled form (start-up compiles what serving
    launches); where the kernel next to one of ours is cuBLAS's (prefills, decode batches past
    the GEMV's rows), nothing overlaps."""
    return _enabled and device_supports(device)


def launch_options(gdc: bool) -> dict:
    """Extra keyword arguments of a Triton launch that waits (``gdc_wait``) when ``gdc``."""
    return {"launch_pdl": True} if gdc else {}


def kernel_args(device: torch.device) -> dict:
    """A launch's ``GDC`` constexpr and its PDL option on ``device`` (``use_pdl``), for the
    kernels that wait through ``kernels/pdl_sync.py``."""
    gdc = use_pdl(device)
    return {"GDC": gdc, **launch_options(gdc)}
