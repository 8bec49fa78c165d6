"""The W4A16 kernels compiled for sm_90 on a machine without a GPU (Triton's bundled ptxas and
cuobjdump): registers, stack and the main loop's SASS per tile, the instructions a weight
a thread (the GEMV: times rows of x), and the shared-memory traffic (LDS, STS, BAR) in the loop.

    python -m benchmarks.kernels.w4a16_sass [--tiles 4,2048,4,1 16,256,1,1] [--rows 1]
    python -m benchmarks.kernels.w4a16_sass --kernel skinny [--tiles 32,128,4,2,3]

GEMV tiles are (BLOCK_N, BLOCK_K, warps, stages); skinny tiles (kernels/w4a16_skinny.py, 16
rows of x, its planes in inline PTX) are (BLOCK_N, BLOCK_K, SPLIT_K, warps, stages). Group 128
(the skinny kernel's BLOCK_K 256: group 256), bf16.
"""

from __future__ import annotations

import argparse
import collections
import inspect
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget

from lightwell.kernels import w4a16_gemv as gv
from lightwell.kernels import w4a16_skinny as sk

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
SHOWN = ("LDG", "LDS", "STS", "BAR", "SHFL", "FFMA", "FADD", "FMUL", "LOP3", "SHF", "PRMT", "IMAD",
         "HADD2", "HGMMA")  # fmt: skip
TYPES = dict(x_ptr="*bf16", q_ptr="*i32", s_ptr="*bf16", z_ptr="*bf16", g_ptr="*i32",
             b_ptr="*bf16", out_ptr="*bf16", part_ptr="*fp32", cnt_ptr="*i32")  # fmt: skip
DEFAULT_TILES = {"gemv": ["4,2048,4,1", "4,2048,2,1", "16,256,1,1"],
                 "skinny": ["32,128,4,2,3", "32,128,1,1,3", "64,128,2,1,3"]}  # fmt: skip


def compile_sm90(fn, types: dict, consts: dict, warps: int, stages: int, divisible=(), **options):
    """Kernel ``fn`` compiled for sm_90 without a GPU: pointer ``types`` by argument name (the
    other arguments i32), constexprs ``consts``, the arguments named in ``divisible`` marked
    divisible by 16, Triton ``options`` beside the warps and stages."""
    names = list(inspect.signature(fn.fn).parameters)
    sig = {n: types.get(n, "i32") for n in names if n not in consts}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in divisible}
    sig.update(dict.fromkeys(consts, "constexpr"))
    src = triton.compiler.ASTSource(fn=fn, constexprs=consts, attrs=attrs, signature=sig)
    options = dict(num_warps=warps, num_stages=stages, **options)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def compile_sass(
    fn, consts: dict, warps: int, stages: int, types: dict = TYPES, **options
) -> tuple[str, str]:
    """(SASS, resource usage) of kernel ``fn`` with its constexprs ``consts`` (every other
    argument but M and ONE divisible by 16)."""
    names = [n for n in inspect.signature(fn.fn).parameters if n not in consts]
    divisible = [n for n in names if n not in ("M", "ONE")]
    kernel = compile_sm90(fn, types, consts, warps, stages, divisible, enable_fp_fusion=True,
                          **options)  # fmt: skip
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        dump = [os.path.join(BIN, "cuobjdump"), f.name]
        sass = subprocess.run([dump[0], "-sass", dump[1]], capture_output=True, text=True)
        res = subprocess.run([dump[0], "-res-usage", dump[1]], capture_output=True, text=True)
    return sass.stdout, res.stdout


def gemv_sass(tile: tuple[int, ...], rows: int) -> tuple[str, str, int]:
    """(SASS, resource usage, weights a thread an iteration times rows) of the GEMV."""
    bn, bk, warps, stages = tile
    consts = dict(BLOCK_M=triton.next_power_of_2(rows), BLOCK_N=bn, BLOCK_K=bk, TG=min(bk, 128),
                  GROUP_SIZE=128, EVEN_K=True, HAS_BIAS=False, GDC=True)  # fmt: skip
    sass, res = compile_sass(gv._w4a16_gemv_kernel, consts, warps, stages, launch_pdl=True)
    return sass, res, bn * bk * rows // (32 * warps)


def skinny_sass(tile: tuple[int, ...]) -> tuple[str, str, int]:
    """(SASS, resource usage, weights a thread an iteration) of the skinny kernel."""
    bn, bk, split, warps, stages = tile
    consts = dict(BLOCK_M=sk.MAX_M, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split,
                  GROUP_SIZE=max(bk, 128), HAS_BIAS=False, ASM=True,
                  PRECISION="tf32", FENCE=True)  # fmt: skip
    types = dict(TYPES, q_ptr="*i16")  # the 16-bit words
    sass, res = compile_sass(sk._w4a16_skinny_kernel, consts, warps, stages, types)
    return sass, res, bn * bk // (32 * warps)


def loop_ops(sass: str) -> collections.Counter:
    """The opcodes of the longest backward branch's body (the K loop)."""
    ins = [(int(a, 16), t) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    jumps = [(a, re.search(r"BRA\s+0x([0-9a-f]+)", t)) for a, t in ins]
    loops = [(int(m[1], 16), a) for a, m in jumps if m and int(m[1], 16) < a]
    start, end = max(loops, key=lambda se: se[1] - se[0], default=(0, -1))
    body = [t for a, t in ins if start <= a <= end]
    return collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0]
                               for t in body)  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernel", choices=("gemv", "skinny"), default="gemv")
    ap.add_argument("--tiles", nargs="+", default=None, help="default: three of the kernel's")
    ap.add_argument("--rows", type=int, default=1, help="rows of x (the GEMV)")
    args = ap.parse_args()
    print(f"{'tile':16} regs stack loop a-weight " + " ".join(SHOWN))
    for text in args.tiles or DEFAULT_TILES[args.kernel]:
        tile = tuple(int(v) for v in text.split(","))
        if args.kernel == "gemv":
            sass, res, weights = gemv_sass(tile, args.rows)
        else:
            sass, res, weights = skinny_sass(tile)
        ops = loop_ops(sass)
        regs, stack = re.search(r"REG:(\d+)", res)[1], re.search(r"STACK:(\d+)", res)[1]
        print(f"{text:16} {regs:>4} {stack:>5} {sum(ops.values()):4} "
              f"{sum(ops.values()) / weights:8.2f} "
              + " ".join(f"{ops.get(o, 0):>{len(o)}}" for o in SHOWN))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
