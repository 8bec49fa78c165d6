"""W4A16 matmul (lightwell/kernels/w4a16.py) at llama-3-8b's shapes per GPU, TP=1 and TP=2, group
size 128, bf16 activations: checked against the torch reference, then timed beside cuBLAS on
the bf16 weight of the same shape.

    run(command="python3 -m benchmarks.kernels.w4a16 --out $OUT/w4a16.json")  # ~1 min
    [--rows 1 4 16] [--act-order]
    run(command="python3 -m benchmarks.kernels.w4a16 --sweep --out $OUT/w4a16_sweep.json")

``--sweep`` (under 4 minutes): the GEMV's tiles at one row on the TP=1 shapes: BLOCK_N 1-16;
BLOCK_K 256-2048; 1, 2 or 4 warps; the tiles with 32-256 weights a thread (at least one 16-byte
word chunk each; at 256 the registers are full), 37 of them, one stage (num_stages leaves this
kernel's code as it is: it has no pipelined loads). The tiles compile in parallel processes
first (Triton's disk cache), then each is checked against the reference and timed; the best per
shape is printed last, beside ``pick_config``'s and cuBLAS bf16.
``--budget-s`` (a quarter a shape) stops the sweep's timing early (the rows so far are kept).
``--skinny-sweep``: kernels/w4a16_skinny.py's tiles (BLOCK_N 16-256, SPLIT_K 1-16, 1-8 warps, 3
or 4 stages; 75 of them) and the ``tl.dot`` GEMM's (BLOCK_N, BLOCK_K, warps, stages) at 4 and 16
rows on the TP=1 and TP=2 shapes, beside what ``w4a16_matmul`` runs (the skinny kernel's
``pick_config``) and cuBLAS bf16; ``--budget-s`` splits the timing over the shapes.

Timing: a CUDA graph cycling through enough copies of the weights (>= 200 MB) that no launch
finds them in L2; median of 20 replays; µs a call and the 4-bit weights' bytes (with scales and
zeros) a second.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import functools
import itertools
import json
import multiprocessing
import os
import time

import torch

from benchmarks.kernels.timing import graph_replay_us
from lightwell.bench.results import record, write_json
from lightwell.kernels import w4a16_skinny as skinny
from lightwell.kernels.w4a16 import (
    pick_config,
    w4a16_gemm,
    w4a16_gemv,
    w4a16_matmul,
    w4a16_matmul_ref,
)

SHAPES = {  # name: (N, K) of the weight on one GPU
    "tp1 qkv": (6144, 4096),
    "tp1 o": (4096, 4096),
    "tp1 gate_up": (28672, 4096),
    "tp1 down": (4096, 14336),
    "tp2 qkv": (3072, 4096),
    "tp2 o": (4096, 2048),
    "tp2 gate_up": (14336, 4096),
    "tp2 down": (4096, 7168),
}
GROUP = 128
MIN_BYTES = 200 << 20


def random_w4(n: int, k: int, act_order: bool, dev: torch.device) -> tuple[torch.Tensor, ...]:
    """(qweight [N, K/8], scales [N, G], zeros [N, G], g_idx [K]) of random 4-bit weights."""
    qweight = torch.randint(-(2**31), 2**31 - 1, (n, k // 8), dtype=torch.int32, device=dev)
    scales = torch.rand(n, k // GROUP, device=dev, dtype=torch.bfloat16) * 0.01 + 0.001
    zeros = torch.full((n, k // GROUP), 8.0, device=dev, dtype=torch.bfloat16)
    g_idx = torch.arange(k, device=dev, dtype=torch.int32) // GROUP
    if act_order:
        g_idx = g_idx[torch.randperm(k, device=dev)]
    return qweight, scales, zeros, g_idx


def w4_bytes(n: int, k: int) -> int:
    return n * k // 2 + 2 * (k // GROUP) * n * 2


def weight_copies(n: int, k: int, act_order: bool, dev: torch.device) -> list[tuple]:
    copies = max(2, -(-MIN_BYTES // w4_bytes(n, k)))
    return [random_w4(n, k, act_order, dev) for _ in range(copies)]


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def cublas_us(x: torch.Tensor, n: int, k: int, dev: torch.device) -> float:
    copies = max(2, -(-MIN_BYTES // (n * k * 2)))
    dense = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) / 64 for _ in range(copies)]
    return graph_replay_us(lambda: [x @ w.t() for w in dense], calls=copies)


def measure(name: str, rows: list[int], act_order: bool, dev: torch.device) -> list[dict]:
    n, k = SHAPES[name]
    weights = weight_copies(n, k, act_order, dev)
    gs = 0 if act_order else GROUP
    out = []
    for m in rows:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        err = rel_err(w4a16_matmul(x, *weights[0], group_size=gs), w4a16_matmul_ref(x, *weights[0]))
        if err > 2e-2:
            raise AssertionError(f"{name} m={m}: relative error {err:.3g} against the reference")
        us = graph_replay_us(
            lambda x=x: [w4a16_matmul(x, *w, group_size=gs) for w in weights], calls=len(weights)
        )
        row = dict(shape=name, n=n, k=k, m=m, act_order=act_order, group=GROUP, rel_err=err)
        row.update(gb_s=w4_bytes(n, k) / us / 1e3, cublas_bf16_us=cublas_us(x, n, k, dev))
        print(json.dumps({**row, "us": us}), flush=True)
        out.append(record("w4a16_us", us, **row))
    return out


Tile = tuple[int, int, int, int]  # (BLOCK_N, BLOCK_K, num_warps, num_stages)


def sweep_configs() -> list[Tile]:
    out = []
    for bn, bk, warps in itertools.product((1, 2, 4, 8, 16), (256, 512, 1024, 2048), (1, 2, 4)):
        if 32 <= bn * bk // (32 * warps) <= 256:
            out.append((bn, bk, warps, 1))
    return out


def _compile(configs: list[Tile]) -> int:
    """Compile (by running once, small N) each config into Triton's disk cache: a worker."""
    dev = torch.device("cuda", 0)
    n, k = 256, 4096  # the same specialization as every TP=1 shape (multiples of 16 and 2048)
    w = random_w4(n, k, False, dev)
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    done = 0
    for cfg in configs:
        try:
            w4a16_gemv(x, *w, group_size=GROUP, config=cfg)
            done += 1
        except Exception as e:  # a tile that does not compile is skipped later too
            print(f"compile {cfg}: {type(e).__name__}: {str(e)[:200]}", flush=True)
    torch.cuda.synchronize()
    return done


