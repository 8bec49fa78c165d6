"""``python3 -m benchmarks.kernels.fused_moe --decode``: the few-token MoE GEMV kernels
(lightwell/kernels/moe_gemv.py) against the grouped kernels of lightwell/kernels/fused_moe.py,
bf16, at 1, 2, 4 and 8 tokens, on Mixtral-8x7B's and DeepSeek-V2-Lite's expert shapes.

1. Every tile of the sweep (BLOCK_N 1-16, BLOCK_K 256-2048, 1-4 warps, 64-256 bytes of weights a
   thread per K step, 3 stages) is compiled first, in parallel processes (Triton's disk cache).
2. Per shape and token count, each GEMV kernel alone per tile: its output checked against a
   torch fp32 reference (largest error over the largest value < 2e-2), then timed; then the
   best tile with 1 stage. Tiles left when ``--budget-s`` has passed are skipped (printed).
3. Both paths end to end through ``fused_moe``: the GEMV one with the best tiles and with the
   default ones (``moe_gemv.pick_config``), and the grouped one, each checked against
   ``fused_moe_ref`` first.

Timing: CUDA graphs cycling through enough copies of the layer's experts that the smallest read
(one token's down projections) passes 200 MB a replay, so no launch finds its weights in L2;
median of 20 replays (benchmarks/kernels/timing.py). GB/s: the bytes of the chosen experts'
weights (each expert used counted once) over the time. A helper of kernels/fused_moe.py.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import multiprocessing
import os
import time

import torch
import torch.nn.functional as F

from benchmarks.kernels.blas import MIN_BYTES
from benchmarks.kernels.timing import graph_replay_us
from lightwell.bench.results import make_record
from lightwell.kernels import moe_gemv as mg
from lightwell.kernels.fused_moe import fused_moe, fused_moe_ref

# name: (experts, top_k, hidden, intermediate)
SHAPES = {"mixtral-8x7b": (8, 2, 4096, 14336), "deepseek-v2-lite": (64, 6, 2048, 1408)}
TOKENS = (1, 2, 4, 8)
TOL = 2e-2
DEVICE = "cuda"
DTYPE = torch.bfloat16


def _randn(shape: tuple, gen: torch.Generator, dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.randn(shape, device=DEVICE, dtype=dtype or DTYPE, generator=gen)


def sweep(mats: int) -> list[mg.Config]:
    """Tiles with 64-256 bytes of bf16 weights a thread per K step (``mats`` matrices)."""
    out = []
    for bn, bk, warps in itertools.product((1, 2, 4, 8, 16), (256, 512, 1024, 2048), (1, 2, 4)):
        if 64 <= mats * bn * bk * 2 / (32 * warps) <= 256:
            out.append((bn, bk, warps, 3))
    return out


def _warm(jobs: list[tuple[str, tuple, mg.Config, bool]]) -> int:
    """Compile (not run) each kernel specialisation into Triton's disk cache (a worker)."""
    from lightwell.kernels import pdl

    bf16, pdl_args = torch.bfloat16, pdl.kernel_args(torch.device("cuda"))  # the engine's
    for kind, ints, (bn, bk, warps, stages), even in jobs:
        extra = {}
        if kind == "gate_up":  # (its sizes begin with the token count; no shared experts here)
            kernel, ptrs, ints = mg._moe_gemv_gate_up, (bf16, bf16, torch.int64, bf16), (1, *ints)
            extra = {"EARLY": False}
        else:
            kernel, ptrs = mg._moe_gemv_down, (bf16, bf16, torch.int64, torch.float32, bf16)
        kernel.warmup(*ptrs, *ints, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=even, num_warps=warps,
                      num_stages=stages, grid=(1,), **extra, **pdl_args)  # fmt: skip
    return len(jobs)


