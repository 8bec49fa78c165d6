"""What bounds the one-row W4A16 GEMV (lightwell/kernels/w4a16_gemv.py) at llama-3-8b's TP=1
shapes: the GEMV beside two kernels that read the same bytes with no arithmetic, one in the
GEMV's own pattern (its grid, tiles and loads of words, scales and zeros, XOR-folded) and one as
a plain streaming read of the packed words; cuBLAS bf16 on the weight of the same shape beside
them. Timing as benchmarks/kernels/w4a16.py's (a CUDA graph over weight copies that do not fit
in L2). The read-only kernels' best tile of a few is reported.

    run(command="python3 -m benchmarks.kernels.w4a16_ceiling --out $OUT/w4a16_ceiling.json")
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from benchmarks.kernels.timing import graph_replay_us
from benchmarks.kernels.w4a16 import GROUP, SHAPES, cublas_us, rel_err, w4_bytes, weight_copies
from lightwell.bench.results import record, write_json
from lightwell.kernels.w4a16 import _group_scales, _load_words, slice_size, w4a16_matmul_ref
from lightwell.kernels.w4a16_gemv import pick_config, w4a16_gemv

# (BLOCK_N, BLOCK_K, warps) of the GEMV-pattern reads; the stream's (BLOCK, ITERS, warps)
LOAD_TILES = [(4, 2048, 2), (4, 2048, 4), (8, 1024, 4), (16, 256, 1), (16, 512, 2)]
STREAM_TILES = [(1024, 8, 4), (2048, 4, 8), (4096, 2, 8)]


@triton.jit
def _gemv_pattern_read(
    q_ptr, s_ptr, z_ptr, out_ptr, N, K, stride_qn, stride_sn,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TG: tl.constexpr, GROUP_SIZE: tl.constexpr,
):  # fmt: skip
    """The GEMV's loads (K a multiple of BLOCK_K), each row's words XOR-folded and its scales and
    zeros summed, so no load is dropped."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    wn = tl.minimum(rn, N - 1).to(tl.int64)
    q_rows = q_ptr + wn[:, None, None] * stride_qn
    s_rows = s_ptr + wn[:, None] * stride_sn
    z_rows = z_ptr + wn[:, None] * stride_sn
    acc = tl.zeros([BLOCK_N, BLOCK_K // TG, TG // 8], dtype=tl.int32)
    acc_f = tl.zeros([BLOCK_N, BLOCK_K // TG], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        acc ^= _load_words(q_rows, k0, K, BLOCK_K, TG, True)
        s, z = _group_scales(s_rows, z_rows, k0, K, BLOCK_K, TG, GROUP_SIZE, True)
        acc_f += s + z
    folded = tl.sum(tl.sum(acc, axis=2), axis=1).to(tl.float32) + tl.sum(acc_f, axis=1)
    tl.store(out_ptr + rn, folded, mask=rn < N)


@triton.jit
def _stream_read(q_ptr, out_ptr, num_words, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """ITERS contiguous blocks of words a program, XOR-folded."""
    base = tl.program_id(0) * BLOCK * ITERS
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for i in range(ITERS):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        acc ^= tl.load(q_ptr + offs, mask=offs < num_words, other=0)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, axis=0))


def gemv_pattern_read(w: tuple, out: torch.Tensor, tile: tuple[int, int, int]) -> None:
    qweight, scales, zeros, _ = w
    n, k = qweight.shape[0], qweight.shape[1] * 8
    block_n, block_k, warps = tile
    block_k, tg = slice_size(block_k, GROUP, k)
    _gemv_pattern_read[(triton.cdiv(n, block_n),)](
        qweight, scales, zeros, out, n, k, qweight.stride(0), scales.stride(0),
        BLOCK_N=block_n, BLOCK_K=block_k, TG=tg, GROUP_SIZE=GROUP, num_warps=warps,
    )  # fmt: skip


def stream_read(w: tuple, out: torch.Tensor, tile: tuple[int, int, int]) -> None:
    block, iters, warps = tile
    words = w[0].numel()
    _stream_read[(triton.cdiv(words, block * iters),)](
        w[0], out, words, BLOCK=block, ITERS=iters, num_warps=warps
    )


def measure(name: str, dev: torch.device) -> list[dict]:
    n, k = SHAPES[name]
    weights = weight_copies(n, k, False, dev)
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    err = rel_err(w4a16_gemv(x, *weights[0], group_size=GROUP), w4a16_matmul_ref(x, *weights[0]))
    if err > 2e-2:
        raise AssertionError(f"{name}: relative error {err:.3g} against the reference")
    base = dict(shape=name, n=n, k=k, m=1, group=GROUP, w4_bytes=w4_bytes(n, k))
    gemv = graph_replay_us(
        lambda: [w4a16_gemv(x, *w, group_size=GROUP) for w in weights], calls=len(weights)
    )
    rows = [record("w4a16_gemv_us", gemv, config=list(pick_config(n, k, 1)), rel_err=err, **base)]
    out = torch.empty(n, device=dev, dtype=torch.float32)
    programs = triton.cdiv(n * k // 8, min(block * iters for block, iters, _ in STREAM_TILES))
    grid_out = torch.empty(programs, device=dev, dtype=torch.int32)
    for metric, fn, tiles, buf in (
        ("gemv_pattern_read_us", gemv_pattern_read, LOAD_TILES, out),
        ("stream_read_us", stream_read, STREAM_TILES, grid_out),
    ):
        times = {
            t: graph_replay_us(
                lambda t=t, fn=fn, buf=buf: [fn(w, buf, t) for w in weights], calls=len(weights)
            )
            for t in tiles
        }
        best = min(times, key=times.get)
        rows.append(record(metric, times[best], config=list(best),
                           tiles={str(list(t)): round(v, 2) for t, v in times.items()},
                           **base))  # fmt: skip
    rows.append(record("cublas_bf16_us", cublas_us(x, n, k, dev), **base))
    for r in rows:
        print(f"{name:12} {r['metric']:22} {r['value']:7.2f} us "
              f"{base['w4_bytes'] / r['value'] / 1e6:5.2f} TB/s (of the 4-bit bytes)",
              flush=True)  # fmt: skip
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write the rows as a JSON results file")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    torch.manual_seed(0)
    dev = torch.device("cuda", 0)
    rows = [r for name in SHAPES if name.startswith("tp1") for r in measure(name, dev)]
    for metric in ("w4a16_gemv_us", "gemv_pattern_read_us", "stream_read_us"):
        total = sum(r["value"] for r in rows if r["metric"] == metric)
        print(f"a layer's four linears, {metric}: {total:.1f} us (x 32 layers: "
              f"{32 * total / 1e3:.2f} ms)", flush=True)  # fmt: skip
    if args.out:
        write_json(args.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
