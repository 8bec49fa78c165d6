"""The per-tile counters of split-K kernels (kernels/int8_gemm.py, kernels/w4a16_skinny.py,
kernels/moe_gemv.py's down projection split by pair, and kernels/argmax.py's rows split into
pieces): the programs of an output tile count themselves in (``last_to_arrive``), the last
adds the partials and sets the count back to zero, so one zeroed int32 buffer per device
serves every call and every CUDA graph replay.

One buffer per device: two split-K launches must never run at once on one device (every GEMM
runs on the step's main stream; the dual-stream overlap's second stream carries only
all-reduces), or their counts would mix. A kernel launched with programmatic dependent launch
(kernels/pdl.py) touches the counters only after its wait, when the kernel before it has
finished. The buffer is allocated (zeroed) on first use, which
must come before any CUDA-graph capture (the runner's warm-up forwards do that): allocated
inside a capture it would live in the graph's pool and be zeroed by no replay of other graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

COUNTER_CAPACITY = 4096  # output tiles of one split-K launch, at most
_COUNTERS: dict[tuple[str, int], torch.Tensor] = {}


def split_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """The device's ``COUNTER_CAPACITY`` zeroed int32 counters (``tiles`` of them used)."""
    if tiles > COUNTER_CAPACITY:
        raise ValueError(f"a split-K launch of {tiles} output tiles (at most {COUNTER_CAPACITY})")
    index = device.index
    if device.type == "cuda" and index is None:
        index = torch.cuda.current_device()
    key = (device.type, -1 if index is None else index)
    counts = _COUNTERS.get(key)
    if counts is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "split_counters: first use inside CUDA-graph capture; a split-K kernel must run "
                "once (warm-up) before capture"
            )
        counts = torch.zeros(COUNTER_CAPACITY, dtype=torch.int32, device=device)
        _COUNTERS[key] = counts
    return counts


@triton.jit
def last_to_arrive(count_ptr, splits, spread, FENCE: tl.constexpr):
    """Whether this program is the last of the ``splits`` programs of its tile to count in at
    ``count_ptr``. Every thread's partial stores are issued before the barrier; the count's
    atomic (acquire-release at GPU scope) publishes them. In the last program every thread then
    fences (acquire-release at GPU scope, through ``spread``: any tensor over the program's
    threads; Triton happens to put a barrier between one thread's atomic and the others' loads
    but does not promise it), so its reads of the others' partials (``.cg``: past L1) see them.
    FENCE: compiled for a GPU (the interpreter has no inline assembly)."""
    tl.debug_barrier()
    last = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu") == splits - 1
    if FENCE:
        if last:
            tl.inline_asm_elementwise(
                "fence.acq_rel.gpu;\n\tmov.u32 $0, 0;", "=r,r", [spread], dtype=tl.int32,
                is_pure=False, pack=1,
            )  # fmt: skip
    return last