def precompile(names: list[str]) -> None:
    specs = {}  # one job a compiled form: the sizes count only by their divisibility by 16
    for name in names:
        experts, top_k, hidden, inter = SHAPES[name]
        ints, div = (top_k, experts, 0, hidden, inter), (hidden % 16 == 0, inter % 16 == 0)
        for kind, cfgs, k in (("gate_up", sweep(2), hidden), ("down", sweep(1), inter)):
            for cfg in cfgs:
                specs[kind, cfg, k % cfg[1] == 0, div] = (kind, ints, cfg, k % cfg[1] == 0)
    jobs = list(specs.values())
    workers = max(1, min(16, (os.cpu_count() or 2) - 1))
    start = time.time()
    try:
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
            done = sum(pool.map(_warm, [jobs[i::workers] for i in range(workers)]))
        print(f"precompiled {done} kernels in {time.time() - start:.0f} s", flush=True)
    except Exception as exc:  # noqa: BLE001 -- compiling in the main process instead
        print(f"precompile failed ({exc!r}); compiling as the sweep goes", flush=True)


def _act_ref(x, w13, ids) -> torch.Tensor:  # [T * k, I] fp32
    top_k, inter = ids.shape[1], w13.shape[1] // 2
    rows = []
    for p, e in enumerate(ids.reshape(-1).tolist()):
        gate, up = (w13[e].float() @ x[p // top_k].float()).split(inter)
        rows.append(F.silu(gate) * up)
    return torch.stack(rows)


def _down_ref(act, w2, weights, ids) -> torch.Tensor:  # [T, H] fp32
    num_tokens, top_k = ids.shape
    out = torch.zeros(num_tokens, w2.shape[1], device=act.device)
    for p, e in enumerate(ids.reshape(-1).tolist()):
        out[p // top_k] += weights.reshape(-1)[p].float() * (w2[e].float() @ act[p].float())
    return out


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


class Case:
    """One shape's weight copies and a token count's inputs."""

    def __init__(self, name: str, tokens: int, w13s, w2s):
        experts, top_k, hidden, inter = SHAPES[name]
        gen = torch.Generator(device=DEVICE).manual_seed(tokens)
        self.name, self.tokens, self.w13s, self.w2s = name, tokens, w13s, w2s
        self.x = _randn((tokens, hidden), gen)
        logits = _randn((tokens, experts), gen, torch.float32)
        self.weights, self.ids = logits.softmax(-1).topk(top_k, dim=-1)
        self.used = self.ids.unique().numel()
        self.matrix_bytes = self.used * hidden * inter * 2  # one matrix of each expert used
        self.act = _act_ref(self.x, w13s[0], self.ids).to(self.x.dtype)
        self.out_ref = _down_ref(self.act, w2s[0], self.weights, self.ids)

    def gbps(self, us: float, mats: int = 3) -> float:
        """GB/s of ``mats`` matrices of every expert used read in ``us``."""
        return round(mats * self.matrix_bytes / us / 1e3, 1)

    def time_kernel(self, kind: str, cfg: mg.Config) -> tuple[float, float]:  # (us, error)
        if kind == "gate_up":
            err = _err(mg.moe_gemv_gate_up(self.x, self.w13s[0], self.ids, cfg), self.act)
            calls = [lambda w=w: mg.moe_gemv_gate_up(self.x, w, self.ids, cfg) for w in self.w13s]
        else:
            got = mg.moe_gemv_down(self.act, self.w2s[0], self.weights, self.ids, cfg)
            err = _err(got, self.out_ref)
            calls = [
                lambda w=w: mg.moe_gemv_down(self.act, w, self.weights, self.ids, cfg)
                for w in self.w2s
            ]  # fmt: skip
        if not err < TOL:
            raise AssertionError(f"{self.name} T={self.tokens} {kind} {cfg}: error {err:.3g}")
        return graph_replay_us(lambda: [c() for c in calls], calls=len(calls)), err

    def time_path(self, **kwargs) -> tuple[float, float]:  # fused_moe end to end: (us, error)
        args = (self.x, self.w13s[0], self.w2s[0], self.weights, self.ids)
        err = _err(fused_moe(*args, **kwargs), fused_moe_ref(*args))
        if not err < TOL:
            raise AssertionError(f"{self.name} T={self.tokens} {kwargs}: error {err:.3g}")
        layers = list(zip(self.w13s, self.w2s))
        fn = lambda: [fused_moe(self.x, a, b, self.weights, self.ids, **kwargs) for a, b in layers]  # noqa: E731
        return graph_replay_us(fn, calls=len(layers)), err


def best_tile(case: Case, kind: str, deadline: float) -> tuple[mg.Config, float, list]:
    ranked, skipped = [], 0
    for cfg in sweep(2 if kind == "gate_up" else 1):
        if time.time() > deadline and ranked:
            skipped += 1
            continue
        ranked.append((case.time_kernel(kind, cfg)[0], cfg))
    ranked.sort()
    if time.time() < deadline:  # one stage (no software pipelining) for the best tile
        one = (*ranked[0][1][:3], 1)
        ranked = sorted([*ranked, (case.time_kernel(kind, one)[0], one)])
    if skipped:
        print(f"{case.name} T={case.tokens} {kind}: {skipped} tiles skipped (--budget-s)")
    return ranked[0][1], ranked[0][0], [(round(t, 1), list(c)) for t, c in ranked[:5]]


def run_shape(name: str, common: dict, deadline: float) -> list[dict]:
    experts, top_k, hidden, inter = SHAPES[name]
    copies = max(2, -(-MIN_BYTES // (top_k * hidden * inter * 2)))
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    w13s = [_randn((experts, 2 * inter, hidden), gen).mul_(0.02) for _ in range(copies)]
    w2s = [_randn((experts, hidden, inter), gen).mul_(0.02) for _ in range(copies)]
    rows = []
    for tokens in TOKENS:
        case = Case(name, tokens, w13s, w2s)
        gu, gu_us, gu_top = best_tile(case, "gate_up", deadline)
        dn, dn_us, dn_top = best_tile(case, "down", deadline)
        best_us, err = case.time_path(gemv=True, gemv_configs=(gu, dn))
        default_us, _ = case.time_path(gemv=True)
        grouped_us, grouped_err = case.time_path(gemv=False)
        gbps = case.gbps
        row = dict(shape=name, tokens=tokens, experts_used=case.used, weight_copies=copies,
                   gemv_best_us=round(best_us, 1), gemv_best_gbps=gbps(best_us),
                   gemv_default_us=round(default_us, 1), gemv_default_gbps=gbps(default_us),
                   grouped_us=round(grouped_us, 1), grouped_gbps=gbps(grouped_us),
                   speedup_vs_grouped=round(grouped_us / best_us, 2),
                   rel_err=round(err, 5), grouped_rel_err=round(grouped_err, 5),
                   gate_up_best=list(gu), gate_up_us=round(gu_us, 1),
                   gate_up_gbps=gbps(gu_us, 2), gate_up_top5=gu_top,
                   down_best=list(dn), down_us=round(dn_us, 1), down_gbps=gbps(dn_us, 1),
                   down_top5=dn_top)  # fmt: skip
        print(
            f"{name} T={tokens}: gemv {best_us:.1f} us {row['gemv_best_gbps']} GB/s (default "
            f"tiles {default_us:.1f} us), grouped {grouped_us:.1f} us; best gate_up {list(gu)} "
            f"{gu_us:.1f} us, down {list(dn)} {dn_us:.1f} us",
            flush=True,
        )
        rows.append(make_record("moe_gemv_graph_us", best_us, common, **row))
    return rows


def run_decode(names: list[str], common: dict, budget_s: float) -> list[dict]:
    start = time.time()
    precompile(names)
    rows = []
    for name in names:
        rows += run_shape(name, common, start + budget_s)
    for r in rows:
        tiles = f"gate_up {r['gate_up_best']} down {r['down_best']}"
        print(f"best {r['shape']} T={r['tokens']}: {tiles}: {r['gemv_best_us']} us "
              f"vs grouped {r['grouped_us']} us")  # fmt: skip
    print(f"decode sweep: {time.time() - start:.0f} s", flush=True)
    return rows
