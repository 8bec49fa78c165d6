"""Skinny GEMM for decode: y[M, N] = x[M, K] @ W[N, K]^T (+ bias) with M <= 4.

Decode at batch 1 is bound by streaming W once, and cuBLAS streams narrow matrices
(llama-3-8b's qkv and o_proj, more so at TP=2) well below the copy bandwidth. This kernel uses
the CUDA cores: each program owns BLOCK_N rows of W, walks K in BLOCK_K tiles of contiguous
16-byte loads, keeps a [BLOCK_M, BLOCK_N, BLOCK_K] fp32 accumulator of products and reduces it
once at the end, so the loop holds no reductions. Rows past N (the last program) and past M
re-read the last valid row instead of masking, so the loads stay unmasked vectors when BLOCK_K
divides K. (Padding M to 16 for ``tl.dot`` instead is slower than cuBLAS.)

``gemv_add_norm`` takes a decoder layer's residual add and RMSNorm into the kernel (NORM):
every program sums its rows' squares over the whole of K in a first pass (each program reads
all of K anyway, so x is read from L1 and L2, not from memory), then normalises each K tile
as it multiplies, rounding where kernels/rmsnorm.py rounds; program 0 also writes the residual
sum and, when asked, the normalised rows. The norm kernel's launch and its place in the
dependency chain go; the rows it multiplies equal the norm kernel's but where the fp32 rstd
differs in its last bit (the squares add in another order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lightwell.kernels import pdl as _pdl

MAX_M = 4


@triton.jit
def _load_cols(rows, k, K, EVEN_K: tl.constexpr):
    """Columns k of the rows at ``rows`` ([R, 1] pointers, or one): [R, len(k)], 0 past K
    (EVEN_K: none is, the loads unmasked)."""
    if EVEN_K:
        v = tl.load(rows + k[None, :])
    else:
        v = tl.load(rows + k[None, :], mask=k[None, :] < K, other=0.0)
    return v


@triton.jit
def _load_x(x_rows, k, K, EVEN_K: tl.constexpr, SILU_MUL: tl.constexpr):
    """x[:, k] in fp32; with SILU_MUL, silu(x[:, k]) * x[:, K + k] rounded to x's dtype, as
    kernels/activation.py's kernel computes and stores it."""
    x = _load_cols(x_rows, k, K, EVEN_K)
    if SILU_MUL:
        up = _load_cols(x_rows + K, k, K, EVEN_K)
        g = x.to(tl.float32)
        x = (g / (1.0 + tl.exp(-g)) * up.to(tl.float32)).to(x.dtype)
    return x.to(tl.float32)


@triton.jit
def _sum_rows(x_rows, r_rows, k, K, EVEN_K: tl.constexpr, HAS_RES: tl.constexpr):
    """x[:, k], plus residual[:, k] with HAS_RES (the sum rounded to x's dtype, as
    kernels/rmsnorm.py's add), in x's dtype."""
    x = _load_cols(x_rows, k, K, EVEN_K)
    if HAS_RES:
        r = _load_cols(r_rows, k, K, EVEN_K)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
    return x


@triton.jit
def _x_tile(
    x_rows, r_rows, nw_ptr, rstd, k, K, EVEN_K: tl.constexpr, SILU_MUL: tl.constexpr,
    NORM: tl.constexpr, HAS_RES: tl.constexpr,
):  # fmt: skip
    """(The K tile of the matmul's left operand in fp32, the same in x's dtype): x's
    (``_load_x``), or with NORM the normalised rows (kernels/rmsnorm.py's ``norm_row``: the
    normalised value rounded to x's dtype times the weight, rounded again)."""
    if NORM:
        x = _sum_rows(x_rows, r_rows, k, K, EVEN_K, HAS_RES)
        g = _load_cols(nw_ptr, k, K, EVEN_K).to(tl.float32)  # [1, len(k)]
        xs = (x.to(tl.float32) * rstd[:, None]).to(x.dtype).to(tl.float32) * g
        xs = xs.to(x.dtype)
        xf = xs.to(tl.float32)
    else:
        xf = _load_x(x_rows, k, K, EVEN_K, SILU_MUL)
        xs = xf
    return xf, xs


@triton.jit
def _tile(
    acc, w, x_rows, r_rows, nw_ptr, normed_ptr, rstd, row_ok, rm, k, K, stride_rm,
    EVEN_K: tl.constexpr, SILU_MUL: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr,
    WRITE_NORMED: tl.constexpr,
):  # fmt: skip
    """acc plus the products of the K tile at k (w: its weights); with WRITE_NORMED program 0
    stores the tile of normalised rows."""
    x, xs = _x_tile(x_rows, r_rows, nw_ptr, rstd, k, K, EVEN_K, SILU_MUL, NORM, HAS_RES)
    if WRITE_NORMED:
        tl.store(normed_ptr + rm[:, None] * stride_rm + k[None, :], xs,
                 mask=row_ok & (k[None, :] < K))  # fmt: skip
    return acc + x[:, None, :] * w.to(tl.float32)[None, :, :]