def precompile(configs: list[Tile]) -> None:
    workers = max(1, min(16, (os.cpu_count() or 2) - 1, len(configs)))
    chunks = [configs[i::workers] for i in range(workers)]
    ctx = multiprocessing.get_context("spawn")
    t0 = time.time()
    try:
        with cf.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
            done = sum(pool.map(_compile, chunks))
    except Exception as e:  # the sweep then compiles each tile as it first runs it
        print(f"parallel compile failed ({type(e).__name__}: {e}); compiling in turn", flush=True)
        return
    print(f"compiled {done}/{len(configs)} tiles in {time.time() - t0:.0f} s", flush=True)


def sweep_shape(name: str, configs: list[Tile], deadline: float, dev: torch.device) -> list[dict]:
    n, k = SHAPES[name]
    weights = weight_copies(n, k, False, dev)
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    ref = w4a16_matmul_ref(x, *weights[0])
    base = dict(shape=name, n=n, k=k, m=1, group=GROUP, cublas_bf16_us=cublas_us(x, n, k, dev))
    default = pick_config(n, k, 1)
    rows = []
    for cfg in [default] + [c for c in configs if c != default]:
        if time.time() > deadline:
            print(f"{name}: budget spent, {len(configs) + 1 - len(rows)} tiles left", flush=True)
            break
        timed = check_and_time(f"{name} {cfg}", lambda w, cfg=cfg: gemv(x, w, cfg), ref, weights)
        if timed is None:
            continue
        err, us = timed
        row = dict(base, config=list(cfg), rel_err=err)
        row["default"] = cfg == default
        row["gb_s"] = w4_bytes(n, k) / us / 1e3
        print(json.dumps({**row, "us": us}), flush=True)
        rows.append(record("w4a16_gemv_us", us, **row))
    return rows


def check_and_time(label: str, call, ref: torch.Tensor, weights: list) -> tuple | None:
    """(relative error, µs a call) of ``call(w)`` over the weight copies, or None when it
    fails or misses the reference by more than 2e-2 (said, not timed)."""
    try:
        err = rel_err(call(weights[0]), ref)
    except Exception as e:
        print(f"{label}: {type(e).__name__}: {str(e)[-300:]}", flush=True)
        return None
    if err > 2e-2:
        print(f"{label}: relative error {err:.3g}: not timed", flush=True)
        return None
    return err, graph_replay_us(lambda: [call(w) for w in weights], calls=len(weights))


def gemv(x: torch.Tensor, w: tuple, cfg: Tile) -> torch.Tensor:
    return w4a16_gemv(x, *w, group_size=GROUP, config=cfg)


def summarize(rows: list[dict]) -> None:
    print("\nshape        best (BN, BK, warps, stages)   us     GB/s   default us  cuBLAS bf16 us")
    for name in dict.fromkeys(r["shape"] for r in rows):
        mine = [r for r in rows if r["shape"] == name]
        default = next((r["value"] for r in mine if r["default"]), float("nan"))
        best = min(mine, key=lambda r: r["value"])
        cfg, us, gb_s = str(tuple(best["config"])), best["value"], best["gb_s"]
        print(
            f"{name:12} {cfg:28} {us:7.2f} {gb_s:6.0f} {default:11.2f} "
            f"{best['cublas_bf16_us']:14.2f}"
        )


