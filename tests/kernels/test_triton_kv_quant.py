"""8-bit KV caches (fp8 e4m3, int8) on the Triton path, under TRITON_INTERPRET=1 on CPU: the
store (alone and fused with RoPE) writes the values and scales ``quantize_kv`` gives, in the
block layout of quant/kv_cache.py (values, then head-major scales); paged attention over
the 8-bit cache equals ``paged_attention_ref`` over the dequantized cache; the Triton backend
equals the torch backend on the same 8-bit cache (outputs and cache bytes); compiled for sm_90
(no GPU needed), the decode kernel converts value tiles in registers, not byte by byte through
shared memory."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lightwell.attention.torch_backend import TorchAttentionBackend, write_kv_cache
from lightwell.attention.triton_backend import TritonAttentionBackend, compile_variants
from lightwell.kernels import kv_dequant as kvd
from lightwell.kernels import kv_store as ks
from lightwell.kernels import paged_attention as pa
from lightwell.kernels import rotary as rot
from lightwell.kernels.kv_quant import QMAX
from lightwell.quant.kv_cache import (
    FP8_MAX,
    dequantize_blocks,
    dequantize_kv,
    quantize_blocks,
    quantize_kv,
    split_blocks,
)
from tests.kernels.test_triton_kernels import DEVICE, _paged_batch, _randn, _run_ptx_script

FP8 = torch.float8_e4m3fn
KV_DTYPES = {"fp8": FP8, "int8": torch.int8}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16}


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8 else t


def _empty_cache(nblocks: int, bs: int, hkv: int, d: int, kv_dtype: torch.dtype) -> torch.Tensor:
    """All bytes 0x7f: fp8 NaN codes and NaN-ish scales where nothing was written."""
    raw = torch.full((2, nblocks, bs, hkv, d + 4), 0x7F, dtype=torch.uint8, device=DEVICE)
    return raw.view(kv_dtype) if kv_dtype == FP8 else raw.view(torch.int8)


def test_kernel_constants_are_the_layouts():
    assert QMAX == {FP8: FP8_MAX, torch.int8: 127.0}


@pytest.mark.parametrize("kv", list(KV_DTYPES))
@pytest.mark.parametrize("dt", list(DTYPES))
def test_kv_store_writes_the_bytes_of_quantize_kv(kv, dt):
    kv_dtype, dtype = KV_DTYPES[kv], DTYPES[dt]
    gen = torch.Generator().manual_seed(0)
    num_tokens, hkv, d, bs, nblocks = 9, 3, 32, 4, 6
    kvx = _randn(num_tokens, 2 * hkv + 1, d, dtype=dtype, gen=gen)  # strided views, as from qkv
    kvx *= torch.tensor([1e-3, 1.0, 30.0, 1.0, 5.0, 0.1, 1.0]).to(kvx)[None, :, None]
    k, v = kvx[:, :hkv], kvx[:, hkv : 2 * hkv]
    k[4, 1] = 0  # an all-zero row: scale 1, zeros
    slots = torch.randperm(nblocks * bs, generator=gen)[:num_tokens].to(DEVICE)
    slots[2] = -1  # padding token: skipped
    cache = _empty_cache(nblocks, bs, hkv, d, kv_dtype)
    ref, torch_ref = cache.clone(), cache.clone()
    ks.kv_store(k, v, cache, slots)
    ks.kv_store_ref(k, v, ref, slots)
    keep = slots >= 0
    write_kv_cache(torch_ref, k[keep], v[keep], slots[keep])  # the torch backend's store
    assert torch.equal(_bytes(cache), _bytes(ref))
    assert torch.equal(_bytes(cache), _bytes(torch_ref))
    values, scales = split_blocks(cache[0])
    blk, off = slots[keep] // bs, slots[keep] % bs
    want_q, want_s = quantize_kv(k[keep], kv_dtype)
    assert torch.equal(_bytes(values)[blk, off], _bytes(want_q))
    assert torch.equal(scales[blk, :, off], want_s)
    # by hand: token slots[0]'s head 1 values at (off * hkv + 1) * d, its scale after all rows
    raw = _bytes(cache[0, blk[0]]).flatten()
    row = (int(off[0]) * hkv + 1) * d
    assert torch.equal(raw[row : row + d], _bytes(want_q[0, 1]))
    at = bs * hkv * d + 4 * (1 * bs + int(off[0]))
    assert torch.equal(raw[at : at + 4].view(torch.float32), want_s[0, 1:2])
    err = (dequantize_kv(want_q, want_s, torch.float32) - k[keep].float()).abs().amax(-1)
    assert (err <= k[keep].float().abs().amax(-1) / (16 if kv == "fp8" else 254) + 1e-7).all()


@pytest.mark.parametrize("kv", list(KV_DTYPES))
def test_rotary_store_writes_the_rotated_keys_quantized(kv):
    kv_dtype = KV_DTYPES[kv]
    gen = torch.Generator().manual_seed(4)
    num_tokens, hq, hkv, d, bs, nblocks = 7, 4, 2, 32, 4, 5
    qkv = _randn(num_tokens, (hq + 2 * hkv) * d, dtype=torch.float16, gen=gen)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    cos_sin = torch.rand(64, d, generator=gen).to(DEVICE) * 2 - 1
    pos = torch.randint(0, 64, (num_tokens,), generator=gen).to(DEVICE)
    slots = torch.randperm(nblocks * bs, generator=gen)[:num_tokens].to(DEVICE)
    slots[3] = -1
    cache = _empty_cache(nblocks, bs, hkv, d, kv_dtype)
    expected = cache.clone()
    rot.rotary_embedding(pos, q, k, cos_sin, d, True, v=v, kv_cache=cache, slot_mapping=slots)
    ks.kv_store_ref(k.view(-1, hkv, d), v.reshape(-1, hkv, d), expected, slots)
    assert torch.equal(_bytes(cache), _bytes(expected))


# (query lens, cached lens, Hkv, G, D, num_splits, tiles, sliding window)
QUANT_CASES = {
    "decode_split3": ([1, 1, 0, 1], [3, 40, 95, 17], 2, 2, 32, 3, (16, 16), None),
    "mixed_prefix_gqa4_split2": ([1, 1, 20, 5], [10, 33, 17, 0], 1, 4, 32, 2, (32, 16), None),
    "prefill_ragged_tiles": ([37, 0, 9], [0, 4, 0], 2, 1, 32, None, (16, 16), None),
    "prefix_default_tiles_w20": ([19, 1, 6], [21, 30, 0], 2, 2, 64, None, None, 20),
}


def _quant_batch(case: str, dt: str, kv: str, seed: int) -> tuple:
    """(q in dt, the exact fp32 cache, it in the 8-bit layout, metadata, tiles) for a case;
    key magnitudes vary by token, so the per-token scales matter."""
    qlens, ctxs, hkv, gqa, d, _, tiles, _ = QUANT_CASES[case]
    q, cache, meta = _paged_batch(qlens, ctxs, hkv, gqa, d, torch.float32, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    cache *= torch.rand(cache.shape[:3], generator=gen).to(DEVICE)[..., None, None] * 4 + 0.05
    config = pa.AttentionConfig(tiles[0], tiles[1], 4, 1) if tiles else None
    return (q * 2).to(DTYPES[dt]), cache, quantize_blocks(cache, KV_DTYPES[kv]), meta, config


@pytest.mark.parametrize(
    "case,dt,kv",
    [
        ("decode_split3", "fp16", "fp8"),
        ("decode_split3", "fp32", "int8"),
        ("mixed_prefix_gqa4_split2", "fp32", "fp8"),
        ("mixed_prefix_gqa4_split2", "fp16", "int8"),
        ("prefill_ragged_tiles", "fp16", "fp8"),
        ("prefix_default_tiles_w20", "fp32", "int8"),
    ],
)
def test_paged_attention_over_an_8bit_cache(case, dt, kv):
    """Against the fp32 reference on the dequantized cache; key magnitudes vary by token (so
    the per-token scales matter) and the 16-bit case keeps small probabilities apart."""
    q, cache, quant, meta, config = _quant_batch(case, dt, kv, seed=3)
    d, splits, window, dtype = q.shape[-1], QUANT_CASES[case][5], QUANT_CASES[case][7], q.dtype
    out = pa.paged_attention(
        q, quant, meta, d**-0.5, num_splits=splits, config=config, sliding_window=window
    )
    ref = pa.paged_attention_ref(
        q.float(), dequantize_blocks(quant, torch.float32), meta, d**-0.5, sliding_window=window
    )
    tol = {torch.float32: 1e-4, torch.float16: 4e-3}[dtype]
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    exact = pa.paged_attention_ref(q.float(), cache, meta, d**-0.5, sliding_window=window)
    assert (ref - exact).abs().max() > 10 * tol  # the 8-bit cache does differ from the exact


@pytest.mark.parametrize("kv", list(KV_DTYPES))
def test_triton_backend_matches_torch_backend_on_an_8bit_cache(kv):
    """A decode and two prompt chunks after cached tokens: both backends read every key from
    the cache. (A fresh prompt differs: the torch backend attends over its exact k/v, the Triton
    kernel reads the keys it just stored, quantized.)"""
    kv_dtype = KV_DTYPES[kv]
    qlens, ctxs, hkv, d = [1, 7, 4], [20, 9, 3], 2, 32
    q, cache, meta = _paged_batch(qlens, ctxs, hkv, 2, d, torch.float32, seed=5)
    cache = quantize_blocks(cache, kv_dtype)
    gen = torch.Generator().manual_seed(6)
    k = _randn(q.shape[0], hkv, d, dtype=torch.float32, gen=gen)
    v = _randn(q.shape[0], hkv, d, dtype=torch.float32, gen=gen)
    slots = [
        int(meta.block_table[i, p // 16]) * 16 + p % 16
        for i, (n, c) in enumerate(zip(qlens, ctxs))
        for p in range(c, c + n)
    ]
    meta.slot_mapping = torch.tensor(slots, dtype=torch.int64, device=DEVICE)
    c1, c2 = cache.clone(), cache.clone()
    out = TritonAttentionBackend().forward(q, k, v, c1, meta, 0.25)
    ref = TorchAttentionBackend().forward(q, k, v, c2, meta, 0.25)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    assert torch.equal(_bytes(c1), _bytes(c2))


def test_compile_variants_reads_an_8bit_cache():
    cache = _empty_cache(3, 16, 2, 32, FP8)
    cache.view(torch.uint8).zero_()
    # the 4 of a model-dtype cache, decode split / unsplit in the tile of wide batches and
    # the two prefill tilings over the copy long prompt chunks read
    assert compile_variants(4, cache, 0.2, torch.float16) == 8
    odd = _empty_cache(3, 5, 3, 20, FP8)  # K/V 1,440 bytes apart, rows of 20 bytes
    odd.view(torch.uint8).zero_()
    assert compile_variants(6, odd, 0.2, torch.float16) == 8
    assert pa.default_config(128, True, True, wide=True) == pa.AttentionConfig(16, 64, 2, 3)
    assert pa.default_config(128, True, True) == pa.AttentionConfig(16, 128, 4, 2)
    assert pa.default_config(128, True, False, wide=True) == pa.AttentionConfig(16, 64, 4, 3)


# The decode kernel over an fp8 / int8 cache (llama-3-8b's heads, the wide-batch tile) compiled
# for sm_90, V_ASM per argv[1]: its shared-memory and conversion instructions, counted.
_DECODE_PTX_SCRIPT = r"""
import json, re, sys, triton
from triton.backends.compiler import GPUTarget
from lightwell.kernels import paged_attention as pa

