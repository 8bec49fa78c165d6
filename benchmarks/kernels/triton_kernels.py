"""Every Triton kernel checked against its torch reference at llama-3-8b sizes, then timed
(paged attention decode / prefill / mixed, RMSNorm, RoPE, KV store, SiLU-and-mul), with the
engine's torch layers, its torch backend and scaled_dot_product_attention as peers. One device
call of a few minutes:

    run(command="python3 -m benchmarks.kernels.triton_kernels --out $OUT/kernels.json")

Correctness runs in bf16 and fp16; timings in bf16 (--time-dtypes to change). Triton kernels are
timed as CUDA-graph replays (10 calls a graph, median of 20 replays: GPU time, no launch cost, and
a warm L2 for small cases: see "l2_resident"); the torch paths, which cannot be captured, with
triton.testing.do_bench (median, L2 flushed). ``--no-sweep`` skips the split and tile sweeps.
Exit status 1 if any correctness check fails. ``--smoke`` runs tiny shapes anywhere, to check the
script itself (on CPU: TRITON_INTERPRET=1 ... --smoke --dtypes fp16 --time-dtypes fp16, since the
interpreter gets bf16 wrong). Reference result: benchmarks/results/kernels_triton_h200.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from benchmarks.kernels.timing import event_times_us
from lightwell.attention.metadata import AttentionMetadata
from lightwell.attention.torch_backend import TorchAttentionBackend, write_kv_cache
from lightwell.attention.triton_backend import TritonAttentionBackend
from lightwell.bench.results import record, write_json
from lightwell.kernels import activation, kv_store, paged_attention, rmsnorm, rotary
from lightwell.layers.activation import SiluAndMul
from lightwell.layers.norm import RMSNorm
from lightwell.layers.rotary import get_rope

COPY_GBPS, MATMUL_TFLOPS, L2_BYTES = 4221.0, 788.0, 60e6
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3}  # atol = rtol; refs compute in fp32
BS = 16  # KV block size


class Bench:
    def __init__(self, args: argparse.Namespace):
        self.args, self.dev = args, "cuda" if torch.cuda.is_available() else "cpu"
        self.rows: list[dict] = []
        self.failures: list[str] = []
        self.meta = {"workload": "kernels", "model": "llama-3-8b", "tp": 1}

    def check(self, name: str, out: torch.Tensor, ref: torch.Tensor, tol: float) -> float:
        err = (out.float() - ref.float()).abs()
        bad = err > tol + tol * ref.float().abs()
        max_err = float(err.max()) if err.numel() else 0.0
        if bool(bad.any()) or not bool(torch.isfinite(out).all()):
            self.failures.append(f"{name}: max abs err {max_err:.3g}, {int(bad.sum())} bad")
            print(f"FAIL {name}: max abs err {max_err:.3g}", flush=True)
        return max_err

    def record(self, kernel: str, case: str, dtype: str, us: float, **extra) -> None:
        row = record("time_us", round(us, 2), **self.meta, kernel=kernel, case=case, dtype=dtype)
        row.update({k: round(v, 4 if k == "max_err" else 2) if isinstance(v, float) else v
                    for k, v in extra.items()})  # fmt: skip
        self.rows.append(row)
        shown = ("kernel", "case", "dtype", "value", *extra)
        print(json.dumps({k: row[k] for k in shown}), flush=True)

    def graph_us(self, fn, calls: int = 10, trials: int = 20) -> float:
        """GPU time of one call: median over replays of a graph holding ``calls`` calls."""
        if self.dev != "cuda":
            return _wall_us(fn)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        graph.replay()
        times = [t / calls for t in event_times_us(graph.replay, trials, warm=0)]
        del graph
        return statistics.median(times)

    def eager_us(self, fn) -> float:
        if self.dev != "cuda":
            return _wall_us(fn)
        import triton.testing

        return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median") * 1e3


def _wall_us(fn, reps: int = 2) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps * 1e6


# ---- paged attention -------------------------------------------------------------------------


def make_batch(b: Bench, qlens: list[int], ctxs: list[int], dtype, hq: int, hkv: int, d: int):
    """Random q/k/v, a cache whose blocks are scattered over a pool, and the metadata."""
    seq = [c + n for c, n in zip(ctxs, qlens)]
    nblocks = [-(-s // BS) for s in seq]
    pool = sum(nblocks) + 64
    perm = torch.randperm(pool, device=b.dev).to(torch.int32)
    table = torch.zeros(len(qlens), max(nblocks), dtype=torch.int32, device=b.dev)
    offsets = [0]
    for i, nb in enumerate(nblocks):
        table[i, :nb] = perm[offsets[-1] : offsets[-1] + nb]
        offsets.append(offsets[-1] + nb)
    cache = torch.randn(2, pool, BS, hkv, d, dtype=dtype, device=b.dev)
    t = sum(qlens)
    q = torch.randn(t, hq, d, dtype=dtype, device=b.dev)
    k, v = (torch.randn(t, hkv, d, dtype=dtype, device=b.dev) for _ in range(2))
    qsl = [0]
    for n in qlens:
        qsl.append(qsl[-1] + n)
    req = torch.repeat_interleave(torch.arange(len(qlens)), torch.tensor(qlens)).to(b.dev)
    pos = torch.cat([torch.arange(c, c + n) for c, n in zip(ctxs, qlens)]).to(b.dev)
    slots = table[req, pos // BS].long() * BS + pos % BS
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=b.dev),
        seq_lens=torch.tensor(seq, dtype=torch.int32, device=b.dev),
        block_table=table,
        slot_mapping=slots,
        max_query_len=max(qlens),
        max_seq_len=max(seq),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq,
        num_decodes=sum(n == 1 for n in qlens),
    )
    return q, k, v, cache, meta


def bench_attention(b: Bench, case: str, qlens, ctxs, shapes, timed: list[str]) -> None:
    for name in DTYPES:
        _attention_case(b, case, name, qlens, ctxs, shapes, name in timed)


def _attention_case(b: Bench, case: str, name: str, qlens, ctxs, shapes, timed: bool) -> None:
    (hq, hkv, d), dtype = shapes, DTYPES[name]
    scale = d**-0.5
    q, k, v, cache, meta = make_batch(b, qlens, ctxs, dtype, hq, hkv, d)
    kv_store.kv_store(k, v, cache, meta.slot_mapping)

    def ours(**kw):
        return paged_attention.paged_attention(q, cache, meta, scale, **kw)

    ref = paged_attention.paged_attention_ref(q, cache, meta, scale)
    err = b.check(f"attention {case} {name}", ours(), ref, TOL[dtype])
    if meta.max_query_len == 1 and len(qlens) <= 64:  # the split path, forced
        b.check(f"attention {case} {name} split4", ours(num_splits=4), ref, TOL[dtype])
    if not timed:
        return
    kv_bytes = sum(meta.seq_lens_cpu) * hkv * d * 2 * cache.element_size()
    flops = 4 * d * hq * sum(c * n + n * (n + 1) // 2 for c, n in zip(ctxs, qlens))
    us = b.graph_us(ours)
    extra = dict(max_err=err, l2_resident=kv_bytes < L2_BYTES)
    torch_backend, triton_backend = TorchAttentionBackend(), TritonAttentionBackend()
    extra["peer_torch_backend_us"] = b.eager_us(
        lambda: torch_backend.forward(q, k, v, cache, meta, scale)
    )
    extra["backend_us"] = b.graph_us(lambda: triton_backend.forward(q, k, v, cache, meta, scale))
    sweep = case in b.args.sweep_cases
    if meta.max_query_len == 1:
        gbps = kv_bytes / us / 1e3
        extra.update(gbps=gbps, floor_gbps=COPY_GBPS, pct_of_copy=100 * gbps / COPY_GBPS)
        extra["eager_us"] = b.eager_us(ours)
        for s in b.args.split_sweep if sweep else []:
            extra[f"splits{s}_us"] = b.graph_us(lambda s=s: ours(num_splits=s))
        if sweep:
            extra.update(config_sweep(b, ours, b.args.decode_configs))
    else:
        extra.update(tflops=flops / us / 1e6, floor_tflops=MATMUL_TFLOPS)
        if all(c == 0 for c in ctxs) and len(qlens) == 1:
            extra["peer"] = sdpa_peers(b, q, k, v, scale, flops)
        if sweep:
            extra.update(config_sweep(b, ours, b.args.prefill_configs))
    b.record("paged_attention", case, name, us, **extra)


def sdpa_peers(b: Bench, q, k, v, scale: float, flops: int) -> dict:
    """Causal self-attention through scaled_dot_product_attention on contiguous [1, H, T, D]."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    group = q.shape[1] // k.shape[1]
    qh = q.transpose(0, 1)[None].contiguous()
    kh, vh = (x.repeat_interleave(group, 1).transpose(0, 1)[None].contiguous() for x in (k, v))
    peers = {}
    for name, backend in [
        ("sdpa_flash", SDPBackend.FLASH_ATTENTION),
        ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION),
    ]:
        try:
            with sdpa_kernel([backend]):
                us = b.graph_us(
                    lambda: F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
                )
        except Exception as e:  # a backend missing on this build / device
            peers[name] = f"unavailable: {type(e).__name__}"
            continue
        peers[name] = {"us": round(us, 2), "tflops": round(flops / us / 1e6, 1)}
    return peers


