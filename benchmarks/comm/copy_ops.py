"""Costs of the pieces of hostmem-copy's all-reduce on one GPU, in CUDA graphs. One device call
of about a minute:

    run(command="python3 -m benchmarks.comm.copy_ops --out $OUT/copy_ops.json")

1. Copies and stream memory operations: 4 x 1 MB D2H into pinned memory back to back, with a
   fenced cuStreamWriteValue32 after each (the unfenced flag is refused there), one 4 MB
   copy; the same for H2D with a (satisfied) cuStreamWaitValue32 before each; D2H and H2D
   together on two streams; each direction with its flags on 1-3 streams taking turns.
2. A small kernel's latency beside a large GEMM: the int8 quantize of a 1,024 x 4,096 bf16
   message (and the 2-rank dequant-sum) made ready on a second stream as the GEMM starts,
   normal and high priority, against the same kernel alone (eager, CUDA events).
3. The int8 kernels' tiles (groups a program x warps) on that message, and the sum followed by
   the residual add + RMSNorm.
Medians of 30 runs (part 1: graph replays). Prints a table; writes records of µs. Reference
result: benchmarks/results/comm_copy_ops_h200.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from benchmarks.kernels.timing import graph_replay_us
from lightwell.bench.results import record, write_json

MB = 1 << 20
REPS = 30


def timed_graph(build) -> float:
    """Median µs of one replay of the graph ``build`` records (side streams joined back)."""
    return graph_replay_us(build, reps=REPS, warm=3)


def ready_to_done(fn, gemm, side: torch.cuda.Stream) -> float:
    """Median µs from the moment ``fn`` may start on ``side`` (an event on the main stream,
    behind queued work so that the host is ahead) to its end, with ``gemm`` (if any) started
    on the main stream at the same moment (eager: events around graph nodes cannot time)."""
    times = []
    for _ in range(REPS + 3):
        torch.cuda._sleep(1_000_000)  # keep the host ahead
        ready, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ready.record()
        side.wait_event(ready)
        if gemm is not None:
            gemm()
        with torch.cuda.stream(side):
            fn()
            done.record(side)
        torch.cuda.synchronize()
        times.append(1e3 * ready.elapsed_time(done))
    return statistics.median(times[3:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from lightwell.distributed.comm.hostmem_copy import _DriverOps
    from lightwell.kernels.int8_pack import dequant_sum, packed_row_bytes, quantize_pack

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    # [0, 4 MB): D2H targets, [4, 8 MB): H2D sources, then flags (the strategy's driver calls)
    host = torch.zeros(8 * MB + 4096, dtype=torch.uint8, pin_memory=True)
    host[8 * MB :].view(torch.int32)[:].fill_(1)  # every wait below is already satisfied
    ops = _DriverOps(host)
    src = torch.randint(0, 255, (4 * MB,), dtype=torch.uint8, device=dev)
    dst = torch.empty(4 * MB, dtype=torch.uint8, device=dev)

    def s():
        return torch.cuda.current_stream()

    def d2h(a, n):
        ops.d2h(a, src, a, a + n, s())

    def h2d(a, n):
        ops.h2d(dst, a, a + n, 4 * MB + a, s())

    def write(i):  # fenced
        ops.write_flag(8 * MB + 4 * (64 + i), 1, s())

    def wait(i):
        ops.wait_flag(8 * MB + 4 * i, 1, s())

    rows = []

    def emit(what, us):
        rows.append(record("time_us", us, workload="copy-ops", what=what))
        print(f"{what:60s} {us:8.1f} us", flush=True)

    def each(*ops):  # the ops once per chunk c (each op takes c)
        return lambda: [[op(c) for op in ops] for c in range(4)]

    cases = {
        "d2h 4 x 1 MB": each(lambda c: d2h(c * MB, MB)),
        "d2h 1 x 4 MB": lambda: d2h(0, 4 * MB),
        "d2h 4 x (1 MB + write, fenced)": each(lambda c: d2h(c * MB, MB), write),
        "h2d 4 x 1 MB": each(lambda c: h2d(c * MB, MB)),
        "h2d 4 x (wait + 1 MB + write)": each(
            wait, lambda c: h2d(c * MB, MB), lambda c: write(8 + c)
        ),
        "h2d 4 x (wait + 1 MB)": each(wait, lambda c: h2d(c * MB, MB)),
        "write x 4 (fenced)": each(write),
        "wait x 4 (satisfied)": each(wait),
    }
    for what, fn in cases.items():
        emit(what, timed_graph(fn))

    side = torch.cuda.Stream()

    def both():  # D2H on this stream, H2D on a side stream, concurrently
        side.wait_stream(torch.cuda.current_stream())
        for c in range(4):
            d2h(c * MB, MB)
        with torch.cuda.stream(side):
            for c in range(4):
                h2d(c * MB, MB)
        torch.cuda.current_stream().wait_stream(side)

    emit("d2h 4 x 1 MB || h2d 4 x 1 MB (two streams)", timed_graph(both))

    # the copies with their flags on 1-3 lanes a direction (hostmem-copy's LANES), alone and
    # both directions at once
    lanes_up = [torch.cuda.Stream() for _ in range(3)]
    lanes_down = [torch.cuda.Stream() for _ in range(3)]

    def turns(lanes, up, down):  # chunk c of each direction on lane c % lanes
        def build():
            main = torch.cuda.current_stream()
            for st in lanes_up[:lanes] + lanes_down[:lanes]:
                st.wait_stream(main)
            for c in range(4):
                if up:
                    with torch.cuda.stream(lanes_up[c % lanes]):
                        d2h(c * MB, MB)
                        write(c)
                if down:
                    with torch.cuda.stream(lanes_down[c % lanes]):
                        wait(c)
                        h2d(c * MB, MB)
            for st in lanes_up[:lanes] + lanes_down[:lanes]:
                main.wait_stream(st)

        return build

    for lanes in (1, 2, 3):
        for what, up, down in (("d2h 4 x (1 MB + write)", True, False),
                               ("h2d 4 x (wait + 1 MB)", False, True),
                               ("both directions", True, True)):  # fmt: skip
            emit(f"{what}, {lanes} lane(s)", timed_graph(turns(lanes, up, down)))

    # 2. a small kernel beside a GEMM
    x = torch.randn(1024, 4096, device=dev, dtype=torch.bfloat16)
    n = x.numel()
    rows_, cols = 4, n // 4
    rb = packed_row_bytes(cols)
    packed = torch.empty(rows_, rb, dtype=torch.uint8, device=dev)
    stage = torch.empty(2, rows_ * rb, dtype=torch.uint8, device=dev)
    for r in range(2):  # two ranks' packed messages
        quantize_pack((x * (r + 1)).view(-1), rows_, cols, out=stage[r].view(rows_, rb))
    out = torch.empty(n, dtype=torch.bfloat16, device=dev)
    a = torch.randn(1024, 4096, device=dev, dtype=torch.bfloat16)
    w = torch.randn(14336 * 2 // 2, 4096, device=dev, dtype=torch.bfloat16)  # gate_up at TP=2
    quant = lambda: quantize_pack(x.view(-1), rows_, cols, out=packed)  # noqa: E731
    dsum = lambda: dequant_sum(stage, cols, rows_, out)  # noqa: E731
    gemm = lambda: torch.matmul(a, w.t())  # noqa: E731
    # the two int8 kernels' tiles: groups a program x warps a program
    from lightwell.kernels import int8_pack

    default = int8_pack.GROUPS_PER_PROGRAM, int8_pack.TILE_WARPS
    ref_q, ref_s = quant().clone(), dsum().clone()
    for gpp in (4, 8, 16, 32):
        for warps in (2, 4, 8):
            int8_pack.GROUPS_PER_PROGRAM, int8_pack.TILE_WARPS = gpp, warps
            tq, ts = timed_graph(quant), timed_graph(dsum)
            same = torch.equal(quant(), ref_q) and torch.equal(dsum(), ref_s)
            emit(f"quantize / dequant_sum 1024x4096, {gpp} groups x {warps} warps {same}", tq)
            rows[-1]["us_dequant_sum"] = round(ts, 2)
            print(f"{'':60s} {ts:8.1f} us (dequant_sum)")
    int8_pack.GROUPS_PER_PROGRAM, int8_pack.TILE_WARPS = default
    # the sum, then the residual add + RMSNorm that consumes it
    from lightwell.kernels.rmsnorm import fused_add_rmsnorm

    residual = torch.randn(1024, 4096, device=dev, dtype=torch.bfloat16)
    weight = torch.rand(4096, device=dev, dtype=torch.bfloat16) + 0.5
    apart = lambda: fused_add_rmsnorm(dsum().view(1024, 4096), residual, weight, 1e-5)  # noqa: E731
    emit("dequant_sum, then add + rmsnorm 1024x4096", timed_graph(apart))
    emit("gemm 1024x4096x14336 alone (graph)", timed_graph(gemm))
    for name, fn in (("quantize 1024x4096", quant), ("dequant_sum 1024x4096", dsum)):
        emit(f"{name} alone (graph)", timed_graph(fn))
        for prio in (0, -1):
            side = torch.cuda.Stream(priority=prio)
            for beside in (False, True):
                emit(
                    f"{name} from ready to done, priority {prio}, "
                    + ("a GEMM starting beside" if beside else "alone"),
                    ready_to_done(fn, gemm if beside else None, side),
                )
    write_json(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