names = list(pa._paged_attention_kernel.fn.__code__.co_varnames[
    : pa._paged_attention_kernel.fn.__code__.co_argcount])
out = {}
for kv, ty in (("fp8", "*fp8e4nv"), ("int8", "*i8")):
    consts = dict(GQA=4, HEAD_DIM=128, HEAD_DIM_PAD=128, BLOCK_SIZE=16, BLOCK_M=16, BLOCK_Q=1,
                  BLOCK_N=64, SPLIT_KV=False, SLIDING=False, ONE_TILE_PER_REQ=True, PAD_D=False,
                  DOT_PREC="tf32", PDL_SIGNAL=False, KV_QUANT=True, F16_DOT=True,
                  V_ASM=sys.argv[1] == "1")
    types = dict(q_ptr="*bf16", out_ptr="*bf16", k_cache_ptr=ty, v_cache_ptr=ty,
                 part_acc_ptr="*fp32", part_m_ptr="*fp32", part_l_ptr="*fp32", qsl_ptr="*i32",
                 seq_lens_ptr="*i32", block_table_ptr="*i32", qk_scale="fp32")
    sig = {n: ("constexpr" if n in consts else types.get(n, "i32")) for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if sig[n] not in ("constexpr", "fp32") and n not in ("req_base", "num_reqs",
             "tok_base", "tile_base", "window")}
    src = triton.compiler.ASTSource(fn=pa._paged_attention_kernel, signature=sig,
                                    constexprs=consts, attrs=attrs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                         options=dict(num_warps=2, num_stages=3)).asm["ptx"]
    out[kv] = {
        "byte_shared_loads": len(re.findall(r"ld\.shared\.[bsu]8\b", ptx)),
        "transposed_ldmatrix": len(re.findall(r"ldmatrix\.[.\w]*\.trans\.", ptx)),
        "fp8_pair_cvt": ptx.count("cvt.rn.f16x2.e4m3x2"),
        "prmt": ptx.count("prmt.b32"),
    }