def config_sweep(b: Bench, ours, configs) -> dict:
    out = {}
    for bm, bn, warps, stages in configs:
        cfg = paged_attention.AttentionConfig(bm, bn, warps, stages)
        key = f"cfg_{bm}x{bn}_w{warps}_s{stages}_us"
        try:
            out[key] = b.graph_us(lambda cfg=cfg: ours(config=cfg))
        except Exception as e:  # out of shared memory etc.
            out[key] = f"failed: {type(e).__name__}"
    return out


# ---- the memory-bound kernels ----------------------------------------------------------------


def _llama3_rope(d: int, device: str):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
    return get_rope(d, d, 8192, 500000.0, scaling).to(device)


def bench_small_kernels(b: Bench, t: int, dims: dict, name: str, timed: list[str]) -> None:
    """RMSNorm (plain, fused add), SiLU-and-mul, RoPE and the KV store on ``t`` tokens."""
    hidden, inter, hq, hkv, d = (dims[k] for k in ("hidden", "inter", "hq", "hkv", "d"))
    dtype, case = DTYPES[name], f"T{t}"
    tol, dev = TOL[dtype], b.dev

    def rand(*shape):
        return torch.randn(*shape, dtype=dtype, device=dev)

    x, res = rand(t, hidden), rand(t, hidden)
    norm = RMSNorm(hidden, 1e-5).to(dev, dtype)
    norm.weight.data.normal_(1.0, 0.1)
    w = norm.weight.data
    out, new_res = rmsnorm.fused_add_rmsnorm(x, res, w, 1e-5)
    ref_out, ref_res = rmsnorm.fused_add_rmsnorm_ref(x, res, w, 1e-5)
    errs = {"fused_add_rmsnorm": b.check(f"fused_add_rmsnorm {case} {name}", out, ref_out, tol)}
    b.check(f"fused_add_rmsnorm residual {case} {name}", new_res, ref_res, 0.0)
    out = rmsnorm.rmsnorm(x, w, 1e-5)
    errs["rmsnorm"] = b.check(f"rmsnorm {case} {name}", out, norm(x), tol)
    gate_up = rand(t, 2 * inter)
    out, ref = activation.silu_and_mul(gate_up), activation.silu_and_mul_ref(gate_up)
    errs["silu_and_mul"] = b.check(f"silu_and_mul {case} {name}", out, ref, tol)
    rope = _llama3_rope(d, dev)
    qk = rand(t, (hq + hkv) * d)
    q, k = qk[:, : hq * d], qk[:, hq * d :]  # views of one tensor, as from the qkv projection
    pos = torch.randint(0, 8192, (t,), device=dev)
    ref_q, ref_k = rope(pos, q, k)  # the engine's torch layer
    rotary.rotary_embedding(pos, q, k, rope.cos_sin_cache, d)
    errs["rotary"] = b.check(f"rotary {case} {name}", qk, torch.cat([ref_q, ref_k], 1), tol)
    kk, vv = rand(t, hkv, d), rand(t, hkv, d)
    cache = rand(2, t // BS + 8, BS, hkv, d)
    slots = torch.randperm(cache.shape[1] * BS, device=dev)[:t]
    expected = cache.clone()
    kv_store.kv_store(kk, vv, cache, slots)
    write_kv_cache(expected, kk, vv, slots)
    errs["kv_store"] = b.check(f"kv_store {case} {name}", cache, expected, 0.0)
    if name not in timed:
        return
    el = x.element_size()
    cos_sin = rope.cos_sin_cache
    cases = {  # kernel: (bytes moved, ours, the engine's torch path)
        "fused_add_rmsnorm": (4 * t * hidden * el,
                              lambda: rmsnorm.fused_add_rmsnorm(x, res, w, 1e-5),
                              lambda: norm(x, res)),
        "rmsnorm": (2 * t * hidden * el, lambda: rmsnorm.rmsnorm(x, w, 1e-5), lambda: norm(x)),
        "silu_and_mul": (3 * t * inter * el, lambda: activation.silu_and_mul(gate_up),
                         lambda: SiluAndMul()(gate_up)),
        "rotary": (2 * qk.numel() * el, lambda: rotary.rotary_embedding(pos, q, k, cos_sin, d),
                   lambda: rope(pos, q, k)),
        "kv_store": (4 * kk.numel() * el, lambda: kv_store.kv_store(kk, vv, cache, slots),
                     lambda: write_kv_cache(cache, kk, vv, slots)),
    }  # fmt: skip
    for kernel, (nbytes, ours, peer) in cases.items():
        us = b.graph_us(ours)
        gbps = nbytes / us / 1e3
        b.record(kernel, case, name, us, max_err=errs[kernel], gbps=gbps, floor_gbps=COPY_GBPS,
                 pct_of_copy=100 * gbps / COPY_GBPS, peer_torch_us=b.eager_us(peer),
                 l2_resident=nbytes < L2_BYTES)  # fmt: skip


# ---- driver ----------------------------------------------------------------------------------


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="JSON file for the results")
    p.add_argument("--dtypes", default="bf16,fp16", help="checked dtypes, comma-separated")
    p.add_argument("--time-dtypes", default="bf16", help="timed dtypes, comma-separated")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, to test this script")
    p.add_argument("--no-sweep", action="store_true", help="skip the split and tile sweeps")
    args = p.parse_args()
    timed = args.time_dtypes.split(",")
    for name in list(DTYPES):
        if name not in args.dtypes.split(","):
            del DTYPES[name]
    args.split_sweep = [1, 2, 4, 8, 16, 32]
    args.decode_configs = [(16, 32, 4, 4), (16, 64, 4, 4), (16, 128, 4, 3), (16, 128, 8, 3)]
    args.prefill_configs = [(128, 64, 8, 3), (128, 128, 8, 3), (128, 32, 4, 4), (64, 64, 4, 3),
                            (128, 64, 4, 3), (64, 128, 8, 3)]  # fmt: skip
    args.sweep_cases = set() if args.no_sweep else {
        "decode_b1_ctx8192", "decode_b32_ctx2048", "decode_b128_ctx1024", "decode_b64_ctx8192",
        "prefill_t4096_ctx0", "prefill_t1024_ctx4096", "decode_b2_ctx40", "prefill_t19_ctx0",
    }  # fmt: skip
    b = Bench(args)
    torch.manual_seed(0)
    if args.smoke:
        shapes, dims = (4, 2, 32), dict(hidden=96, inter=80, hq=4, hkv=2, d=32)
        decode = [(2, 40)]
        prefill = [([19], [0]), ([9], [21]), ([1, 1, 5], [30, 7, 12])]
        tokens = [3]
        args.sweep_cases &= {"decode_b2_ctx40", "prefill_t19_ctx0"}
    else:
        shapes, dims = (32, 8, 128), dict(hidden=4096, inter=14336, hq=32, hkv=8, d=128)
        decode = [(n, ctx) for n in (1, 8, 32, 64, 128, 256) for ctx in (128, 1024, 8192)]
        decode += [(32, 2048)]
        prefill = [([t], [c]) for t in (128, 512, 1024, 2048, 4096) for c in (0, 4096)]
        prefill += [([512] * 8, [0] * 8), ([1] * 64 + [512], [2048] * 64 + [1024])]
        tokens = [1, 256, 4096]
    for n, ctx in decode:
        bench_attention(b, f"decode_b{n}_ctx{ctx}", [1] * n, [ctx - 1] * n, shapes, timed)
    for qlens, ctxs in prefill:
        kind = "mixed" if any(n == 1 for n in qlens) else "prefill"
        case = f"{kind}_r{len(qlens)}_t{sum(qlens)}"
        if len(qlens) == 1:
            case = f"prefill_t{qlens[0]}_ctx{ctxs[0]}"
        bench_attention(b, case, qlens, ctxs, shapes, timed)
    for name in DTYPES:
        for t in tokens:
            bench_small_kernels(b, t, dims, name, timed)
    write_json(args.out, b.rows)
    print_table(b)
    if b.failures:
        print(f"{len(b.failures)} correctness failures:\n  " + "\n  ".join(b.failures))
        return 1
    print("all correctness checks passed")
    return 0


def print_table(b: Bench) -> None:
    head = ("kernel", "case", "dtype", "ours us", "torch us", "sdpa us", "rate", "max err")
    fmt = "{:<18} {:<22} {:<5} {:>9} {:>9} {:>9} {:>16} {:>8}"
    print("\n" + fmt.format(*head))
    for r in b.rows:
        torch_us = r.get("peer_torch_us", r.get("peer_torch_backend_us", ""))
        flash = (r.get("peer") or {}).get("sdpa_flash")
        flash_us = flash["us"] if isinstance(flash, dict) else ""
        rate = f"{r['gbps']:.0f} GB/s" if "gbps" in r else ""
        rate = f"{r['tflops']:.0f} TF/s" if "tflops" in r else rate
        rate += f" {r['pct_of_copy']:.0f}%" if "pct_of_copy" in r else ""
        cells = (r["kernel"], r["case"], r["dtype"], r["value"], torch_us, flash_us, rate)
        print(fmt.format(*(str(c) for c in cells), f"{r.get('max_err', 0):.2g}"))


if __name__ == "__main__":
    sys.exit(main())
