"""Programmatic dependent launch (kernels/pdl.py) on the batch-1 decode chain, one GPU.

32 layers of the engine's own kernels, each feeding the next as in a llama-3-8b decoder layer
at batch 1 (TP=1 and TP=2 weight shapes, bf16, random weights): fused add + RMSNorm -> qkv gemv
-> o_proj gemv (on the q part) -> fused add + RMSNorm -> gate_up gemv -> down gemv with the
SiLU-and-mul fused. No attention, RoPE or all-reduce between them, so a gain here is an upper
bound of the engine's (gpu_tp.py's W1 engines measure that). For each shape set: the chain's
output with PDL off and on (prefetching 0, 1 or 3 K tiles toward L2 before the wait), eagerly
and replayed from a CUDA graph, must be bit-identical (a race in the wait would show); then
the median replay time of the graph (after warm-up, L2 not flushed: the 32 layers' weights,
7-14 GB, do not fit in it).

    python3 benchmarks/gpu_pdl.py --out $OUT/pdl.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from lightwell.bench.results import git_commit  # noqa: E402
from lightwell.kernels import pdl  # noqa: E402
from lightwell.kernels.gemv import gemv  # noqa: E402
from lightwell.kernels.rmsnorm import fused_add_rmsnorm  # noqa: E402

# [N, K] per rank: qkv, o_proj, gate_up, down
SHAPES = {
    "tp1": dict(qkv=(6144, 4096), o=(4096, 4096), gate_up=(28672, 4096), down=(4096, 14336)),
    "tp2": dict(qkv=(3072, 4096), o=(4096, 2048), gate_up=(14336, 4096), down=(4096, 7168)),
}


def build(shapes: dict, layers: int, dev: torch.device):
    g = torch.Generator(device=dev).manual_seed(0)
    bf = torch.bfloat16
    ws = [
        {n: torch.randn(*s, device=dev, dtype=bf, generator=g) * 0.02 for n, s in shapes.items()}
        for _ in range(layers)
    ]
    norms = torch.ones(2 * layers, 4096, device=dev, dtype=bf)
    x0 = torch.randn(1, 4096, device=dev, dtype=bf, generator=g)
    q_width = shapes["o"][1]

    def chain() -> torch.Tensor:
        h, res = x0, torch.zeros_like(x0)
        for i, w in enumerate(ws):
            y, res = fused_add_rmsnorm(h, res, norms[2 * i], 1e-5)
            qkv = gemv(y, w["qkv"])
            o = gemv(qkv[:, :q_width], w["o"])
            y, res = fused_add_rmsnorm(o, res, norms[2 * i + 1], 1e-5)
            h = gemv(gemv(y, w["gate_up"]), w["down"], silu_mul=True)
        return h + res

    return chain


def measure(chain, reps: int) -> dict:
    eager = chain().clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        chain()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain()
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    replayed = out.clone()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return {"eager": eager, "graph": replayed, "us": statistics.median(times),
            "us_min": min(times)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    dev = torch.device("cuda")
    info = {"commit": git_commit(), "device": torch.cuda.get_device_name(dev),
            "torch": torch.__version__, "supported": pdl.device_supports(dev)}  # fmt: skip
    rows, saved = [], (pdl.ENABLED, pdl.PREFETCH_TILES)
    for name, shapes in SHAPES.items():
        chain = build(shapes, args.layers, dev)
        res: dict[str, list] = {}
        modes = {"off": (False, 1), "pf0": (True, 0), "pf1": (True, 1), "pf3": (True, 3)}
        for _ in range(2):  # twice each, interleaved
            for mode, (on, tiles) in modes.items():
                pdl.ENABLED, pdl.PREFETCH_TILES = on, tiles
                res.setdefault(mode, []).append(measure(chain, args.reps))
        pdl.ENABLED, pdl.PREFETCH_TILES = saved
        ref = res["off"][0]["eager"]
        outs = [r[k] for rs in res.values() for r in rs for k in ("eager", "graph")]
        row = {"shapes": name, "layers": args.layers}
        row["identical"] = all(torch.equal(o, ref) for o in outs)
        for mode, rs in res.items():
            row[f"{mode}_us"] = [round(r["us"], 1) for r in rs]
            row[f"{mode}_min_us"] = [round(r["us_min"], 1) for r in rs]
            if mode != "off":
                gain = min(row["off_us"]) - min(row[f"{mode}_us"])
                row[f"{mode}_gain_us_per_layer"] = round(gain / args.layers, 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
        del chain
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"info": info, "rows": rows, "command": " ".join(sys.argv)}, f, indent=1)


if __name__ == "__main__":
    main()