print(json.dumps(out))
"""


@pytest.mark.parametrize("asm", [True, False])
def test_decode_kernel_converts_value_tiles_in_registers(asm):
    """A plain conversion of the value tile lets Triton carry its 8-bit bytes into the
    product's transposed operand layout one shared-memory load each (256 in this tile); with
    ``V_ASM`` the tile converts in registers and its fp16 copy is read with transposing
    ldmatrix, as a 16-bit cache's is."""
    got = _run_ptx_script(_DECODE_PTX_SCRIPT, asm)
    for kv, ops in got.items():
        if asm:
            assert ops["byte_shared_loads"] == 0, (kv, ops)
            assert ops["transposed_ldmatrix"] > 0, (kv, ops)
        else:
            assert ops["byte_shared_loads"] >= 64 * 128 // 64, (kv, ops)
    assert got["fp8"]["fp8_pair_cvt"] > 0 and got["int8"]["prmt"] > 0


def test_8bit_cache_refuses_a_head_dim_without_aligned_scales():
    q, _, meta = _paged_batch([1], [3], 1, 1, 24, torch.float32)
    with pytest.raises(ValueError, match="head_dim % 4"):
        pa.paged_attention(q[..., :22].contiguous(), _empty_cache(2, 16, 1, 22, FP8), meta, 1.0)