def skinny_configs() -> list[tuple]:
    """("skinny", kernels/w4a16_skinny.py's config) and ("gemm", w4a16_gemm's config)."""
    tiles = [(16, 1, 3), (32, 1, 3), (64, 1, 3), (32, 2, 3), (64, 2, 3), (128, 2, 3), (64, 1, 4),
             (64, 2, 4), (128, 2, 4), (64, 4, 3), (64, 4, 4), (128, 4, 3), (128, 4, 4),
             (256, 4, 3), (256, 8, 3)]  # fmt: skip
    out = [
        ("skinny", (bn, 128, split, warps, stages))
        for (bn, warps, stages), split in itertools.product(tiles, (1, 2, 4, 8, 16))
    ]
    out += [
        ("gemm", (16, bn, bk, warps, stages))
        for bn, bk, warps, stages in itertools.product(
            (64, 128, 256), (64, 128, 256), (4, 8), (2, 3, 4)
        )
    ]
    return out


def run_skinny(x, w, cfg) -> torch.Tensor:
    kind, c = cfg
    if kind == "skinny":
        return skinny.w4a16_skinny(x, *w[:3], group_size=GROUP, config=c)
    return w4a16_gemm(x, *w, group_size=GROUP, config=c)


def _compile_skinny(configs: list[skinny.Config]) -> int:
    dev = torch.device("cuda", 0)
    w = random_w4(256, 4096, False, dev)
    x = torch.randn(4, 4096, device=dev, dtype=torch.bfloat16)
    done = 0
    for cfg in configs:
        try:
            run_skinny(x, w, cfg)
            done += 1
        except Exception as e:
            print(f"compile {cfg}: {type(e).__name__}: {str(e)[-600:]}", flush=True)
    torch.cuda.synchronize()
    return done


def skinny_sweep(budget_s: float, dev: torch.device) -> list[dict]:
    configs = skinny_configs()
    workers = max(1, min(16, (os.cpu_count() or 2) - 1))
    t0 = time.time()
    with cf.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        done = sum(pool.map(_compile_skinny, [configs[i::workers] for i in range(workers)]))
    print(f"compiled {done}/{len(configs)} skinny tiles in {time.time() - t0:.0f} s", flush=True)
    rows, names = [], list(SHAPES)
    per = budget_s / (2 * len(names))  # the timing's budget, after the compiles
    for name, m in itertools.product(names, (4, 16)):
        n, k = SHAPES[name]
        weights = weight_copies(n, k, False, dev)
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        ref = w4a16_matmul_ref(x, *weights[0])
        base = dict(shape=name, n=n, k=k, m=m, group=GROUP, cublas_bf16_us=cublas_us(x, n, k, dev))
        base["w4a16_matmul_us"] = graph_replay_us(
            lambda x=x, ws=weights: [w4a16_matmul(x, *w, group_size=GROUP) for w in ws],
            calls=len(weights),
        )
        print(json.dumps(base), flush=True)
        stop = time.time() + per
        for cfg in [("skinny", skinny.pick_config(n, k, m))] + configs:
            if time.time() > stop:
                break
            call = functools.partial(run_skinny, x, cfg=cfg)
            timed = check_and_time(f"{name} m={m} {cfg}", call, ref, weights)
            if timed is None:
                continue
            err, us = timed
            row = dict(base, kind=cfg[0], config=list(cfg[1]), rel_err=err)
            rows.append(record("w4a16_skinny_us", us, gb_s=w4_bytes(n, k) / us / 1e3, **row))
        mine = [r for r in rows if r["shape"] == name and r["m"] == m]
        if mine:
            best = min(mine, key=lambda r: r["value"])
            print(f"BEST {name} m={m}: {best['kind']} {best['config']} {best['value']:.2f} us "
                  f"(w4a16_matmul {base['w4a16_matmul_us']:.2f}, "
                  f"cuBLAS {base['cublas_bf16_us']:.2f}; "
                  f"default {mine[0]['value']:.2f})", flush=True)  # fmt: skip
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write the rows as a JSON results file")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--act-order", action="store_true", help="g_idx gathered (act-order)")
    ap.add_argument("--sweep", action="store_true", help="the GEMV's tile sweep at one row")
    ap.add_argument("--skinny-sweep", action="store_true", help="w4a16_skinny's tiles")
    ap.add_argument("--budget-s", type=float, default=170.0, help="the sweep's timing budget")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    torch.manual_seed(0)
    dev = torch.device("cuda", 0)
    if args.skinny_sweep:
        rows = skinny_sweep(args.budget_s, dev)
    elif args.sweep:
        configs = sweep_configs()
        precompile(configs)
        tp1 = [name for name in SHAPES if name.startswith("tp1")]
        rows = []
        for name in tp1:  # each shape gets its share of the budget
            rows += sweep_shape(name, configs, time.time() + args.budget_s / len(tp1), dev)
        summarize(rows)
    else:
        rows = [r for name in SHAPES for r in measure(name, args.rows, args.act_order, dev)]
    if args.out:
        write_json(args.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
