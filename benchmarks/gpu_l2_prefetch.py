"""Does pulling a decode GEMM's weights into L2 while a latency-bound kernel runs make the GEMM
faster? One H200, llama-3-8b weight shapes at TP=2, bf16, CUDA-graph replays after an L2 flush.

Part 1 (`gemm`): per shape and row count, the GEMM alone, after a prefetch of P bytes of its
weight, and behind a sleep kernel (standing in for an all-reduce or attention) with and without
the prefetch issued before the sleep; each prefetch method (bulk TMA prefetch, per-line
prefetch, plain loads on a side stream).
Part 2 (`layers`): 32 decoder layers' GEMM sequence with sleeps where the other kernels go,
with and without prefetches of the next GEMM's weights at the points the engine would issue
them. Times are medians of per-replay CUDA events, minus the flush-only graph.

    python3 benchmarks/gpu_l2_prefetch.py --out $OUT/l2.json
"""

# Every closure below is captured into a CUDA graph and timed inside the loop iteration that
# defines it, so late binding of loop variables (B023) cannot bite.
# ruff: noqa: B023

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from lightwell.bench.results import git_commit  # noqa: E402

MB = 1 << 20
SHAPES = {  # [N, K] per rank at TP=2
    "qkv": (3072, 4096),
    "o": (4096, 2048),
    "gate_up": (14336, 4096),
    "down": (4096, 7168),
}