@pytest.mark.parametrize(
    "case,dt,kv",
    [
        ("mixed_prefix_gqa4_split2", "fp32", "fp8"),
        ("prefill_ragged_tiles", "fp16", "int8"),
        ("prefix_default_tiles_w20", "fp16", "fp8"),
    ],
)
def test_prompt_chunks_read_a_dequantized_copy(monkeypatch, case, dt, kv):
    """Launches of prompt chunks of at least MIN_COPY_TOKENS tokens attend over a copy of their
    blocks in the query dtype (kernels/kv_dequant.py): against the fp32 reference on the
    dequantized cache, as the direct path."""
    q, _, quant, meta, config = _quant_batch(case, dt, kv, seed=7)
    d, splits, window, dtype = q.shape[-1], QUANT_CASES[case][5], QUANT_CASES[case][7], q.dtype
    calls = []
    real = kvd.dequantize_cache_blocks
    monkeypatch.setattr(kvd, "dequantize_cache_blocks", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(kvd, "MIN_COPY_TOKENS", 1)
    out = pa.paged_attention(q, quant, meta, d**-0.5, num_splits=splits, config=config,
                             sliding_window=window)  # fmt: skip
    assert calls  # the copy was read
    ref = pa.paged_attention_ref(
        q.float(), dequantize_blocks(quant, torch.float32), meta, d**-0.5, sliding_window=window
    )
    tol = {torch.float32: 1e-4, torch.float16: 4e-3}[dtype]
    # (K and V rounded to the query dtype, keys up to 4x: an error relative to the outputs' scale)
    torch.testing.assert_close(out.float(), ref, atol=tol * float(ref.abs().max()), rtol=tol)


def test_dequantized_copy_is_the_blocks_and_when_it_is_made():
    q, cache, meta = _paged_batch([40, 1], [30, 5], 2, 2, 32, torch.float32, seed=9)
    quant = quantize_blocks(cache, FP8)
    ids = torch.tensor([3, 0, 3], dtype=torch.int32, device=DEVICE)
    k, v = kvd.dequantize_cache_blocks(quant[0], quant[1], ids, torch.float32)
    want = dequantize_blocks(quant[:, ids.long()], torch.float32)
    assert torch.equal(k, want[0]) and torch.equal(v, want[1])
    assert kvd.copy_for_prefill(quant[0], quant[1], meta, 0, 2, torch.float32) is None  # 41 tokens
    k, v, table = kvd.copy_for_prefill(quant[0], quant[1], meta, 0, 2, torch.float32, force=True)
    assert table.tolist() == [[0, 1, 2, 3, 4], [5, 0, 0, 0, 0]]  # 70 and 6 tokens: 5 + 1 blocks
    src = torch.cat([meta.block_table[0, :5], meta.block_table[1, :1]]).long()
    want = dequantize_blocks(quant[:, src], torch.float32)
    assert torch.equal(k, want[0]) and torch.equal(v, want[1])
    assert kvd.copy_for_prefill(cache[0], cache[1], meta, 0, 2, torch.float32, force=True) is None
    graphed = dataclasses.replace(meta, static_layout=True)  # host lengths not the step's
    assert kvd.copy_for_prefill(*quant, graphed, 0, 2, torch.float32, force=True) is None
