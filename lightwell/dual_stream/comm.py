"""All-reduces launched on a second CUDA stream, so that compute on the main stream overlaps them.

    comm = CommStream(torch.cuda.Stream())     # or CommStream(None): run them in place, in order
    handle = comm.launch(partial)             # comm stream waits for the main stream's work so far
    ...                                       # more compute on the main stream
    reduced = comm.wait(handle)               # main stream waits for that all-reduce
    comm.end()                                # at the forward's end (comm.abandon() if it failed)

Every launch goes to the one comm stream, in the same order on every rank, so collectives never
interleave differently across ranks. A strategy with phases (``tp_all_reduce_start``:
``hostmem-copy``) begins on the main stream at ``launch`` (its int8 quantize), moves the bytes
on the comm stream (its slot handshake first, before that stream waits for the main one: it
touches only host flags, so its round trips overlap the quantize and the compute before it),
and sums on the main stream at ``wait``: kernels on the comm stream would wait for the SMs,
which the other micro-batch's GEMMs hold until they end. Such a call's last
stream work (its flags) is joined into the main stream at the next ``wait`` or at ``end``,
which the forward calls at its end (a CUDA-graph capture must end with every fork joined).

Memory: the input stays referenced by the handle until the main stream has waited for the
reduction (so the allocator cannot hand its block to a kernel that might run first), and each
launch waits for the main stream before any comm-stream work that touches device memory (a
claim before it touches host flags only), so a block freed after a ``wait`` is never reused
on the comm stream before the main stream is done with it. Works under CUDA-graph capture
(fork and join through events).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from lightwell.distributed.comm.base import beside_compute
from lightwell.distributed.parallel_state import tp_all_reduce, tp_all_reduce_start


@dataclass
class PendingAllReduce:
    result: torch.Tensor | None  # the reduced tensor (valid after ``CommStream.wait``)
    event: torch.cuda.Event | None  # recorded on the comm stream after the reduction
    source: torch.Tensor | None  # the input, kept alive until the wait
    phased: Any = None  # a call in phases, finished (summed) by the wait


class CommStream:
    def __init__(self, stream: torch.cuda.Stream | None) -> None:
        self.stream = stream
        self.unjoined: Any = None  # the last finished call in phases, its flag writes unjoined
        self.in_flight: list[Any] = []  # calls in phases launched and not yet taken
        self.owners: list[Any] = []  # the strategies of this forward's calls in phases
        self.forked = False  # the comm stream has waited for the main one in this forward

    def launch(self, x: torch.Tensor) -> PendingAllReduce:
        on_stream = self.stream is not None  # (None: in order, the CPU tests)
        if on_stream and not self.forked:
            # the forward's first launch: the comm stream joins the main one before anything
            # (under CUDA-graph capture a stream records nothing until it has waited for the
            # capturing stream: a claim issued before would run at once, outside the graph),
            # and before the quantize below, so that this call's claim does not wait for it
            self.stream.wait_stream(torch.cuda.current_stream())
            self.forked = True
        with beside_compute():  # (the same picks in order on CPU as on a stream)
            phased = tp_all_reduce_start(x)  # on this (the main) stream
            if phased is not None:
                self.in_flight.append(phased)
                if phased.owner not in self.owners:
                    self.owners.append(phased.owner)
                # its handshake needs no payload: before the wait below
                with torch.cuda.stream(self.stream) if on_stream else contextlib.nullcontext():
                    phased.claim()
            if on_stream:
                self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream) if on_stream else contextlib.nullcontext():
                if phased is None:
                    result = tp_all_reduce(x)
                else:
                    result = None
                    phased.transfer()
                event = None
                if on_stream:
                    event = torch.cuda.Event()
                    event.record(self.stream)
        return PendingAllReduce(result, event, x if on_stream else None, phased)

    def _take(self, pending: PendingAllReduce) -> Any:
        """The main stream waits for the comm stream's part; returns the call in phases (if
        any) for the caller to finish, having joined the call finished before it."""
        if pending.event is not None:
            torch.cuda.current_stream().wait_event(pending.event)
            pending.event = None
        phased, pending.phased, pending.source = pending.phased, None, None
        if phased is not None:
            self.in_flight.remove(phased)
            self.join()  # the call finished before (its writes are done by now)
            self.unjoined = phased
        return phased

    def wait(self, pending: PendingAllReduce) -> torch.Tensor:
        phased = self._take(pending)
        if phased is not None:  # the sum, here on the consumer's stream
            pending.result = phased.finish()
        return pending.result

    def join(self) -> None:
        """The main stream waits for the last finished call's flag writes (a strategy's down
        stream runs in order: they come after every earlier call's)."""
        if self.unjoined is not None:
            self.unjoined.join()
            self.unjoined = None

    def end(self) -> None:
        """The forward's end: every call joined (a CUDA-graph capture must end so), and the
        strategies forget this forward's calls."""
        self.join()
        for owner in self.owners:
            owner.end_forward()
        self.owners, self.forked = [], False

    def abandon(self) -> None:
        """After a forward failed midway: give the unfinished calls' stage sets back, forget
        the rest (the work already queued runs on; nothing waits for it)."""
        for phased in self.in_flight:
            phased.release()
        for owner in self.owners:
            owner.end_forward()
        self.in_flight, self.owners, self.unjoined, self.forked = [], [], None, False
