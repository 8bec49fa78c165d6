"""The W4A16 GEMV compiled for sm_90 on a machine without a GPU (Triton's bundled ptxas and
cuobjdump): registers, stack and the main loop's SASS per tile, the instructions a weight
(times rows of x) a thread, and the shared-memory traffic (LDS, STS, BAR) in the loop.

    python -m benchmarks.kernels.w4a16_sass [--tiles 4,2048,4,1 16,256,1,1] [--rows 1]
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

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
SHOWN = ("LDG", "LDS", "STS", "BAR", "SHFL", "FFMA", "FADD", "FMUL", "LOP3", "SHF", "PRMT", "IMAD")


def compile_sass(tile: tuple[int, ...], rows: int) -> tuple[str, str]:
    """(SASS, resource usage) of the GEMV at (BLOCK_N, BLOCK_K, warps, stages), group 128, bf16."""
    bn, bk, warps, stages = tile
    consts = dict(BLOCK_M=triton.next_power_of_2(rows), BLOCK_N=bn, BLOCK_K=bk, TG=min(bk, 128),
                  GROUP_SIZE=128, EVEN_K=True, HAS_BIAS=False, GDC=True)  # fmt: skip
    names = list(inspect.signature(gv._w4a16_gemv_kernel.fn).parameters)
    types = dict(x_ptr="*bf16", q_ptr="*i32", s_ptr="*bf16", z_ptr="*bf16", g_ptr="*i32",
                 b_ptr="*bf16", out_ptr="*bf16")  # fmt: skip
    sig = {n: types.get(n, "i32") for n in names if n not in consts}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if n in sig and n not in ("M", "ONE")}  # fmt: skip
    src = triton.compiler.ASTSource(
        fn=gv._w4a16_gemv_kernel,
        constexprs=consts,
        attrs=attrs,
        signature=dict(sig, **{k: "constexpr" for k in consts}),
    )
    options = dict(num_warps=warps, num_stages=stages, enable_fp_fusion=True, launch_pdl=True)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        dump = [os.path.join(BIN, "cuobjdump"), f.name]
        sass = subprocess.run([dump[0], "-sass", dump[1]], capture_output=True, text=True)
        res = subprocess.run([dump[0], "-res-usage", dump[1]], capture_output=True, text=True)
    return sass.stdout, res.stdout


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
    ap.add_argument("--tiles", nargs="+", default=["4,2048,4,1", "4,2048,2,1", "16,256,1,1"])
    ap.add_argument("--rows", type=int, default=1)
    args = ap.parse_args()
    print(f"{'tile':16} regs stack loop a-weight " + " ".join(SHOWN))
    for text in args.tiles:
        tile = tuple(int(v) for v in text.split(","))
        sass, res = compile_sass(tile, args.rows)
        ops = loop_ops(sass)
        regs, stack = re.search(r"REG:(\d+)", res)[1], re.search(r"STACK:(\d+)", res)[1]
        per = sum(ops.values()) * 32 * tile[2] / (tile[0] * tile[1] * args.rows)
        print(f"{text:16} {regs:>4} {stack:>5} {sum(ops.values()):4} {per:8.2f} "
              + " ".join(f"{ops.get(o, 0):>{len(o)}}" for o in SHOWN))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
