"""The in-kernel side of programmatic dependent launch (kernels/pdl.py) for kernels whose
waiting and signalling is all at their start: wait then signal, or signal then wait. Triton
helpers, so this module needs Triton (pdl.py does not).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def wait_then_signal(GDC: tl.constexpr):
    """With ``GDC`` (launched with PDL): wait until the kernel before has finished and its
    writes are visible, then let the next kernel's programs start. Signalling only after the
    wait means that once the next kernel runs, every kernel before this one has finished: the
    MoE down GEMV relies on it to read the router's ids before its own wait."""
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def signal_then_wait(GDC: tl.constexpr):
    """With ``GDC``: let the next kernel's programs start, then wait until the kernel before has
    finished and its writes are visible. For a kernel whose next kernel reads nothing before
    its own wait but a layer's weights: the next kernel's early reads then overlap this one.
    That next kernel may then run while kernels two or more launches back have not finished,
    so it must signal only after its own wait if a kernel after it reads a step's output
    before waiting (the MoE down kernel's read of the router's ids)."""
    if GDC:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
