"""Skinny GEMM for decode: y[M, N] = x[M, K] @ W[N, K]^T (+ bias) with M <= 4.

Decode at batch 1 is bound by streaming W once, and cuBLAS streams narrow matrices
(llama-3-8b's qkv and o_proj, more so at TP=2) well below the copy bandwidth. This kernel uses
the CUDA cores: each program owns BLOCK_N rows of W, walks K in BLOCK_K tiles of contiguous
16-byte loads, keeps a [BLOCK_M, BLOCK_N, BLOCK_K] fp32 accumulator of products and reduces it
once at the end, so the loop holds no reductions. Rows past N (the last program) and past M
re-read the last valid row instead of masking, so the loads stay unmasked vectors when BLOCK_K
divides K. (Padding M to 16 for ``tl.dot`` instead is slower than cuBLAS.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lightwell.kernels import pdl as _pdl

MAX_M = 4


@triton.jit
def _load_x(x_rows, k, K, EVEN_K: tl.constexpr, SILU_MUL: tl.constexpr):
    """x[:, k] in fp32; with SILU_MUL, silu(x[:, k]) * x[:, K + k] rounded to x's dtype, as
    kernels/activation.py's kernel computes and stores it."""
    if EVEN_K:
        x = tl.load(x_rows + k[None, :])
    else:
        x = tl.load(x_rows + k[None, :], mask=k[None, :] < K, other=0.0)
    if SILU_MUL:
        if EVEN_K:
            up = tl.load(x_rows + K + k[None, :])
        else:
            up = tl.load(x_rows + K + k[None, :], mask=k[None, :] < K, other=0.0)
        g = x.to(tl.float32)
        x = (g / (1.0 + tl.exp(-g)) * up.to(tl.float32)).to(x.dtype)
    return x.to(tl.float32)


@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, M, N, K,
    stride_xm, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    SILU_MUL: tl.constexpr,  # x is [gate | up] ([M, 2K]): multiply by silu(gate) * up
    EARLY_W: tl.constexpr,  # the first K tile of W is loaded before anything else (PDL's form)
    GDC: tl.constexpr,  # with EARLY_W: signal, then wait for the kernel before (kernels/pdl.py)
):  # fmt: skip
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    wn = tl.minimum(rn, N - 1).to(tl.int64)  # past N: re-read the last row, store nothing
    xm = tl.minimum(rm, M - 1)
    w_rows = w_ptr + wn[:, None] * stride_wn  # [BN, 1]
    x_rows = x_ptr + xm[:, None] * stride_xm  # [BM, 1]
    acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    k_first = 0
    if EARLY_W:
        # W does not depend on the kernel before: its stream starts before waiting for x
        if EVEN_K:
            w = tl.load(w_rows + rk[None, :])
        else:
            w = tl.load(w_rows + rk[None, :], mask=rk[None, :] < K, other=0.0)
        if GDC:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        x = _load_x(x_rows, rk, K, EVEN_K, SILU_MUL)
        acc += x[:, None, :] * w.to(tl.float32)[None, :, :]
        k_first = BLOCK_K
    for k0 in range(k_first, K, BLOCK_K):
        k = k0 + rk
        if EVEN_K:
            w = tl.load(w_rows + k[None, :])
        else:
            w = tl.load(w_rows + k[None, :], mask=k[None, :] < K, other=0.0)
        x = _load_x(x_rows, k, K, EVEN_K, SILU_MUL)
        acc += x[:, None, :] * w.to(tl.float32)[None, :, :]
    out = tl.sum(acc, axis=2)  # [BM, BN]
    if HAS_BIAS:
        out += tl.load(b_ptr + tl.minimum(rn, N - 1)).to(tl.float32)[None, :]
    ptrs = out_ptr + rm[:, None] * stride_om + rn[None, :]
    tl.store(ptrs, out.to(out_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


# (BLOCK_N, BLOCK_K, num_warps, num_stages)
Config = tuple[int, int, int, int]


def pick_config(n: int, k: int, m: int = 1, silu_mul: bool = False) -> Config:
    """The tile for an [N, K] weight and M rows: two rows a program, 1,024-wide K steps, one
    warp, 3 stages, within a few percent of the best tile on every llama-3-8b shape (the
    kernel benchmark's tile sweep). Narrower weights have too few programs to keep enough
    loads in flight at a warp each: up to 2,048 rows (DeepSeek-V2-Lite's o_proj) four warps a
    program; up to 256 (MoE routers) K up to 2,048 wide in one step, a row a program for one
    token, two rows on eight warps for more (faster at 2 and 4 rows; timed on bf16 weights,
    while DeepSeek's routers are fp32). With ``silu_mul`` every program recomputes the
    activation of its K range (an exponential per element), so a program takes 8 weight rows,
    an exponential per 8 weight elements instead of per 2 (faster than the activation kernel
    then the gemv; 2 and 16 rows a program are slower)."""
    k_pow2 = triton.next_power_of_2(k)
    if silu_mul:
        return 8, min(1024, k_pow2), 4, 1
    if n <= 256:
        return (1, min(2048, k_pow2), 1, 3) if m == 1 else (2, min(2048, k_pow2), 8, 1)
    return 2, min(1024, k_pow2), 4 if n <= 2048 else 1, 3


def gemv(
    x: torch.Tensor,  # [M, K] ([M, 2K] with silu_mul), M <= MAX_M
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    config: Config | None = None,
    *,
    silu_mul: bool = False,
    pdl: bool | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:  # [M, N] in out_dtype (default x's)
    """``x @ weight.T (+ bias)``; with ``silu_mul``, x is a gated MLP's ``[gate | up]`` and the
    product is ``(silu(gate) * up) @ weight.T``, the activation computed as the matmul loads
    it (one kernel instead of two). ``config``: (BLOCK_N, BLOCK_K, num_warps, num_stages),
    default ``pick_config``. ``pdl`` (default: ``kernels.pdl.use_pdl``) loads the first K
    tile of weights before the input, and on an sm_90+ GPU launches with programmatic
    dependent launch, waiting for the kernel before only after that load (kernels/pdl.py);
    elsewhere only the load order changes. With it, ``weight``
    must be written by no kernel of the stream (a layer's weights are not): it is read before
    the wait. ``out_dtype``: e.g. fp32 logits of an fp32 weight (the products are fp32 either
    way)."""
    _check(x, weight, bias, silu_mul)
    m = x.shape[0]
    n, k = weight.shape
    block_n, block_k, warps, stages = config or pick_config(n, k, m, silu_mul)
    early = _pdl.use_pdl(x.device) if pdl is None else pdl
    gdc = early and _pdl.device_supports(x.device)
    out = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    if m == 0:
        return out
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, out, m, n, k,
        x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=triton.next_power_of_2(m), BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN_K=k % block_k == 0, HAS_BIAS=bias is not None, SILU_MUL=silu_mul,
        EARLY_W=early, GDC=gdc,
        num_warps=warps, num_stages=stages, **_pdl.launch_options(gdc),
    )  # fmt: skip
    return out


def gemv_ref(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N]
    out = x.float() @ weight.float().t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def _check(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu_mul: bool = False
) -> None:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1] * (1 + silu_mul):
        raise ValueError(f"gemv: x {tuple(x.shape)} and weight {tuple(weight.shape)} mismatch")
    if x.shape[0] > MAX_M:
        raise ValueError(f"gemv handles at most {MAX_M} rows, got {x.shape[0]}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("gemv needs a contiguous last dimension on x and weight")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"gemv: bias shape {tuple(bias.shape)} != ({weight.shape[0]},)")
