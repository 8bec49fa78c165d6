"""Programmatic dependent launch (kernels/pdl.py) on the batch-1 decode chain, one GPU.

32 layers of the engine's own kernels, each feeding the next as in a llama-3-8b decoder layer
at batch 1 (TP=1 and TP=2 weight shapes, bf16, random weights): fused add + RMSNorm -> qkv gemv
-> o_proj gemv (on the q part) -> fused add + RMSNorm -> gate_up gemv -> down gemv with the
SiLU-and-mul fused. No attention, RoPE or all-reduce between them, so a gain here is an upper
bound of the engine's (workloads/tp.py's tp1 / tp1-nopdl engines measure that). For each shape
set: the chain's output with PDL off and on, eagerly and replayed from a CUDA graph, must be
bit-identical (a race in the wait would show); then the median replay time of the graph
(after warm-up, L2 not flushed: the 32 layers' weights, 7-14 GB, do not fit in it), twice
each, interleaved. One device call of about a minute:

    run(command="python3 -m benchmarks.kernels.pdl --out $OUT/pdl.json")

Reference result: benchmarks/results/kernels_pdl_h200.json.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from benchmarks.kernels.timing import event_times_us
from lightwell.bench.results import record, write_json
from lightwell.kernels import pdl
from lightwell.kernels.gemv import gemv
from lightwell.kernels.rmsnorm import fused_add_rmsnorm

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
    times = event_times_us(graph.replay, reps, warm=0)
    return {"eager": eager, "graph": replayed, "us": statistics.median(times),
            "us_min": min(times)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    for name, shapes in SHAPES.items():
        chain = build(shapes, args.layers, dev)
        res: dict[str, list] = {}
        for _ in range(2):  # twice each, interleaved
            for mode, on in (("off", False), ("on", True)):
                pdl.set_enabled(on)
                res.setdefault(mode, []).append(measure(chain, args.reps))
        pdl.set_enabled(True)
        ref = res["off"][0]["eager"]
        outs = [r[k] for rs in res.values() for r in rs for k in ("eager", "graph")]
        row = {"shapes": name, "layers": args.layers, "supported": pdl.device_supports(dev)}
        row["identical"] = all(torch.equal(o, ref) for o in outs)
        for mode, rs in res.items():
            row[f"{mode}_us"] = [round(r["us"], 1) for r in rs]
            row[f"{mode}_min_us"] = [round(r["us_min"], 1) for r in rs]
        gain = (min(row["off_us"]) - min(row["on_us"])) / args.layers
        rows.append(record("gain_us_per_layer", gain, workload="kernels-pdl", **row))
        print(json.dumps(rows[-1]), flush=True)
        del chain
        torch.cuda.empty_cache()
    write_json(args.out, rows)


if __name__ == "__main__":
    main()
