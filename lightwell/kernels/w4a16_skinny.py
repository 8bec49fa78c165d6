"""W4A16 matmul for a few rows of x (decode batches, 1-16 rows): ``_w4a16_skinny_kernel``, over
kernels/w4a16.py's layout (its module docstring describes it), read as 16-bit words.

The kernel sees ``qweight`` [N, K / 8] int32 as [N, K / 4] int16: 16-bit word ``h`` of a row holds
inputs ``4h .. 4h + 3``, value ``j`` at bits ``4j`` (the low half of each 32-bit word holds its
values 0-3, the high half 4-7). Each program owns BLOCK_N output columns (and, split over K, a
share of the K tiles) and walks K in tiles that lie inside one group, so a tile's scale and zero
point are one value per column: the tile adds ``scale[n] * P`` with ``P = sum_k x[m, k] * (q[n, k]
- zero[n])``. P is four tensor-core dots, one per value position j: plane j of the words (their
j-th nibbles minus the zero point, small integers in the activation dtype: exact) as the dot's
first operand against x's inputs ``4h + j``.

The dot holds its first operand in registers, two neighbouring 16-bit words of a row in each
32-bit register, so plane j of both comes out of one register in three instructions of inline
PTX (``asm_planes``: fp16 x on an NVIDIA GPU, bf16 x on sm_90+): a shift by 4j, one
three-input logic op that keeps the two nibbles and ORs in the exponent of 128 (bf16) or 1024
(fp16), whose mantissa step is 1, and one packed subtract of the zero point plus that offset
(exact). The offset's bits are those of the zero point plus the offset with the low seven
mantissa bits cleared (zero points are integers 0-16), so no constant waits in a register.
Otherwise (fp32 x, bf16 x before sm_90, Triton's interpreter with fp32 or fp16 x) the planes
come from the same words through plain integer and float operations (fp32: the nibble in the
mantissa of 2^23). Rows of x past M are masked: zeros, never read (no load carries many copies
of one address), and not stored.

Split over K (``SPLIT_K`` > 1: the narrow weights, whose columns alone give too few programs),
each program stores its fp32 partial sums and counts itself in a per-column-tile counter; the
last one of a tile adds the partials, writes the output and resets the counter to zero, so the
counters (one zeroed buffer per device, kernels/split_counters.py) are ready for the next call
and CUDA graphs.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from lightwell import envs
from lightwell.kernels.split_counters import last_to_arrive, split_counters

MAX_M = 16

# (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages)
Config = tuple[int, int, int, int, int]


@triton.constexpr_function
def plane_ptx(j, bf16):
    """The inline PTX of plane ``j`` for one register of two 16-bit words ($1) and two zero
    points plus the offset ($2) in bf16 (``bf16``) or fp16: the two words' nibbles j as
    (offset + q) floats, minus $2, into $0 (module docstring). Callable from host code too."""
    take = f"shr.b32 t, $1, {4 * j}; " if j else "mov.b32 t, $1; "
    sub = "sub.rn.bf16x2" if bf16 else "sub.rn.f16x2"
    return (
        "{ .reg .b32 t, e; and.b32 e, $2, 0xFF80FF80; " + take
        + f"lop3.b32 $0, t, 0x000F000F, e, 0xEA; {sub} $0, $0, $2; }}"
    )  # fmt: skip


@triton.jit
def _plane_asm(h, zo, J: tl.constexpr):
    """Plane J of the 16-bit words h minus zo (module docstring), in inline PTX."""
    code: tl.constexpr = plane_ptx(J, zo.dtype == tl.bfloat16)
    zb = tl.broadcast_to(zo, h.shape)
    return tl.inline_asm_elementwise(code, "=r,r,r", [h, zb], dtype=zo.dtype, is_pure=True,
                                     pack=2)  # fmt: skip


@triton.jit
def _plane(h, J: tl.constexpr, zo, ASM: tl.constexpr):
    """Value J of each 16-bit word of h [BN, TW] minus its column's zero point, exact in zo's
    dtype (zo: [BN, 1], the zero points plus ``_offset``)."""
    if ASM:
        r = _plane_asm(h, zo, J)
    else:
        v = (h.to(tl.int32) >> (4 * J)) & 0xF
        if zo.dtype == tl.float32:
            r = (v | 0x4B000000).to(tl.float32, bitcast=True) - zo
        elif zo.dtype == tl.bfloat16:
            r = (v | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True) - zo
        else:
            r = (v | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - zo
    return r


@triton.jit
def _offset(dtype: tl.constexpr):
    """What ``_plane``'s float reads for a nibble of 0 in ``dtype``: the float whose mantissa
    step is 1 (bits 0x4300, 0x6400, 0x4B000000)."""
    if dtype == tl.bfloat16:
        return 128.0
    if dtype == tl.float16:
        return 1024.0
    return 8388608.0


@triton.jit
def _x_planes(x_rows, x_mask, k0, BLOCK_K: tl.constexpr):
    """x[:, k0 : k0 + BLOCK_K] as its four [BM, BLOCK_K / 4] planes (plane j: inputs 4h + j),
    from one contiguous load split in registers (rows where x_mask [BM, 1] is false: zeros)."""
    x = tl.load(x_rows + (k0 + tl.arange(0, BLOCK_K))[None, :], mask=x_mask, other=0.0)
    c0, c1 = tl.split(tl.reshape(x, [x.shape[0], BLOCK_K // 4, 2, 2]))
    x0, x2 = tl.split(c0)
    x1, x3 = tl.split(c1)
    return x0, x1, x2, x3


@triton.jit
def _tile_sums(x_rows, x_mask, q_rows, zo, k0, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
               ASM: tl.constexpr):  # fmt: skip
    """P of the K tile at k0 as [BN, BM]: (q - zero) @ x.T. x_rows [BM, 1], q_rows [BN, 1]: row
    pointers (q_rows into the 16-bit words), x_mask [BM, 1]: the rows of x there are; zo [BN, 1]:
    the zero points plus ``_offset`` in x's dtype."""
    h = tl.load(q_rows + (k0 // 4 + tl.arange(0, BLOCK_K // 4))[None, :])  # [BN, BK / 4]
    x0, x1, x2, x3 = _x_planes(x_rows, x_mask, k0, BLOCK_K)
    p = tl.dot(_plane(h, 0, zo, ASM), tl.trans(x0), input_precision=PRECISION)
    p = tl.dot(_plane(h, 1, zo, ASM), tl.trans(x1), p, input_precision=PRECISION)
    p = tl.dot(_plane(h, 2, zo, ASM), tl.trans(x2), p, input_precision=PRECISION)
    return tl.dot(_plane(h, 3, zo, ASM), tl.trans(x3), p, input_precision=PRECISION)


@triton.jit(do_not_specialize=["M"])
def _w4a16_skinny_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, b_ptr, out_ptr, part_ptr, cnt_ptr, M, N, K,
    stride_xm, stride_qn, stride_sn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    GROUP_SIZE: tl.constexpr,  # inputs a group, a multiple of BLOCK_K (K: one group a column)
    HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
    ASM: tl.constexpr,  # the planes in inline PTX (asm_planes)
    FENCE: tl.constexpr,  # compiled for a GPU: split_counters.last_to_arrive's fence
):  # fmt: skip
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    wn = tl.minimum(rn, N - 1).to(tl.int64)  # past N: re-read the last column, store nothing
    rm = tl.arange(0, BLOCK_M)
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_xm  # [BM, 1]
    x_mask = rm[:, None] < M  # rows past M: zeros, no memory read
    q_rows = q_ptr + wn[:, None] * stride_qn  # [BN, 1], 16-bit words
    tiles = K // BLOCK_K
    per = tl.cdiv(tiles, SPLIT_K)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for t in range(pid_k * per, tl.minimum(tiles, pid_k * per + per)):
        k0 = t * BLOCK_K
        g = k0 // GROUP_SIZE
        sc = tl.load(s_ptr + wn * stride_sn + g).to(tl.float32)
        zp = tl.load(z_ptr + wn * stride_sn + g).to(tl.float32) + _offset(x_ptr.dtype.element_ty)
        zo = zp.to(x_ptr.dtype.element_ty)[:, None]  # exact: integer zero points
        acc += _tile_sums(x_rows, x_mask, q_rows, zo, k0, BLOCK_K, PRECISION, ASM) * sc[:, None]
    acc = tl.trans(acc)  # [BM, BN]
    omask = (rm[:, None] < M) & (rn[None, :] < N)
    if SPLIT_K > 1:
        tile = rm[:, None] * N + rn[None, :]  # [BM, BN] in one split's [BLOCK_M, N] partials
        tl.store(part_ptr + pid_k * BLOCK_M * N + tile, acc, mask=omask)
        if last_to_arrive(cnt_ptr + pid_n, SPLIT_K, rn, FENCE):
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in range(SPLIT_K):
                acc += tl.load(part_ptr + s * BLOCK_M * N + tile, mask=omask, other=0.0,
                               cache_modifier=".cg")  # fmt: skip
            tl.atomic_xchg(cnt_ptr + pid_n, 0)
            _store(out_ptr, acc, b_ptr, rm, rn, wn, omask, stride_om, HAS_BIAS)
    else:
        _store(out_ptr, acc, b_ptr, rm, rn, wn, omask, stride_om, HAS_BIAS)


@triton.jit
def _store(out_ptr, acc, b_ptr, rm, rn, wn, omask, stride_om, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(b_ptr + wn).to(tl.float32)[None, :]
    out = out_ptr + rm[:, None] * stride_om + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=omask)


def supports(m: int, k: int, group_size: int) -> bool:
    """Whether the kernel takes this call: 1..MAX_M rows, contiguous groups (or one group a
    column) that a 128-input tile divides."""
    return (
        1 <= m <= MAX_M
        and k % 128 == 0
        and group_size > 0
        and (group_size % 128 == 0 or group_size >= k)
    )


def pick_config(n: int, k: int, m: int) -> Config:
    """The tile for an [N, K] weight and M rows (the same at every M), from an H200 sweep
    (``benchmarks/kernels/w4a16.py --skinny-sweep``: BLOCK_N 16-256, SPLIT_K 1-16, 1-8 warps,
    3-4 stages) at llama-3-8b's TP=1 and TP=2 shapes, 4 and 16 rows: 32 columns a program on two
    warps, K split in 4 (in 8 where K is long, > 4,096, or N narrow, < 4,096); wide weights
    (gate_up) 64 columns, unsplit with four stages at N >= 16,384, K split in 2 at N >= 8,192."""
    if n >= 16384:
        return 64, 128, 1, 2, 4
    if n >= 8192:
        return 64, 128, 2, 2, 3
    return 32, 128, 8 if k > 4096 or n < 4096 else 4, 2, 3


def use_asm(dtype: torch.dtype, capability: tuple[int, int], hip: bool = False) -> bool:
    """Whether the planes take the inline PTX for x of ``dtype`` on a GPU of compute
    ``capability``: NVIDIA only, fp16 x, or bf16 x from sm_90 (``sub.bf16x2``)."""
    if hip:
        return False
    return dtype == torch.float16 or (dtype == torch.bfloat16 and capability >= (9, 0))


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def asm_planes(x: torch.Tensor) -> bool:
    """``use_asm`` for x's dtype and GPU (never on the CPU, where Triton is its interpreter)."""
    if x.device.type != "cuda" or envs.triton_interpret():
        return False
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    return use_asm(x.dtype, _capability(index), torch.version.hip is not None)


def w4a16_skinny(
    x: torch.Tensor,  # [M, K], 1 <= M <= MAX_M
    qweight: torch.Tensor,  # [N, K / 8] int32
    scales: torch.Tensor,  # [N, G]
    zeros: torch.Tensor,  # [N, G]
    bias: torch.Tensor | None = None,  # [N]
    group_size: int = 128,
    config: Config | None = None,
) -> torch.Tensor:  # [M, N] in x.dtype
    """``x @ W.T (+ bias)`` for a few rows (``supports``), on the tensor cores. ``config``:
    (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages), default ``pick_config``."""
    m, k = x.shape
    n = qweight.shape[0]
    if not supports(m, k, group_size):
        raise ValueError(f"w4a16_skinny: M={m}, K={k}, group {group_size} not supported")
    block_n, block_k, split, warps, stages = config or pick_config(n, k, m)
    gs = k if group_size >= k else group_size
    if gs % block_k or k % block_k:
        raise ValueError(f"BLOCK_K {block_k} must divide K ({k}) and the group ({gs})")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    tiles_n = triton.cdiv(n, block_n)
    split = max(1, min(split, k // block_k))
    part = out
    cnt = scales
    if split > 1:
        part = torch.empty((split, MAX_M, n), dtype=torch.float32, device=x.device)
        cnt = split_counters(x.device, tiles_n)
    words = qweight.view(torch.int16)  # [N, K / 4]
    asm = asm_planes(x)
    _w4a16_skinny_kernel[(tiles_n, split)](
        x, words, scales, zeros, bias if bias is not None else scales, out, part, cnt,
        m, n, k, x.stride(0), words.stride(0), scales.stride(0), out.stride(0),
        BLOCK_M=MAX_M, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split, GROUP_SIZE=gs,
        HAS_BIAS=bias is not None, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        ASM=asm, FENCE=not envs.triton_interpret(), num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out
