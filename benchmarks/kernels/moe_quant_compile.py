"""The fused MoE kernels over quantized experts compiled for sm_90 on a machine without a GPU
(Triton's bundled ptxas, as benchmarks/kernels/w4a16_sass.py): every variant the engine can
launch (grouped bf16 / fp8 / int4; GEMV fp8 / int4 at the decode tiles, even and masked K,
group 128 and per channel) at DeepSeek-V3 and Mixtral shapes, each line naming its cubin size or
the compile error. A check before spending GPU time, ~1 min on a CPU:

    python -m benchmarks.kernels.moe_quant_compile
"""

from __future__ import annotations

from benchmarks.kernels.w4a16_sass import compile_sm90
from lightwell.kernels import fused_moe as fm
from lightwell.kernels import moe_gemv_quant as gq

# quant: (weight pointer, scale pointer, (SBN, SBK))
QUANTS = {
    "bf16": ("*bf16", "*bf16", (1, 64)),
    "fp8": ("*fp8e4nv", "*fp32", (128, 128)),
    "int4": ("*i32", "*bf16", (1, 128)),
    "int4-channel": ("*i32", "*bf16", (1, 14336)),
    "fp8-rows": ("*fp8e4nv", "*fp32", (1, 0)),  # one scale a row, weight-only
    "fp8-rows-w8a8": ("*fp8e4nv", "*fp32", (1, 0)),  # one scale a row, fp8 activations
    "fp8-w8a8": ("*fp8e4nv", "*fp32", (128, 128)),  # block scales, fp8 activations
}
GEMV_TILES = ((1, 2048, 4, 3), (2, 256, 1, 3), (4, 512, 1, 1), (2, 2048, 2, 3))


def compile_kernel(fn, types: dict, consts: dict, warps: int = 4, stages: int = 3) -> int:
    return len(compile_sm90(fn, types, consts, warps, stages).asm["cubin"])


def variants():
    """(label, kernel, pointer types, constexprs, warps, stages) of every variant."""
    for quant, (w_t, s_t, (sbn, sbk)) in QUANTS.items():
        types = dict(x_ptr="*bf16", a_ptr="*bf16", w_ptr=w_t, out_ptr="*bf16", s_ptr=s_t,
                     z_ptr=s_t, sorted_ptr="*i32", expert_ptr="*i32", ids_ptr="*i64",
                     weight_ptr="*fp32", xs_ptr="*fp32", as_ptr="*fp32")  # fmt: skip
        int4, w8a8 = quant.startswith("int4"), quant.endswith("w8a8")
        grouped = dict(HIDDEN=7168, INTER=2048, BLOCK_M=64, BLOCK_N=64, BLOCK_K=64,
                       SCALED=quant != "bf16", SBN=sbn, SBK=sbk, INT4=int4, A_SCALED=w8a8,
                       GROUP_M=fm.GROUP_M)  # fmt: skip
        gate_up, down = {**grouped, "TOP_K": 8}, grouped
        if sbk == 0:  # the row scales span all of K (fused_moe._grouped)
            gate_up, down = {**gate_up, "SBK": 7168}, {**down, "SBK": 2048}
        tiles = [(64, 64, 64, 4, 3)]
        if w8a8:  # fp8 x and activation, at every tile fused_moe.w8a8_tiles picks
            types = {**types, "x_ptr": "*fp8e4nv", "a_ptr": "*fp8e4nv"}
            keys = ("block_m", "block_n", "block_k", "num_warps", "num_stages")
            quant_args = {"w8a8": True, "scales": (None, None, (sbn, sbk))}
            tiles = [tuple(v[k] for k in keys) for v in fm.grouped_variants(quant_args, None)]
        for bm, bn, bk, warps, stages in tiles:
            tile = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
            name = f"{quant} grouped" + (f" {bm},{bn},{bk},{warps},{stages}" if w8a8 else "")
            yield f"{name} gate_up", fm._gate_up_kernel, types, {**gate_up, **tile}, warps, stages
            yield f"{name} down", fm._down_kernel, types, {**down, **tile}, warps, stages
        if quant == "bf16" or w8a8:
            continue
        for bn, bk, warps, stages in GEMV_TILES:
            for even in (True, False):
                tile = f"{bn},{bk},{warps},{stages} even={even}"
                # (row scales: a block of all of K, H for gate/up, I for down: moe_gemv_quant)
                for kernel, k_sbk in (("gate_up", sbk or 7168), ("down", sbk or 2048)):
                    ts = min(bk & -bk, k_sbk & -k_sbk)
                    consts = dict(BLOCK_N=bn, TS=ts, NS=bk // ts, SBN=sbn, SBK=k_sbk,
                                  EVEN_K=even, INT4=int4)  # fmt: skip
                    fn = gq._quant_gemv_gate_up if kernel == "gate_up" else gq._quant_gemv_down
                    yield f"{quant} gemv {kernel} {tile}", fn, types, consts, warps, stages


def main() -> int:
    failed = 0
    for label, fn, types, consts, warps, stages in variants():
        try:
            print(f"{label}: ok, cubin {compile_kernel(fn, types, consts, warps, stages)} B")
        except Exception as e:  # noqa: BLE001 - every variant is reported
            failed += 1
            print(f"{label}: FAILED {str(e)[-400:]}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
