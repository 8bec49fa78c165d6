"""All-reduces launched on a second CUDA stream, so that compute on the main stream overlaps them.

    comm = CommStream(torch.cuda.Stream())     # or CommStream(None): run them in place, in order
    handle = comm.launch(partial)             # comm stream waits for the main stream's work so far
    ...                                       # more compute on the main stream
    reduced = comm.wait(handle)               # main stream waits for that all-reduce

Every launch goes to the one comm stream, in the same order on every rank, so collectives never
interleave differently across ranks. Memory: the input stays referenced by the handle until the
main stream has waited for the reduction (so the allocator cannot hand its block to a kernel that
might run first), and each launch first waits for the main stream, so a block freed after a
``wait`` is never reused on the comm stream before the main stream is done with it. Works under
CUDA-graph capture (fork and join through events).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightwell.distributed.comm.base import beside_compute
from lightwell.distributed.parallel_state import tp_all_reduce


@dataclass
class PendingAllReduce:
    result: torch.Tensor  # the reduced tensor (valid after ``CommStream.wait``)
    event: torch.cuda.Event | None  # recorded on the comm stream after the reduction
    source: torch.Tensor | None  # the input, kept alive until the wait


class CommStream:
    def __init__(self, stream: torch.cuda.Stream | None) -> None:
        self.stream = stream

    def launch(self, x: torch.Tensor) -> PendingAllReduce:
        if self.stream is None:  # (in order: the CPU tests; the same picks as on a stream)
            with beside_compute():
                return PendingAllReduce(tp_all_reduce(x), None, None)
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream), beside_compute():
            result = tp_all_reduce(x)
            event = torch.cuda.Event()
            event.record(self.stream)
        return PendingAllReduce(result, event, x)

    def wait(self, pending: PendingAllReduce) -> torch.Tensor:
        if pending.event is not None:
            torch.cuda.current_stream().wait_event(pending.event)
            pending.source = None
        return pending.result
