"""MLA's per-token work before the latent attention of a decode step (lightwell/layers/mla.py
runs ``prepare_decode`` on CUDA for decode-only steps, then the attention and
kernels/mla_output.py's ``absorb_output``; torch ops otherwise):

- ``latent_entry``: the kv_a projection's output ``[T, L + P]`` becomes the cache entry: the
  latent through kv_a_layernorm (kernels/rmsnorm.py's rounding) and RoPE on ``k_pe``
  (kernels/rotary.py's cos/sin cache and styles), written to ``[T, L + P]`` and, at each token's
  slot (``>= 0``), into the latent cache. One program a token.
- ``absorb_query``: ``q [T, H * (N + P)]`` becomes the absorbed query ``[T, H, L + P]``:
  ``q_nope @ W_UK`` per head (tl.dot on 16- or 64-token tiles, L in 128-wide chunks) and RoPE on
  ``q_pe``. Grid (heads, token tiles, L chunks): many programs even for one token.
- ``prepare_decode``: ``absorb_query``'s programs, then one program a token doing
  ``latent_entry``'s work (its store only): both in one launch.

Only ``prepare_decode`` runs in serving. ``latent_entry`` and ``absorb_query`` are references:
the two separate launches it fuses, which it must equal bit for bit
(tests/kernels/test_mla_prepare.py, where each is also checked against the layer's torch ops),
and the baseline of benchmarks/kernels/mla_fused.py.

``W_UK`` is read in place from ``kv_b_proj``'s weight ``[H * (N + V), L]`` (head h's rows: N key
rows, then V value rows). Products accumulate in fp32 and round once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lightwell import envs
from lightwell.kernels import pdl as _pdl
from lightwell.kernels.kv_quant import (
    block_ptr,
    head_dim_of,
    quant_mode,
    row_ptrs,
    row_scale,
    scale_ptrs,
    to_8bit,
)
from lightwell.kernels.pdl_sync import wait_then_signal
from lightwell.kernels.rmsnorm import norm_row


def _block_t(num_tokens: int) -> int:
    """Tokens a program: tl.dot's smallest tile for a few, 64 past that (each program reads
    its weight chunk once for all its tokens)."""
    return 16 if num_tokens <= 16 else 64


BLOCK_R = 128  # latent values a chunk (absorb_query: a program each)


@triton.jit
def _cos_sin(cs_ptr, pos, stride_cs, rows_ok, ROPE: tl.constexpr, HALF_PAD: tl.constexpr):
    """cos, sin [.., HALF_PAD] fp32 at positions ``pos`` [..] and the pair offsets (neox:
    halves; GPT-J: interleaved) are the caller's."""
    j = tl.arange(0, HALF_PAD)
    ok = rows_ok[:, None] & (j < ROPE // 2)[None, :]
    row = cs_ptr + pos.to(tl.int64)[:, None] * stride_cs + j[None, :]
    cos = tl.load(row, mask=ok, other=0.0).to(tl.float32)
    sin = tl.load(row + ROPE // 2, mask=ok, other=0.0).to(tl.float32)
    return cos, sin, ok


@triton.jit
def _pairs(HALF_PAD: tl.constexpr, ROPE: tl.constexpr, IS_NEOX: tl.constexpr):
    j = tl.arange(0, HALF_PAD)
    if IS_NEOX:
        return j, j + ROPE // 2
    return 2 * j, 2 * j + 1


@triton.jit
def _entry_row(
    t, kv_ptr, w_ptr, pos_ptr, cs_ptr, entry_ptr, cache_ptr, slot_ptr, stride_kv, stride_e,
    stride_cs, eps, LATENT: tl.constexpr, ROPE: tl.constexpr, BLOCK_L: tl.constexpr,
    HALF_PAD: tl.constexpr, IS_NEOX: tl.constexpr, STORE: tl.constexpr, ENTRY: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, KV_QUANT: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """Token ``t``'s latent entry: written to ``entry`` (ENTRY) and its cache slot (STORE; an
    8-bit cache: quantized with one scale over the entry, kernels/kv_quant.py)."""
    t = t.to(tl.int64)
    lat = tl.arange(0, BLOCK_L)
    lat_ok = lat < LATENT
    c = tl.load(kv_ptr + t * stride_kv + lat, mask=lat_ok, other=0.0)
    w = tl.load(w_ptr + lat, mask=lat_ok, other=0.0).to(tl.float32)
    c = norm_row(c, w, eps, LATENT).to(kv_ptr.dtype.element_ty)
    pos = tl.load(pos_ptr + t + tl.arange(0, 1))  # [1]
    cos, sin, ok = _cos_sin(cs_ptr, pos, stride_cs, pos >= 0, ROPE, HALF_PAD)
    off1, off2 = _pairs(HALF_PAD, ROPE, IS_NEOX)
    pe = kv_ptr + t * stride_kv + LATENT
    x1 = tl.load(pe + off1[None, :], mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(pe + off2[None, :], mask=ok, other=0.0).to(tl.float32)
    o1 = (x1 * cos - x2 * sin).to(kv_ptr.dtype.element_ty)
    o2 = (x2 * cos + x1 * sin).to(kv_ptr.dtype.element_ty)
    if ENTRY:
        row = entry_ptr + t * stride_e
        tl.store(row + lat, c, mask=lat_ok)
        tl.store(row + LATENT + off1[None, :], o1, mask=ok)
        tl.store(row + LATENT + off2[None, :], o2, mask=ok)
    if STORE:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            base = block_ptr(cache_ptr, slot // BLOCK_SIZE, 1, LATENT + ROPE, BLOCK_SIZE, KV_QUANT)
            dst = row_ptrs(base, slot % BLOCK_SIZE, 0, 1, LATENT + ROPE)
            if KV_QUANT:
                cf = tl.where(lat_ok, c.to(tl.float32), 0.0)
                o1f, o2f = (
                    tl.where(ok, o1.to(tl.float32), 0.0),
                    tl.where(ok, o2.to(tl.float32), 0.0),
                )
                amax = tl.maximum(tl.max(tl.abs(cf), axis=0),
                                  tl.max(tl.maximum(tl.abs(o1f), tl.abs(o2f))))  # fmt: skip
                sc = row_scale(amax, KV_QUANT)
                tl.store(dst + lat, to_8bit(cf, sc, KV_QUANT, INTERPRET), mask=lat_ok)
                tl.store(dst + LATENT + off1[None, :], to_8bit(o1f, sc, KV_QUANT, INTERPRET),
                         mask=ok)  # fmt: skip
                tl.store(dst + LATENT + off2[None, :], to_8bit(o2f, sc, KV_QUANT, INTERPRET),
                         mask=ok)  # fmt: skip
                tl.store(scale_ptrs(base, slot % BLOCK_SIZE, 0, 1, LATENT + ROPE, BLOCK_SIZE), sc)
            else:
                tl.store(dst + lat, c.to(cache_ptr.dtype.element_ty), mask=lat_ok)
                tl.store(dst + LATENT + off1[None, :], o1.to(cache_ptr.dtype.element_ty), mask=ok)
                tl.store(dst + LATENT + off2[None, :], o2.to(cache_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _latent_entry_kernel(
    kv_ptr,  # [T, L + P]
    w_ptr,  # [L] kv_a_layernorm's weight
    pos_ptr,  # [T]
    cs_ptr,  # [max_pos, P] cos | sin
    entry_ptr,  # [T, L + P]
    cache_ptr,  # the latent cache's first element (STORE)
    slot_ptr,  # [T]; < 0: not stored (STORE)
    stride_kv,
    stride_e,
    stride_cs,
    eps,
    LATENT: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_L: tl.constexpr,
    HALF_PAD: tl.constexpr,
    IS_NEOX: tl.constexpr,
    STORE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # the cache's (STORE)
    KV_QUANT: tl.constexpr,  # kv_quant.quant_mode of the cache dtype (STORE)
    INTERPRET: tl.constexpr,
):
    _entry_row(tl.program_id(0), kv_ptr, w_ptr, pos_ptr, cs_ptr, entry_ptr, cache_ptr, slot_ptr,
               stride_kv, stride_e, stride_cs, eps, LATENT, ROPE, BLOCK_L, HALF_PAD, IS_NEOX,
               STORE, True, BLOCK_SIZE, KV_QUANT, INTERPRET)  # fmt: skip


@triton.jit
def _query_tile(
    h, tile, chunk, q_ptr, w_ptr, pos_ptr, cs_ptr, out_ptr, T, stride_q, stride_cs, stride_o,
    NOPE: tl.constexpr, ROPE: tl.constexpr, VDIM: tl.constexpr, LATENT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr,
    HALF_PAD: tl.constexpr, IS_NEOX: tl.constexpr, PREC: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    """Head ``h``'s absorbed query for token tile ``tile``, latent chunk ``chunk`` (chunk 0
    also its RoPE part). ``GDC`` (launched with PDL): the W_UK chunk, no kernel's output, loads
    before waiting for the kernel before."""
    t = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < T
    n = tl.arange(0, BLOCK_N)
    n_ok = n < NOPE
    r = chunk * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < LATENT
    w_head = w_ptr + h * (NOPE + VDIM) * LATENT
    w = tl.load(w_head + n[:, None] * LATENT + r[None, :], mask=n_ok[:, None] & r_ok[None, :],
                other=0.0)  # fmt: skip
    wait_then_signal(GDC)
    q_rows = q_ptr + t.to(tl.int64)[:, None] * stride_q + h * (NOPE + ROPE)  # [BT, 1]
    qn = tl.load(q_rows + n[None, :], mask=t_ok[:, None] & n_ok[None, :], other=0.0)
    o_rows = out_ptr + t.to(tl.int64)[:, None] * stride_o + h * (LATENT + ROPE)
    acc = tl.dot(qn, w, input_precision=PREC)  # [BT, BR]
    tl.store(o_rows + r[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=t_ok[:, None] & r_ok[None, :])  # fmt: skip
    if chunk == 0:
        pos = tl.load(pos_ptr + t, mask=t_ok, other=0)
        cos, sin, ok = _cos_sin(cs_ptr, pos, stride_cs, t_ok, ROPE, HALF_PAD)
        off1, off2 = _pairs(HALF_PAD, ROPE, IS_NEOX)
        x1 = tl.load(q_rows + NOPE + off1[None, :], mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(q_rows + NOPE + off2[None, :], mask=ok, other=0.0).to(tl.float32)
        tl.store(o_rows + LATENT + off1[None, :],
                 (x1 * cos - x2 * sin).to(out_ptr.dtype.element_ty), mask=ok)  # fmt: skip
        tl.store(o_rows + LATENT + off2[None, :],
                 (x2 * cos + x1 * sin).to(out_ptr.dtype.element_ty), mask=ok)  # fmt: skip


@triton.jit
def _absorb_query_kernel(
    q_ptr,  # [T, H * (N + P)]
    w_ptr,  # [H * (N + V), L] kv_b_proj's weight
    pos_ptr,  # [T]
    cs_ptr,  # [max_pos, P]
    out_ptr,  # [T, H, L + P]
    T,
    stride_q,
    stride_cs,
    stride_o,
    NOPE: tl.constexpr,
    ROPE: tl.constexpr,
    VDIM: tl.constexpr,
    LATENT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    HALF_PAD: tl.constexpr,
    IS_NEOX: tl.constexpr,
    PREC: tl.constexpr,
):
    _query_tile(tl.program_id(0), tl.program_id(1), tl.program_id(2), q_ptr, w_ptr, pos_ptr,
                cs_ptr, out_ptr, T, stride_q, stride_cs, stride_o, NOPE, ROPE, VDIM, LATENT,
                BLOCK_N, BLOCK_T, BLOCK_R, HALF_PAD, IS_NEOX, PREC, False)  # fmt: skip


@triton.jit(do_not_specialize=["T"])  # (a per-step count: no variant compiles mid-serving)
def _prepare_kernel(
    q_ptr,  # [T, H * (N + P)]
    kv_ptr,  # [T, L + P]
    norm_ptr,  # [L] kv_a_layernorm's weight
    w_ptr,  # [H * (N + V), L] kv_b_proj's weight
    pos_ptr,  # [T]
    cs_ptr,  # [max_pos, P]
    out_ptr,  # [T, H, L + P]
    cache_ptr,  # the latent cache's first element
    slot_ptr,  # [T]; < 0: not stored
    T, stride_q, stride_kv, stride_cs, stride_o, eps,
    HEADS: tl.constexpr, NOPE: tl.constexpr, ROPE: tl.constexpr, VDIM: tl.constexpr,
    LATENT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_L: tl.constexpr, HALF_PAD: tl.constexpr, IS_NEOX: tl.constexpr, PREC: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, KV_QUANT: tl.constexpr, INTERPRET: tl.constexpr,  # the cache's
    GDC: tl.constexpr,  # launched with PDL (kernels/pdl.py)
):  # fmt: skip
    """``absorb_query``'s programs (heads x token tiles x latent chunks, flattened, heads
    fastest), then one program a token storing its latent entry (``latent_entry``'s work)."""
    pid = tl.program_id(0)
    tiles = tl.cdiv(T, BLOCK_T)
    queries = HEADS * tiles * tl.cdiv(LATENT, BLOCK_R)
    if pid < queries:
        rest = pid // HEADS
        _query_tile(pid % HEADS, rest % tiles, rest // tiles, q_ptr, w_ptr, pos_ptr, cs_ptr,
                    out_ptr, T, stride_q, stride_cs, stride_o, NOPE, ROPE, VDIM, LATENT, BLOCK_N,
                    BLOCK_T, BLOCK_R, HALF_PAD, IS_NEOX, PREC, GDC)  # fmt: skip
    else:
        wait_then_signal(GDC)
        _entry_row(pid - queries, kv_ptr, norm_ptr, pos_ptr, cs_ptr, out_ptr, cache_ptr,
                   slot_ptr, stride_kv, 0, stride_cs, eps, LATENT, ROPE, BLOCK_L, HALF_PAD,
                   IS_NEOX, True, False, BLOCK_SIZE, KV_QUANT, INTERPRET)  # fmt: skip


def _prec(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _half_pad(rope: int) -> int:
    return max(1, triton.next_power_of_2(rope // 2))


def latent_entry(
    positions: torch.Tensor,  # [T]
    kv: torch.Tensor,  # [T, L + P] kv_a_proj_with_mqa's output
    norm_weight: torch.Tensor,  # [L]
    eps: float,
    cos_sin_cache: torch.Tensor,  # [max_pos, P]
    is_neox_style: bool,
    kv_cache: torch.Tensor | None = None,  # [1, N, B, 1, L + P]
    slot_mapping: torch.Tensor | None = None,  # [T]; < 0: not stored
) -> torch.Tensor:  # [T, L + P] the entries (also stored when kv_cache is given)
    """Reference, not on the serving path: ``prepare_decode``'s latent-entry work as its own
    launch (tests and benchmarks/kernels/mla_fused.py compare the fused kernel with it)."""
    num_tokens, width = kv.shape
    latent = norm_weight.shape[0]
    rope = width - latent
    if kv.stride(1) != 1 or cos_sin_cache.shape[1] != rope:
        raise ValueError(f"latent_entry: kv {tuple(kv.shape)} does not fit a {rope}-dim RoPE")
    entry = kv.new_empty(num_tokens, width)
    store = kv_cache is not None
    if store and (slot_mapping is None or head_dim_of(kv_cache) != width):
        raise ValueError("latent_entry: storing needs slot_mapping and a cache of the entry width")
    if num_tokens:
        _latent_entry_kernel[(num_tokens,)](
            kv, norm_weight, positions, cos_sin_cache, entry, kv_cache if store else entry,
            slot_mapping if store else positions, kv.stride(0), entry.stride(0),
            cos_sin_cache.stride(0), eps, LATENT=latent, ROPE=rope,
            BLOCK_L=triton.next_power_of_2(latent), HALF_PAD=_half_pad(rope),
            IS_NEOX=is_neox_style, STORE=store, **_cache_args(kv_cache if store else entry),
        )  # fmt: skip
    return entry


def _cache_args(kv_cache: torch.Tensor) -> dict:
    """The entry store's constexprs for ``kv_cache`` ([1, N, B, 1, D (+ 4)])."""
    block = kv_cache.shape[2] if kv_cache.dim() == 5 else 1
    return dict(BLOCK_SIZE=block, KV_QUANT=quant_mode(kv_cache.dtype),
                INTERPRET=envs.triton_interpret())  # fmt: skip


def absorb_query(
    positions: torch.Tensor,  # [T]
    q: torch.Tensor,  # [T, H * (N + P)]
    kv_b_weight: torch.Tensor,  # [H * (N + V), L]
    dims: tuple[int, int, int],  # (N, P, V): no-RoPE, RoPE and value dims a head
    cos_sin_cache: torch.Tensor,  # [max_pos, P]
    is_neox_style: bool,
) -> torch.Tensor:  # [T, H, L + P]
    """Reference, not on the serving path: ``prepare_decode``'s absorbed-query work as its own
    launch (tests and benchmarks/kernels/mla_fused.py compare the fused kernel with it)."""
    nope, rope, vdim = dims
    num_tokens = q.shape[0]
    heads, latent = kv_b_weight.shape[0] // (nope + vdim), kv_b_weight.shape[1]
    if q.shape[1] != heads * (nope + rope) or q.stride(1) != 1 or not kv_b_weight.is_contiguous():
        raise ValueError(f"absorb_query: q {tuple(q.shape)} does not fit {heads} heads")
    out = q.new_empty(num_tokens, heads, latent + rope)
    if num_tokens:
        block_r = min(BLOCK_R, max(16, triton.next_power_of_2(latent)))
        block_t = _block_t(num_tokens)
        grid = (heads, triton.cdiv(num_tokens, block_t), triton.cdiv(latent, block_r))
        _absorb_query_kernel[grid](
            q, kv_b_weight, positions, cos_sin_cache, out, num_tokens, q.stride(0),
            cos_sin_cache.stride(0), out.stride(0), NOPE=nope, ROPE=rope, VDIM=vdim,
            LATENT=latent, BLOCK_N=max(16, triton.next_power_of_2(nope)), BLOCK_T=block_t,
            BLOCK_R=block_r, HALF_PAD=_half_pad(rope), IS_NEOX=is_neox_style,
            PREC=_prec(q.dtype),
        )  # fmt: skip
    return out


def prepare_decode(
    positions: torch.Tensor,  # [T]
    q: torch.Tensor,  # [T, H * (N + P)]
    kv: torch.Tensor,  # [T, L + P] kv_a_proj_with_mqa's output
    norm: tuple[torch.Tensor, float],  # kv_a_layernorm's weight [L] and eps
    kv_b_weight: torch.Tensor,  # [H * (N + V), L]
    dims: tuple[int, int, int],  # (N, P, V)
    rope: tuple[torch.Tensor, bool],  # cos_sin_cache [max_pos, P], is_neox_style
    kv_cache: torch.Tensor,  # [1, N, B, 1, L + P]
    slot_mapping: torch.Tensor,  # [T]; < 0: not stored
) -> torch.Tensor:  # [T, H, L + P] the absorbed queries
    """``latent_entry`` (stored into the cache, not returned) and ``absorb_query`` in one
    launch: the same values, bit for bit."""
    nope, rope_dim, vdim = dims
    num_tokens, width = kv.shape
    heads, latent = kv_b_weight.shape[0] // (nope + vdim), kv_b_weight.shape[1]
    bad_q = q.shape[1] != heads * (nope + rope_dim) or q.stride(1) != 1
    if bad_q or not kv_b_weight.is_contiguous() or kv.stride(1) != 1:
        raise ValueError(f"prepare_decode: q {tuple(q.shape)} does not fit {heads} heads")
    if width != latent + rope_dim or head_dim_of(kv_cache) != width or rope[0].shape[1] != rope_dim:
        raise ValueError(f"prepare_decode: kv {tuple(kv.shape)} does not fit the latent cache")
    out = q.new_empty(num_tokens, heads, width)
    if num_tokens:
        block_r = min(BLOCK_R, max(16, triton.next_power_of_2(latent)))
        block_t = _block_t(num_tokens)
        queries = heads * triton.cdiv(num_tokens, block_t) * triton.cdiv(latent, block_r)
        _prepare_kernel[(queries + num_tokens,)](
            q, kv, norm[0], kv_b_weight, positions, rope[0], out, kv_cache,
            slot_mapping, num_tokens, q.stride(0), kv.stride(0), rope[0].stride(0),
            out.stride(0), norm[1], HEADS=heads, NOPE=nope, ROPE=rope_dim, VDIM=vdim,
            LATENT=latent, BLOCK_N=max(16, triton.next_power_of_2(nope)), BLOCK_T=block_t,
            BLOCK_R=block_r, BLOCK_L=triton.next_power_of_2(latent),
            HALF_PAD=_half_pad(rope_dim), IS_NEOX=rope[1], PREC=_prec(q.dtype),
            **_cache_args(kv_cache), **_pdl.kernel_args(q.device),
        )  # fmt: skip
    return out