@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, M, N, K,
    stride_xm, stride_wn, stride_om,
    r_ptr, nw_ptr, res_out_ptr, normed_ptr, stride_rm, eps,  # NORM's (else unread)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    SILU_MUL: tl.constexpr,  # x is [gate | up] ([M, 2K]): multiply by silu(gate) * up
    EARLY_W: tl.constexpr,  # the first K tile of W is loaded before anything else (PDL's form)
    GDC: tl.constexpr,  # with EARLY_W: signal, then wait for the kernel before (kernels/pdl.py)
    NORM: tl.constexpr = False,  # multiply RMSNorm(x (+ residual)) * norm weight (gemv_add_norm)
    HAS_RES: tl.constexpr = False,  # NORM: add r_ptr's rows first; program 0 stores the sums
    WRITE_NORMED: tl.constexpr = False,  # NORM: program 0 stores the normalised rows
):  # fmt: skip
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    wn = tl.minimum(rn, N - 1).to(tl.int64)  # past N: re-read the last row, store nothing
    xm = tl.minimum(rm, M - 1)
    w_rows = w_ptr + wn[:, None] * stride_wn  # [BN, 1]
    x_rows = x_ptr + xm[:, None] * stride_xm  # [BM, 1]
    r_rows = r_ptr + xm[:, None] * stride_rm  # NORM: the residual rows
    row_ok = (rm[:, None] < M) & (rm[:, None] * 0 + tl.program_id(0) == 0)  # program 0's
    acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
    k_first = 0
    if EARLY_W:
        # W does not depend on the kernel before: its stream starts before waiting for x
        w = _load_cols(w_rows, rk, K, EVEN_K)
        if GDC:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
    if NORM:  # the rows' sums of squares over all of K first
        sq = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + rk
            x = _sum_rows(x_rows, r_rows, k, K, EVEN_K, HAS_RES)
            if HAS_RES:
                tl.store(res_out_ptr + rm[:, None] * stride_rm + k[None, :], x,
                         mask=row_ok & (k[None, :] < K))  # fmt: skip
            sq += x.to(tl.float32) * x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(sq, axis=1) / K + eps)
    if EARLY_W:
        acc = _tile(
            acc, w, x_rows, r_rows, nw_ptr, normed_ptr, rstd, row_ok, rm, rk, K, stride_rm,
            EVEN_K, SILU_MUL, NORM, HAS_RES, WRITE_NORMED,
        )  # fmt: skip
        k_first = BLOCK_K
    for k0 in range(k_first, K, BLOCK_K):
        k = k0 + rk
        w = _load_cols(w_rows, k, K, EVEN_K)
        acc = _tile(
            acc, w, x_rows, r_rows, nw_ptr, normed_ptr, rstd, row_ok, rm, k, K, stride_rm,
            EVEN_K, SILU_MUL, NORM, HAS_RES, WRITE_NORMED,
        )  # fmt: skip
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
        x.stride(0), weight.stride(0), out.stride(0), x, x, x, x, 0, 0.0,
        BLOCK_M=triton.next_power_of_2(m), BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN_K=k % block_k == 0, HAS_BIAS=bias is not None, SILU_MUL=silu_mul,
        EARLY_W=early, GDC=gdc,
        num_warps=warps, num_stages=stages, **_pdl.launch_options(gdc),
    )  # fmt: skip
    return out


def pick_norm_config(n: int, k: int) -> Config:
    """``gemv_add_norm``'s tile: each program normalises its x tiles, work shared by its
    rows, so a program takes more rows than the plain GEMV's two."""
    k_pow2 = triton.next_power_of_2(k)
    if n <= 256:
        return 2, min(2048, k_pow2), 4, 1
    return 8, min(1024, k_pow2), 4, 1


def gemv_add_norm(
    x: torch.Tensor,  # [M, K], M <= MAX_M
    residual: torch.Tensor | None,  # [M, K] contiguous, or None: no residual add
    norm_weight: torch.Tensor,  # [K] in x's dtype
    eps: float,
    weight: torch.Tensor,  # [N, K]
    *,
    residual_out: torch.Tensor | None = None,  # [M, K] contiguous: x + residual is written here
    normed_out: torch.Tensor | None = None,  # [M, K] contiguous: the normalised rows, if given
    config: Config | None = None,
    pdl: bool | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:  # [M, N]
    """``rmsnorm(x + residual) @ weight.T`` in one launch (the module docstring's NORM), the
    sum written to ``residual_out`` (required with ``residual``) and the normalised rows to
    ``normed_out`` when given, as kernels/rmsnorm.py's ``fused_add_rmsnorm`` would write them.
    ``config``: default ``pick_norm_config``; ``pdl`` and ``out_dtype`` as ``gemv``'s."""
    _check(x, weight, None)
    m, k = x.shape
    rows = [t for t in (residual, residual_out, normed_out) if t is not None]
    if any(t.shape != x.shape or t.dtype != x.dtype or not t.is_contiguous() for t in rows):
        raise ValueError(
            f"gemv_add_norm: residual and outputs must be contiguous like x {tuple(x.shape)}"
        )
    if norm_weight.shape != (k,) or norm_weight.dtype != x.dtype or norm_weight.stride(0) != 1:
        raise ValueError(f"gemv_add_norm: norm weight must be [{k}] in {x.dtype}")
    if (residual is None) != (residual_out is None):
        raise ValueError("gemv_add_norm: residual_out goes with residual")
    inputs = {t.data_ptr() for t in (x, residual) if t is not None}
    if any(t is not None and t.data_ptr() in inputs for t in (residual_out, normed_out)):
        raise ValueError("gemv_add_norm: the outputs must not be x or residual (read by all)")
    n = weight.shape[0]
    block_n, block_k, warps, stages = config or pick_norm_config(n, k)
    early = _pdl.use_pdl(x.device) if pdl is None else pdl
    gdc = early and _pdl.device_supports(x.device)
    out = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    if m == 0:
        return out
    res = residual if residual is not None else x
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, weight, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        res, norm_weight, residual_out if residual_out is not None else x,
        normed_out if normed_out is not None else x, k, eps,
        BLOCK_M=triton.next_power_of_2(m), BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN_K=k % block_k == 0, HAS_BIAS=False, SILU_MUL=False, EARLY_W=early, GDC=gdc,
        NORM=True, HAS_RES=residual is not None, WRITE_NORMED=normed_out is not None,
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