@triton.jit
def _prefetch_bulk(ptr, nbytes, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    off = tl.minimum(idx.to(tl.int64) * CHUNK, nbytes - CHUNK)
    addr = ptr.to(tl.pointer_type(tl.int8)) + off
    tl.inline_asm_elementwise(
        "cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;",
        "=r,l,r",
        [addr, tl.full([BLOCK], CHUNK, tl.int32)],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _prefetch_lines(ptr, nbytes, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    off = tl.minimum(idx.to(tl.int64) * 128, nbytes - 128)
    addr = ptr.to(tl.pointer_type(tl.int8)) + off
    tl.inline_asm_elementwise(
        "prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;",
        "=r,l",
        [addr],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _prefetch_load(ptr, n_words, flag, out_ptr, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], tl.int32)
    base = pid.to(tl.int64) * BLOCK * ITERS
    p = ptr.to(tl.pointer_type(tl.int32))
    for i in tl.static_range(ITERS):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        acc ^= tl.load(p + offs, mask=offs < n_words, other=0, eviction_policy="evict_last")
    out = out_ptr + pid * BLOCK + tl.arange(0, BLOCK)
    tl.store(out, acc, mask=tl.full([BLOCK], flag, tl.int32) != 0)


SINK = {}


def prefetch(w: torch.Tensor, nbytes: int, method: str) -> None:
    nbytes = min(nbytes, w.numel() * w.element_size())
    if method.startswith("bulk"):
        chunk = int(method[4:]) * 1024
        nbytes -= nbytes % chunk
        if nbytes == 0:
            return
        block = 32
        _prefetch_bulk[(triton.cdiv(nbytes // chunk, block),)](w, nbytes, CHUNK=chunk, BLOCK=block)
    elif method == "lines":
        block = 1024
        _prefetch_lines[(triton.cdiv(nbytes // 128, block),)](w, nbytes, BLOCK=block)
    elif method == "load":
        block, iters = 1024, 16
        words = nbytes // 4
        grid = triton.cdiv(words, block * iters)
        sink = SINK.setdefault(w.device, torch.empty(1 << 22, dtype=torch.int32, device=w.device))
        _prefetch_load[(grid,)](w, words, 0, sink, BLOCK=block, ITERS=iters, num_warps=8)
    else:
        raise ValueError(method)


class Timer:
    def __init__(self, flush: torch.Tensor, reps: int):
        self.flush = flush
        self.reps = reps
        self.base = None

    def graph(self, fn) -> torch.cuda.CUDAGraph:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                self.flush.add_(1)
                fn()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            self.flush.add_(1)
            fn()
        return g

    def time(self, fn) -> float:  # us, flush excluded
        g = self.graph(fn)
        for _ in range(3):
            g.replay()
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(self.reps)
        ]
        for a, b in events:
            a.record()
            g.replay()
            b.record()
        torch.cuda.synchronize()
        t = statistics.median(a.elapsed_time(b) for a, b in events) * 1e3
        if self.base is None:
            return t
        return t - self.base


def sleep_cycles_per_us() -> float:
    """The slope of torch.cuda._sleep's time over its cycle count (after a warm-up launch)."""

    def us(cycles: int) -> float:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        torch.cuda._sleep(cycles)
        b.record()
        torch.cuda.synchronize()
        return a.elapsed_time(b) * 1e3

    us(1000)
    t1 = statistics.median(us(200_000) for _ in range(5))
    t2 = statistics.median(us(400_000) for _ in range(5))
    return 200_000 / (t2 - t1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--parts", default="gemm,layers")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--methods", default="lines,load,bulk16")
    ap.add_argument("--sleeps", default="10,25")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    flush = torch.zeros(256 * MB // 4, dtype=torch.float32, device=dev)
    timer = Timer(flush, args.reps)
    timer.base = timer.time(lambda: None)
    cyc = sleep_cycles_per_us()
    rows: list[dict] = []
    info = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "commit": git_commit(),
        "flush_us": timer.base,
        "sleep_cycles_per_us": cyc,
        "l2_bytes": getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", None),
    }
    print(info, flush=True)
    methods = args.methods.split(",")
    sleeps = [float(v) for v in args.sleeps.split(",")]

    def sleep(us: float) -> None:
        torch.cuda._sleep(int(us * cyc))

    if "gemm" in args.parts:
        for name, (n, k) in SHAPES.items():
            w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
            wbytes = n * k * 2
            for m in (1, 64):
                x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                r = {"part": "gemm", "shape": name, "m": m, "weight_mb": wbytes / MB}
                r["gemm"] = timer.time(lambda: F.linear(x, w))
                for sl in sleeps:
                    r[f"sleep{sl}+gemm"] = timer.time(lambda sl=sl: (sleep(sl), F.linear(x, w)))
                    r[f"sleep{sl}"] = timer.time(lambda sl=sl: sleep(sl))
                    for meth in methods:
                        for pmb in (16, 32, 48):
                            p = pmb * MB
                            if p > wbytes + 16 * MB:
                                continue
                            ss = torch.cuda.Stream() if meth in ("load", "bulk16") else None

                            def fn(gemm, p=p, meth=meth, ss=ss, sl=sl):
                                if ss is None:
                                    prefetch(w, p, meth)
                                    sleep(sl)
                                else:  # a blocking prefetch: on a side stream beside the sleep
                                    ss.wait_stream(torch.cuda.current_stream())
                                    with torch.cuda.stream(ss):
                                        prefetch(w, p, meth)
                                    sleep(sl)
                                    torch.cuda.current_stream().wait_stream(ss)
                                if gemm:
                                    F.linear(x, w)

                            key = f"{meth}:{pmb}+sleep{sl}"
                            r[key + "+gemm"] = timer.time(lambda fn=fn: fn(True))
                            r[key] = timer.time(lambda fn=fn: fn(False))
                            r[key + ":gemm_after"] = r[key + "+gemm"] - r[key]
                rows.append(r)
                print(
                    json.dumps(
                        {k: (round(v, 1) if isinstance(v, float) else v) for k, v in r.items()}
                    ),
                    flush=True,
                )
            del w
            torch.cuda.empty_cache()

    if "layers" in args.parts:
        layers = 32
        ws = [
            {nm: torch.randn(*SHAPES[nm], device=dev, dtype=torch.bfloat16) * 0.02 for nm in SHAPES}
            for _ in range(layers)
        ]
        for m, ar_us in ((1, 9.0), (64, 30.0)):
            x = torch.randn(m, 4096, device=dev, dtype=torch.bfloat16)
            xo = torch.randn(m, 2048, device=dev, dtype=torch.bfloat16)
            xd = torch.randn(m, 7168, device=dev, dtype=torch.bfloat16)
            attn_us = 10.0 if m == 1 else 15.0

            def run(meth: str | None, gate_mb: int) -> None:
                for i in range(layers):
                    L = ws[i]
                    sleep(3)  # input norm
                    F.linear(x, L["qkv"])
                    if meth:
                        prefetch(L["o"], 1 << 40, meth)
                    sleep(attn_us)  # rope, kv store, attention
                    F.linear(xo, L["o"])
                    if meth:
                        prefetch(L["gate_up"], gate_mb * MB, meth)
                    sleep(ar_us + 3)  # all-reduce + norm
                    F.linear(x, L["gate_up"])
                    sleep(2)  # silu
                    F.linear(xd, L["down"])
                    if meth and i + 1 < layers:
                        prefetch(ws[i + 1]["qkv"], 1 << 40, meth)
                    sleep(ar_us)  # all-reduce

            r = {"part": "layers", "m": m, "ar_us": ar_us, "attn_us": attn_us}
            r["plain"] = timer.time(lambda: run(None, 0))
            r["sleeps_only"] = timer.time(
                lambda: [sleep(3 + attn_us + ar_us + 3 + 2 + ar_us) for _ in range(layers)]
            )
            for meth in methods:
                if meth != "lines":  # the others block the stream they run on
                    continue
                for gmb in (16, 32, 40):
                    r[f"{meth}:gate{gmb}"] = timer.time(lambda meth=meth, gmb=gmb: run(meth, gmb))
            rows.append(r)
            print(
                json.dumps({k: (round(v, 1) if isinstance(v, float) else v) for k, v in r.items()}),
                flush=True,
            )

    with open(args.out, "w") as f:
        json.dump({"info": info, "rows": rows, "command": " ".join(sys.argv)}, f, indent=1)


if __name__ == "__main__":
    main()
