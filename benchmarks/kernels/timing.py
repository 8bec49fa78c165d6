"""Shared CUDA-event timing of the one-GPU probes (kernels/blas.py, kernels/gemv.py,
kernels/int8_pack.py, comm/copy_ops.py, kernels/fused_moe.py, ...): calls of a function timed one
at a time, or a CUDA graph's replays. A helper, not a benchmark."""

from __future__ import annotations

import statistics

import torch


def event_times_us(fn, reps: int = 20, warm: int = 3) -> list[float]:
    """µs of each of ``reps`` calls of ``fn`` after ``warm`` discarded ones: CUDA events around
    one call, the host waiting for its end before the next."""
    times = []
    for _ in range(warm + reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(1e3 * start.elapsed_time(end))
    return times[warm:]


def event_us(fn, reps: int = 20, warm: int = 3) -> float:
    """Median µs of a call of ``fn`` (``event_times_us``)."""
    return statistics.median(event_times_us(fn, reps, warm))


def graph_replay_us(build, calls: int = 1, reps: int = 20, warm: int = 2) -> float:
    """Median µs per call of what ``build`` launches, captured once into a CUDA graph:
    ``calls`` is how many calls one ``build`` makes (a replay's time is divided by it), over
    ``reps`` replays after ``warm`` untimed ones. ``build`` runs once eagerly first (Triton
    compiles, allocations settle); side streams it forks must be joined back."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        build()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        build()
    torch.cuda.synchronize()
    return statistics.median(t / calls for t in event_times_us(graph.replay, reps, warm))
