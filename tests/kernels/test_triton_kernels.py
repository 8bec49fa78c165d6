"""Triton kernels vs their torch references: on CPU under TRITON_INTERPRET=1, compiled on CUDA.

Shapes are tiny (the interpreter runs every program in Python); full sizes and bf16 run on the GPU
through benchmarks/kernels/triton_kernels.py.
"""

from __future__ import annotations

import inspect
import os
import random

import pytest
import torch

from lightwell.attention import triton_backend as tb
from lightwell.attention.backend import get_attention_backend
from lightwell.attention.metadata import AttentionMetadata, forward_context
from lightwell.attention.torch_backend import TorchAttentionBackend
from lightwell.attention.triton_backend import TritonAttentionBackend
from lightwell.kernels import activation as act
from lightwell.kernels import int8_pack as i8
from lightwell.kernels import kv_store as ks
from lightwell.kernels import paged_attention as pa
from lightwell.kernels import rmsnorm as rn
from lightwell.kernels import rotary as rot
from lightwell.kernels import split_kv as sk
from tests.kernels.interpreter import DEVICE

TOL = {torch.float32: 2e-5, torch.float16: 2e-3}
ATTN_TOL = {torch.float32: 1e-4, torch.float16: 4e-3}


def _randn(*shape: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_kv_store(dtype):
    gen = torch.Generator().manual_seed(0)
    num_tokens, hkv, d, bs, nblocks = 7, 3, 32, 4, 6
    kv = _randn(num_tokens, 2 * hkv + 1, d, dtype=dtype, gen=gen)  # strided views, as from qkv
    k, v = kv[:, :hkv], kv[:, hkv : 2 * hkv]
    slots = torch.randperm(nblocks * bs, generator=gen)[:num_tokens].to(DEVICE)
    slots[2] = -1  # padding token: skipped
    cache = _randn(2, nblocks, bs, hkv, d, dtype=dtype, gen=gen)
    expected = cache.clone()
    ks.kv_store(k, v, cache, slots)
    ks.kv_store_ref(k, v, expected, slots)
    torch.testing.assert_close(cache, expected, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("hidden", [96, 256])
def test_rmsnorm(dtype, hidden):
    gen = torch.Generator().manual_seed(1)
    x = _randn(5, hidden, dtype=dtype, gen=gen)
    res = _randn(5, hidden, dtype=dtype, gen=gen)
    w = _randn(hidden, dtype=dtype, gen=gen)
    tol = TOL[dtype]
    torch.testing.assert_close(
        rn.rmsnorm(x, w, 1e-6), rn.rmsnorm_ref(x, w, 1e-6), atol=tol, rtol=tol
    )
    out, new_res = rn.fused_add_rmsnorm(x, res, w, 1e-5)
    ref_out, ref_res = rn.fused_add_rmsnorm_ref(x, res, w, 1e-5)
    torch.testing.assert_close(new_res, ref_res, atol=0, rtol=0)
    torch.testing.assert_close(out, ref_out, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("neox,rot_dim", [(True, 32), (True, 16), (False, 32)])
def test_rotary(dtype, neox, rot_dim):
    gen = torch.Generator().manual_seed(2)
    num_tokens, hq, hkv, d = 6, 4, 2, 32
    qkv = _randn(num_tokens, (hq + 2 * hkv) * d, dtype=dtype, gen=gen)
    q, k = qkv[:, : hq * d], qkv[:, hq * d : (hq + hkv) * d]  # strided views
    cache = torch.rand(64, rot_dim, generator=gen).to(DEVICE) * 2 - 1
    pos = torch.randint(0, 64, (num_tokens,), generator=gen).to(DEVICE)
    ref_q, ref_k = rot.rotary_embedding_ref(pos, q, k, cache, d, neox)
    v_before = qkv[:, (hq + hkv) * d :].clone()
    rot.rotary_embedding(pos, q, k, cache, d, neox)
    tol = TOL[dtype]
    torch.testing.assert_close(q, ref_q, atol=tol, rtol=tol)
    torch.testing.assert_close(k, ref_k, atol=tol, rtol=tol)
    assert torch.equal(qkv[:, (hq + hkv) * d :], v_before)  # v untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("neox,rot_dim", [(True, 32), (True, 16), (False, 32)])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_rotary_with_kv_store(dtype, neox, rot_dim, slot_dtype):
    """RoPE and the KV-cache store in one launch: q and k rotated in place as by RoPE alone,
    and the cache as after ``kv_store`` of the rotated k and v (a negative slot skipped)."""
    gen = torch.Generator().manual_seed(4)
    num_tokens, hq, hkv, d, bs, nblocks = 7, 4, 2, 32, 4, 5
    qkv = _randn(num_tokens, (hq + 2 * hkv) * d, dtype=dtype, gen=gen)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)  # strided views, as in a model
    cos_sin = torch.rand(64, rot_dim, generator=gen).to(DEVICE) * 2 - 1
    pos = torch.randint(0, 64, (num_tokens,), generator=gen).to(DEVICE)
    slots = torch.randperm(nblocks * bs, generator=gen)[:num_tokens].to(DEVICE, slot_dtype)
    slots[3] = -1  # a CUDA-graph padding row: rotated, not stored
    cache = _randn(2, nblocks, bs, hkv, d, dtype=dtype, gen=gen)
    ref_q, ref_k = rot.rotary_embedding_ref(pos, q, k, cos_sin, d, neox)
    expected = cache.clone()
    ks.kv_store_ref(ref_k.view(-1, hkv, d), v.reshape(-1, hkv, d), expected, slots)
    v_before = v.clone()
    rot.rotary_embedding(pos, q, k, cos_sin, d, neox, v=v, kv_cache=cache, slot_mapping=slots)
    tol = TOL[dtype]
    torch.testing.assert_close(q, ref_q, atol=tol, rtol=tol)
    torch.testing.assert_close(k, ref_k, atol=tol, rtol=tol)
    assert torch.equal(v, v_before)
    # the cache holds exactly the kernel's own rotated k (and v as it was), nothing else moved
    ks.kv_store_ref(k.view(-1, hkv, d), v.reshape(-1, hkv, d), expected, slots)
    torch.testing.assert_close(cache, expected, atol=0, rtol=0)
    with pytest.raises(ValueError, match="v and slot_mapping"):
        rot.rotary_embedding(pos, q, k, cos_sin, d, neox, kv_cache=cache)
    with pytest.raises(ValueError, match="does not match"):
        rot.rotary_embedding(pos, q, k, cos_sin, d, neox, v=v, kv_cache=cache[:, :, :, :1],
                             slot_mapping=slots)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_silu_and_mul(dtype):
    gen = torch.Generator().manual_seed(3)
    x = _randn(3, 2 * 1100, dtype=dtype, gen=gen) * 3  # 1100 > one 1024-wide block
    tol = TOL[dtype]
    torch.testing.assert_close(act.silu_and_mul(x), act.silu_and_mul_ref(x), atol=tol, rtol=tol)


# ---- paged attention -------------------------------------------------------------------------


def _paged_batch(qlens, ctxs, hkv, gqa, d, dtype, block_size=16, seed=0):
    """Random q and cache, scattered non-contiguous block ids, metadata for the batch."""
    gen = torch.Generator().manual_seed(seed)
    seq = [c + n for c, n in zip(ctxs, qlens)]
    nblocks = [-(-s // block_size) for s in seq]
    total = sum(nblocks) + 3
    perm = torch.randperm(total, generator=gen).to(torch.int32)
    table = torch.zeros(len(qlens), max(nblocks), dtype=torch.int32)
    used = 0
    for i, nb in enumerate(nblocks):
        table[i, :nb] = perm[used : used + nb]
        used += nb
    cache = _randn(2, total, block_size, hkv, d, dtype=dtype, gen=gen)
    q = _randn(sum(qlens), hkv * gqa, d, dtype=dtype, gen=gen)
    qsl = [0]
    for n in qlens:
        qsl.append(qsl[-1] + n)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq, dtype=torch.int32, device=DEVICE),
        block_table=table.to(DEVICE),
        slot_mapping=torch.zeros(sum(qlens), dtype=torch.int64, device=DEVICE),
        max_query_len=max(qlens),
        max_seq_len=max(seq),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq,
        num_decodes=sum(n == 1 for n in qlens),
    )
    return q, cache, meta


# (query lens, cached lens, Hkv, G, D, num_splits, (block_m, block_n) or None = default tiles);
# a query len of 0 is a padding request (CUDA-graph batches)
ATTN_CASES = {
    "decode_gqa4": ([1, 1, 1], [5, 40, 70], 2, 4, 64, None, None),
    "decode_split3_gqa2": ([1, 1, 0, 1], [3, 40, 95, 17], 2, 2, 32, 3, (16, 16)),
    "prefill_gqa1_ragged_tiles": ([37, 0, 9], [0, 4, 0], 2, 1, 32, None, (16, 16)),
    "mixed_prefix_gqa4_split2": ([1, 1, 20, 5], [10, 33, 17, 0], 1, 4, 32, 2, (32, 16)),
    "prefix_gqa2_default_tiles": ([19, 1, 6], [21, 30, 0], 2, 2, 64, None, None),
    "head_dim24_gqa3": ([5, 3, 1], [14, 29, 8], 2, 3, 24, None, (16, 16)),
    # more splits than a short context fills (a decode graph's count): 1 of 8 and 5 of 8 used
    "decode_split8_short": ([1, 1], [6, 150], 1, 2, 32, 8, (16, 16)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", list(ATTN_CASES))
def test_paged_attention(case, dtype):
    qlens, ctxs, hkv, gqa, d, splits, tiles = ATTN_CASES[case]
    q, cache, meta = _paged_batch(qlens, ctxs, hkv, gqa, d, dtype)
    config = pa.AttentionConfig(tiles[0], tiles[1], 4, 1) if tiles else None
    out = pa.paged_attention(q, cache, meta, d**-0.5, num_splits=splits, config=config)
    ref = pa.paged_attention_ref(q, cache, meta, d**-0.5)
    tol = ATTN_TOL[dtype]
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


# (query lens, cached lens, Hkv, G, D, num_splits, tiles, sliding window): contexts longer than
# the window, windows below, at and above the tile width, one-key windows
WINDOW_CASES = {
    "decode_w5": ([1, 1, 1], [3, 40, 70], 2, 2, 32, None, (16, 16), 5),
    "decode_split3_w20": ([1, 1, 0, 1], [3, 40, 95, 17], 2, 2, 32, 3, (16, 16), 20),
    "prefill_w7_ragged_tiles": ([37, 0, 9], [0, 4, 0], 2, 1, 32, None, (16, 16), 7),
    "prefix_w20_edge_inside_tile": ([40, 25], [30, 0], 2, 1, 32, None, (16, 16), 20),
    "mixed_prefix_w16_split2": ([1, 1, 20, 5], [10, 33, 17, 0], 1, 4, 32, 2, (32, 16), 16),
    "prefix_w40_default_tiles": ([19, 1, 6], [61, 30, 0], 2, 2, 64, None, None, 40),
    "w1_head_dim24": ([4, 1, 3], [6, 9, 0], 1, 3, 24, None, (16, 16), 1),
}


@pytest.mark.parametrize("case", list(WINDOW_CASES))
def test_paged_attention_sliding_window(case):
    """Against the reference; keys before every query's window are NaN in the kernel's cache,
    so a tile the kernel should have skipped would poison the output."""
    qlens, ctxs, hkv, gqa, d, splits, tiles, window = WINDOW_CASES[case]
    q, cache, meta = _paged_batch(qlens, ctxs, hkv, gqa, d, torch.float32, seed=7)
    ref = pa.paged_attention_ref(q, cache, meta, d**-0.5, sliding_window=window)
    poisoned = cache.clone()
    for i, c in enumerate(ctxs):
        for p in range(max(c - window + 1, 0)):  # out of reach of the request's first query
            poisoned[:, meta.block_table[i, p // 16], p % 16] = float("nan")
    config = pa.AttentionConfig(tiles[0], tiles[1], 4, 1) if tiles else None
    out = pa.paged_attention(
        q, poisoned, meta, d**-0.5, num_splits=splits, config=config, sliding_window=window
    )
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    full = pa.paged_attention_ref(q, cache, meta, d**-0.5)
    assert not torch.allclose(ref, full, atol=1e-3)  # the window did cut something


def test_reduce_splits():
    gen = torch.Generator().manual_seed(4)
    num_tokens, hq, splits, d = 3, 4, 5, 24
    parts = sk.SplitPartials.empty(num_tokens, hq, splits, 32, DEVICE)
    parts.row_max.copy_(_randn(num_tokens, hq, splits, dtype=torch.float32, gen=gen) * 4)
    parts.row_sum.copy_(_randn(num_tokens, hq, splits, dtype=torch.float32, gen=gen).abs() + 0.5)
    parts.acc.copy_(_randn(num_tokens, hq, splits, 32, dtype=torch.float32, gen=gen))
    parts.row_max[:, :, 1], parts.row_sum[:, :, 1], parts.acc[:, :, 1] = -1e30, 0, 0  # empty
    out = torch.full((num_tokens + 1, hq, d), 7.0, device=DEVICE)
    covered = torch.tensor([2], dtype=torch.int32, device=DEVICE)  # token 2 is padding
    sk.reduce_splits(parts, out[1:], covered, tok_base=0)
    ref = sk.reduce_splits_ref(parts, d)
    torch.testing.assert_close(out[1:3], ref[:2], atol=1e-5, rtol=1e-5)
    assert torch.equal(out[3], torch.zeros_like(out[3])) and torch.equal(out[0], out[0] * 0 + 7)
    # the end of the real tokens read from element covered_index of a longer table
    again = torch.full_like(out, 7.0)
    table = torch.tensor([9, 9, 1], dtype=torch.int32, device=DEVICE)  # token 0 only
    sk.reduce_splits(parts, again[1:], table, tok_base=0, covered_index=2)
    torch.testing.assert_close(again[1], ref[0], atol=1e-5, rtol=1e-5)
    assert not again[2:].any()


@pytest.mark.parametrize("window", [None, 8])
def test_compile_variants_runs_every_case_and_leaves_the_cache_alone(window):
    gen = torch.Generator().manual_seed(11)
    cache = _randn(2, 5, 16, 2, 64, dtype=torch.float16, gen=gen)
    before = cache.clone()
    assert tb.compile_variants(8, cache, 0.125, torch.float16, sliding_window=window) == 4
    assert torch.equal(cache, before)


class _SpecRecorder:
    """Stands in for a Triton kernel: records, per launch, what Triton specialises a compile
    on (constexprs and launch options by value; integers on == 1 and % 16 == 0; tensors on
    dtype and 16-byte alignment; minus ``do_not_specialize``), then launches the real one."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self.names = list(inspect.signature(kernel.fn).parameters)
        dns = getattr(kernel, "kwargs", {}).get("do_not_specialize") or getattr(
            kernel, "do_not_specialize", []
        )
        self.skip = {self.names[d] if isinstance(d, int) else d for d in dns}
        self.keys: set[tuple] = set()

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            key = []
            for name, v in [*zip(self.names, args), *sorted(kwargs.items())]:
                if name in self.skip or isinstance(v, float):
                    continue
                if isinstance(v, torch.Tensor):
                    key.append((name, v.dtype, v.data_ptr() % 16 == 0))
                elif isinstance(v, int) and not isinstance(v, bool) and not name.isupper():
                    key.append((name, v == 1, v % 16 == 0))
                else:
                    key.append((name, v))  # constexprs, launch options
            self.keys.add(tuple(key))
            return self.kernel[grid](*args, **kwargs)

        return launch


def test_serving_shaped_steps_launch_only_variants_compiled_at_start_up(monkeypatch):
    """Decode-only, decode-first mixed and prefill steps of random shapes, with the GPU's
    automatic split-KV choice emulated, launch no kernel variant that ``compile_variants``
    did not: on a GPU, none compiles in the middle of serving (sliced table pointers at an
    odd request offset, or a split count padded per step, each used to)."""
    from lightwell.kernels import split_kv as sk_mod

    attn = _SpecRecorder(pa._paged_attention_kernel)
    combine = _SpecRecorder(sk_mod._reduce_splits_kernel)
    monkeypatch.setattr(pa, "_paged_attention_kernel", attn)
    monkeypatch.setattr(sk_mod, "_reduce_splits_kernel", combine)
    hkv, gqa, d, block_size = 2, 2, 32, 16
    gen = torch.Generator().manual_seed(21)
    cache = _randn(2, 40, block_size, hkv, d, dtype=torch.float16, gen=gen)
    assert tb.compile_variants(hkv * gqa, cache, d**-0.5, torch.float16) == 4
    at_start = (set(attn.keys), set(combine.keys))
    # the GPU's choice: split long contexts when few programs (CPU would never split)
    monkeypatch.setattr(pa, "auto_num_splits", lambda progs, keys, dev: 1 + keys // 64)
    rng = random.Random(5)
    for step in range(12):
        decodes = rng.randint(0 if step % 3 == 2 else 1, 5)
        prompts = rng.randint(0 if decodes else 1, 3) if step % 3 else 0
        qlens = [1] * decodes + [rng.randint(2, 40) for _ in range(prompts)]
        ctxs = [rng.randint(1, 200) for _ in qlens]
        q, _, meta = _paged_batch(qlens, ctxs, hkv, gqa, d, torch.float16, block_size, seed=step)
        meta.block_table.random_(0, 40)  # any blocks of the shared cache
        pa.paged_attention(q, cache, meta, d**-0.5)
    assert attn.keys <= at_start[0], attn.keys - at_start[0]
    assert combine.keys <= at_start[1], combine.keys - at_start[1]
    assert len(combine.keys) == 1  # and the split combine did run


def test_runner_compiles_attention_variants_once_per_layer_shape():
    from types import SimpleNamespace

    from lightwell.layers.attention import Attention
    from lightwell.worker.runner_startup import compile_attention_variants

    layers = [Attention(4, 32, 0.2, 2, "triton", sliding_window=w) for w in (None, None, 6)]
    layers.append(Attention(4, 32, 0.2, 2, "torch"))  # no variants to compile
    for layer in layers:
        shape = layer.kv_cache_shape(3, 16)
        layer.kv_cache = torch.zeros(shape, dtype=torch.float16, device=DEVICE)
    runner = SimpleNamespace(attn_layers=layers, dtype=torch.float16)
    # two distinct shapes (the window differs) x four variants; the repeated layer adds none
    assert compile_attention_variants(runner) == 8


def test_paged_attention_ref_matches_sdpa():
    q, cache, meta = _paged_batch([13], [0], 2, 2, 32, torch.float32, block_size=4)
    ref = pa.paged_attention_ref(q, cache, meta, 0.2)
    blocks = meta.block_table[0, :4].long()
    k, v = (cache[i][blocks].reshape(-1, 2, 32)[:13] for i in (0, 1))
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=0.2,
        enable_gqa=True,
    )  # fmt: skip
    torch.testing.assert_close(ref, sdpa.transpose(0, 1), atol=1e-5, rtol=1e-5)


def test_paged_attention_rejects_bad_input():
    q, cache, meta = _paged_batch([2], [3], 1, 2, 32, torch.float32)
    with pytest.raises(ValueError, match="dtype"):
        pa.paged_attention(q.half(), cache, meta, 1.0)
    with pytest.raises(ValueError, match="tokens"):
        pa.paged_attention(q[:1], cache, meta, 1.0)


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("with_cache", [True, False])
def test_triton_backend_matches_torch_backend(with_cache, window):
    qlens, ctxs = ([1, 7, 4], [20, 9, 0]) if with_cache else ([6, 3], [0, 0])
    q, cache, meta = _paged_batch(qlens, ctxs, 2, 2, 32, torch.float32, seed=5)
    gen = torch.Generator().manual_seed(6)
    k = _randn(q.shape[0], 2, 32, dtype=torch.float32, gen=gen)
    v = _randn(q.shape[0], 2, 32, dtype=torch.float32, gen=gen)
    # slot of each new token: its position in its request's blocks
    slots = []
    for i, (n, c) in enumerate(zip(qlens, ctxs)):
        for p in range(c, c + n):
            slots.append(int(meta.block_table[i, p // 16]) * 16 + p % 16)
    meta.slot_mapping = torch.tensor(slots, dtype=torch.int64, device=DEVICE)
    c1, c2 = (cache.clone(), cache.clone()) if with_cache else (None, None)
    out = TritonAttentionBackend().forward(q, k, v, c1, meta, 0.25, sliding_window=window)
    ref = TorchAttentionBackend().forward(q, k, v, c2, meta, 0.25, sliding_window=window)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    if with_cache:
        torch.testing.assert_close(c1, c2, atol=0, rtol=0)


@pytest.mark.parametrize("fused", [True, False])
def test_attention_layer_rope_fused_with_the_store_matches_the_torch_path(monkeypatch, fused):
    """The Attention layer given ``rope``: on the Triton backend RoPE and the KV store are one
    launch (``stores_with_rope``) or, set off here, two; on the
    torch backend they stay apart. The same outputs and the same cache, for a decode, a
    cached-prefix chunk and a fresh prompt in one step."""
    from lightwell.layers.attention import Attention
    from lightwell.layers.rotary import RotaryEmbedding

    qlens, ctxs = [1, 7, 4], [20, 9, 0]
    hkv, gqa, d = 2, 2, 32
    _, cache, meta = _paged_batch(qlens, ctxs, hkv, gqa, d, torch.float32, seed=8)
    slots, pos = [], []
    for i, (n, c) in enumerate(zip(qlens, ctxs)):
        for p in range(c, c + n):
            slots.append(int(meta.block_table[i, p // 16]) * 16 + p % 16)
            pos.append(p)
    meta.slot_mapping = torch.tensor(slots, dtype=torch.int64, device=DEVICE)
    positions = torch.tensor(pos, device=DEVICE)
    rope = RotaryEmbedding(d, d, 64, 10000.0).to(DEVICE)
    monkeypatch.setattr(TritonAttentionBackend, "stores_with_rope", fused)
    gen = torch.Generator().manual_seed(9)
    qkv = _randn(len(pos), (hkv * gqa + 2 * hkv) * d, dtype=torch.float32, gen=gen)
    outs, caches = [], []
    for backend in ("triton", "torch"):
        layer = Attention(hkv * gqa, d, 0.25, hkv, backend)
        layer.kv_cache = cache.clone()
        q, k, v = qkv.clone().split([hkv * gqa * d, hkv * d, hkv * d], dim=-1)
        with forward_context(meta):
            outs.append(layer(q, k, v, rope=(rope, positions)))
        caches.append(layer.kv_cache)
    assert get_attention_backend("triton").stores_with_rope == fused
    assert not getattr(get_attention_backend("torch"), "stores_with_rope", False)
    torch.testing.assert_close(outs[0], outs[1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(caches[0], caches[1], atol=1e-5, rtol=1e-5)
    assert not torch.equal(caches[0], cache)  # the step's keys did go in


# (default tiles: up to 256 rows a router's, one row or several; 300 and 520 rows four warps)
@pytest.mark.parametrize(
    "m,n,k", [(1, 48, 96), (3, 40, 300), (4, 64, 520), (2, 7, 64), (1, 300, 96), (2, 520, 64)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gemv_matches_reference(m, n, k, dtype):
    from lightwell.kernels.gemv import gemv, gemv_ref

    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=g) * 0.1).to(DEVICE, dtype)
    b = torch.randn(n, generator=g).to(DEVICE, dtype)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    # default tile; one row a program with K in 32-wide tiles (uneven when K % 32); 16 rows
    for config in (None, (1, 32, 1, 1), (16, 64, 4, 2)):
        for bias in (None, b):
            out, ref = gemv(x, w, bias, config=config), gemv_ref(x, w, bias)
            assert out.dtype == dtype and out.shape == (m, n)
            torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
    # a strided x (a view into a wider buffer) and no rows at all
    wide = torch.randn(m, k + 8, generator=g).to(DEVICE, dtype)
    torch.testing.assert_close(
        gemv(wide[:, :k], w).float(), gemv_ref(wide[:, :k], w).float(), rtol=tol, atol=tol
    )
    assert gemv(x[:0], w).shape == (0, n)


def test_gemv_fp32_logits_of_an_fp32_weight():
    """A router's fp32 weight on fp16 activations, fp32 out: F.linear(x.float(), w)."""
    from lightwell.kernels.gemv import gemv

    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 200, generator=g).to(DEVICE, torch.float16)
    w = torch.randn(12, 200, generator=g).to(DEVICE)
    out = gemv(x, w, out_dtype=torch.float32)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, torch.nn.functional.linear(x.float(), w), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("m,n,k", [(1, 40, 64), (3, 24, 300)])
def test_gemv_silu_mul_equals_activation_then_gemv(m, n, k):
    from lightwell.kernels.activation import silu_and_mul
    from lightwell.kernels.gemv import gemv, gemv_ref

    g = torch.Generator().manual_seed(n + k)
    gate_up = (torch.randn(m, 2 * k, generator=g) * 2).to(DEVICE, torch.float16)
    w = (torch.randn(n, k, generator=g) * 0.1).to(DEVICE, torch.float16)
    b = torch.randn(n, generator=g).to(DEVICE, torch.float16)
    act = silu_and_mul(gate_up)  # the two-kernel path: activation stored in fp16, then matmul
    for config in (None, (1, 32, 1, 1)):
        fused = gemv(gate_up, w, b, config=config, silu_mul=True)
        torch.testing.assert_close(fused, gemv(act, w, b, config=config), rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(fused.float(), gemv_ref(act, w, b).float(), rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="mismatch"):
        gemv(act, w, silu_mul=True)  # [M, K] is not a [gate | up] of 2K


# (bf16 where it runs compiled: the interpreter's bf16 arithmetic is inexact)
@pytest.mark.parametrize("m,n,k", [(1, 40, 64), (3, 7, 300), (2, 24, 520)])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize(
    "dtype", [torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else []), ids=str
)
def test_gemv_add_norm_equals_the_norm_then_the_gemv(m, n, k, with_residual, dtype):
    """The residual add + RMSNorm inside the gemv (``gemv_add_norm``): the residual sum bit for
    bit as the norm kernel's, the normalised rows (when written) within an ulp of its (rstd's
    last bit), the product the gemv's of the norm kernel's rows but for those ulps; the tile
    and the PDL form (K in one tile, several, uneven) change nothing else."""
    from lightwell.kernels.gemv import gemv, gemv_add_norm, gemv_ref
    from lightwell.kernels.rmsnorm import fused_add_rmsnorm, rmsnorm, rmsnorm_ref

    g = torch.Generator().manual_seed(m * 100 + n + k)
    x = (torch.randn(m, k, generator=g) * 3).to(DEVICE, dtype)
    res = torch.randn(m, k, generator=g).to(DEVICE, dtype) if with_residual else None
    nw = (1 + 0.5 * torch.randn(k, generator=g)).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=g) * 0.1).to(DEVICE, dtype)
    tol = 2e-3 if dtype == torch.float16 else 1.6e-2
    if with_residual:
        normed, summed = fused_add_rmsnorm(x, res, nw, 1e-5)
    else:
        normed, summed = rmsnorm(x, nw, 1e-5), x
    ref = gemv_ref(rmsnorm_ref(summed, nw, 1e-5), w).float()
    for config in (None, (1, 32, 1, 1), (4, 128, 2, 2)):
        for pdl, write_normed in ((False, True), (True, True), (False, False), (True, False)):
            res_out = torch.full_like(x, 7.0) if with_residual else None
            normed_out = torch.full_like(x, 7.0) if write_normed else None
            out = gemv_add_norm(x, res, nw, 1e-5, w, residual_out=res_out, normed_out=normed_out,
                                config=config, pdl=pdl)  # fmt: skip
            if with_residual:
                assert torch.equal(res_out, summed), config
            if write_normed:
                torch.testing.assert_close(normed_out, normed, rtol=tol, atol=tol)
                assert (normed_out != normed).float().mean() < 0.02, config  # rare ulps only
            plain = gemv(normed, w, config=config).float()
            torch.testing.assert_close(out.float(), plain, rtol=tol, atol=tol)
            torch.testing.assert_close(out.float(), ref, rtol=5e-2, atol=5e-2)
    # x a view into a wider buffer: the same bits
    wide = torch.zeros(m, k + 8, dtype=dtype, device=DEVICE)
    wide[:, :k] = x
    res_out = torch.empty_like(x) if with_residual else None
    args = dict(residual_out=res_out, normed_out=torch.empty_like(x))
    assert torch.equal(gemv_add_norm(wide[:, :k], res, nw, 1e-5, w, **args),
                       gemv_add_norm(x, res, nw, 1e-5, w, **args))  # fmt: skip
    # without normed_out nothing else is written; fp32 logits of an fp32 weight (a router's)
    w32 = w.float()
    out = gemv_add_norm(x, res, nw, 1e-5, w32, residual_out=torch.empty_like(x) if res is not None
                        else None, out_dtype=torch.float32)  # fmt: skip
    torch.testing.assert_close(out, normed.float() @ w32.t(), rtol=5e-3, atol=5e-3)
    with pytest.raises(ValueError, match="residual_out"):
        gemv_add_norm(x, res if res is not None else x, nw, 1e-5, w)
    with pytest.raises(ValueError, match="norm weight"):
        gemv_add_norm(x, None, nw[:-1], 1e-5, w)
    with pytest.raises(ValueError, match="must not be"):  # in place: other programs read x
        gemv_add_norm(x, None, nw, 1e-5, w, normed_out=x)


def test_gemv_rejects_bad_shapes():
    from lightwell.kernels.gemv import MAX_M, gemv

    w = torch.randn(8, 16)
    with pytest.raises(ValueError, match="at most"):
        gemv(torch.randn(MAX_M + 1, 16), w)
    with pytest.raises(ValueError, match="mismatch"):
        gemv(torch.randn(1, 12), w)
    with pytest.raises(ValueError, match="bias shape"):
        gemv(torch.randn(1, 16), w, torch.randn(7))


@pytest.mark.parametrize("m,n,k", [(1, 40, 64), (2, 7, 300), (1, 48, 16), (3, 24, 520)])
@pytest.mark.parametrize("silu_mul", [False, True])
def test_gemv_early_weight_load_gives_the_same_bits(m, n, k, silu_mul):
    """PDL's form of the gemv (kernels/pdl.py: the first K tile of W loaded before x, the loop
    peeled) adds the same products in the same order as the plain form: equal bits, K shorter
    than, equal to, and several tiles, even and uneven."""
    from lightwell.kernels.gemv import gemv, gemv_ref

    g = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k * (1 + silu_mul), generator=g).to(DEVICE, torch.float16)
    w = (torch.randn(n, k, generator=g) * 0.1).to(DEVICE, torch.float16)
    b = torch.randn(n, generator=g).to(DEVICE, torch.float16)
    for config in (None, (1, 32, 1, 1), (4, 128, 2, 2)):
        for bias in (None, b):
            plain = gemv(x, w, bias, config=config, silu_mul=silu_mul, pdl=False)
            early = gemv(x, w, bias, config=config, silu_mul=silu_mul, pdl=True)
            assert torch.equal(early, plain), (config, bias is None)
    if not silu_mul:
        torch.testing.assert_close(early.float(), gemv_ref(x, w, b).float(), rtol=2e-2, atol=2e-2)


def test_pdl_is_on_by_default_but_never_on_cpu(monkeypatch):
    from lightwell.config import DeviceConfig
    from lightwell.kernels import pdl

    assert DeviceConfig().pdl and pdl._enabled  # the config's default, and the module's
    assert not pdl.use_pdl(torch.device("cpu"))  # the interpreter has no grid dependency ops
    for rows in (1, 5):  # on an sm_90 GPU, the norm's PDL form (a decode row, a prefill)
        x = torch.randn(rows, 64, device=DEVICE)
        w = torch.randn(64, device=DEVICE)
        torch.testing.assert_close(rn.rmsnorm(x, w, 1e-6), rn.rmsnorm_ref(x, w, 1e-6))
    monkeypatch.setattr(pdl, "device_supports", lambda device: True)  # as on an sm_90 GPU
    gpu = torch.device("cuda", 0)
    assert pdl.use_pdl(gpu)
    monkeypatch.setattr(pdl, "_enabled", True)  # restored after the test
    pdl.set_enabled(False)  # --no-pdl
    assert not pdl.use_pdl(gpu)
    pdl.set_enabled(True)
    assert pdl.use_pdl(gpu)
    assert pdl.launch_options(True) == {"launch_pdl": True} and pdl.launch_options(False) == {}


# ---- int8 all-reduce kernels vs the torch ops of lightwell/experimental/comm/int8_nccl.py ----
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
# (2,400, 2, 1,280): 10 groups a row: two programs of GROUPS_PER_PROGRAM (8), the second
# holding 2 groups (the rest masked)
@pytest.mark.parametrize(
    "n,rows,cols", [(512, 2, 256), (700, 2, 384), (1000, 4, 256), (2400, 2, 1280)]
)
def test_int8_pack_kernels_match_torch_ops(n, rows, cols, dtype):
    from lightwell.experimental.comm import int8_nccl as ref

    assert i8.GROUP == ref.GROUP
    gen = torch.Generator().manual_seed(n)
    x = _randn(n, dtype=dtype, gen=gen) * 3
    x[5] = 40.0  # an outlier: its group gets a coarse step
    padded = torch.nn.functional.pad(x.float(), (0, rows * cols - n)).view(rows, cols)
    # quantize + pack: the same bytes (no value of random data sits on a rounding tie)
    got = i8.quantize_pack(x, rows, cols)
    want = ref.pack(*ref.quantize(padded))
    assert got.shape == want.shape and got.dtype == torch.uint8
    assert torch.equal(got, want)
    # dequantize, sum the chunks in fp32, requantize: within one rounding of the exact sum
    summed = i8.dequant_sum_requant(got, cols)  # [1, bytes]
    exact = ref.dequantize(*ref.unpack(want, cols)).sum(0, keepdim=True)  # [1, cols]
    back = ref.dequantize(*ref.unpack(summed, cols))
    step = exact.view(-1, ref.GROUP).abs().amax(-1).repeat_interleave(ref.GROUP) / 127
    assert ((back - exact).abs().view(-1) <= step / 2 * 1.0001 + 1e-7).all()
    assert back.abs().max() > 1.0  # real values, not zeros
    # unpack + dequantize into the output dtype, cut to n elements
    out = i8.unpack_dequant(got, cols, n, dtype)
    assert out.shape == (n,) and out.dtype == dtype
    torch.testing.assert_close(out, ref.dequantize(*ref.unpack(want, cols)).view(-1)[:n].to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_int8_dequant_sum_into_out(dtype):
    """hostmem-copy-int8's sum: each rank's packed rows (quantized into a row of a stage buffer
    wider than they need), dequantized and added in rank order in fp32, into out[:n]."""
    n, rows, cols, world = 4000, 4, 1280, 3  # 10 groups a row: two programs of 8
    rb = i8.packed_row_bytes(cols)
    stage = torch.full((world, rows * rb + 4 * 40), 7, dtype=torch.uint8, device=DEVICE)
    gen = torch.Generator().manual_seed(9)
    xs = [_randn(n, dtype=dtype, gen=gen) * (r + 1) for r in range(world)]
    for r, x in enumerate(xs):
        i8.quantize_pack(x, rows, cols, out=stage[r][: rows * rb].view(rows, rb))
    want = sum(i8.unpack_dequant(stage[r][: rows * rb].view(rows, rb), cols, n, torch.float32)
               for r in range(world))  # fmt: skip
    out = torch.zeros(n, dtype=dtype, device=DEVICE)
    assert i8.dequant_sum(stage, cols, rows, out) is out
    torch.testing.assert_close(out, want.to(dtype), rtol=1e-6, atol=1e-6)
    exact = sum(x.float() for x in xs)
    assert (out.float() - exact).norm() / exact.norm() < 0.01  # one rounding a rank


def test_int8_pack_aligned_sizes_take_the_same_values():
    """Sizes that are multiples of 16 (hostmem-copy-int8's rows: multiples of 512 elements)
    take the kernels' ALIGN form, which rounds them down to a multiple of 16 inside: the
    same bytes and sums as the torch ops."""
    from lightwell.experimental.comm import int8_nccl as ref

    n, rows, cols, world = 1536 + 512, 4, 512, 2  # 4 rows of 4 groups; the last row: zeros
    rb = i8.packed_row_bytes(cols)
    assert i8.aligned(n, rb, cols) and not i8.aligned(n + 1, rb, cols)  # (528-byte rows)
    gen = torch.Generator().manual_seed(3)
    xs = [_randn(n, dtype=torch.float32, gen=gen) * (r + 1) for r in range(world)]
    stage = torch.zeros((world, rows * rb), dtype=torch.uint8, device=DEVICE)
    for r, x in enumerate(xs):
        i8.quantize_pack(x, rows, cols, out=stage[r].view(rows, rb))
        padded = torch.nn.functional.pad(x.float(), (0, rows * cols - n)).view(rows, cols)
        assert torch.equal(stage[r].view(rows, rb), ref.pack(*ref.quantize(padded)))
    out = i8.dequant_sum(stage, cols, rows, torch.empty(n, device=DEVICE))
    want = sum(ref.dequantize(*ref.unpack(stage[r].view(rows, rb), cols)).view(-1)[:n]
               for r in range(world))  # fmt: skip
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)


def test_int8_pack_rejects_bad_input():
    x = torch.ones(300, device=DEVICE)
    with pytest.raises(ValueError, match="multiple of 128"):
        i8.quantize_pack(x, 2, 100)
    with pytest.raises(ValueError, match="fit"):
        i8.quantize_pack(x, 1, 256)
    with pytest.raises(ValueError, match="packed buffer"):
        i8.dequant_sum_requant(torch.zeros(2, 10, dtype=torch.uint8, device=DEVICE), 128)
    with pytest.raises(ValueError, match="out must be"):
        i8.quantize_pack(x, 3, 128, out=torch.zeros(2, 132, dtype=torch.uint8, device=DEVICE))
    with pytest.raises(ValueError, match="stage"):
        i8.dequant_sum(torch.zeros(2, 100, dtype=torch.uint8, device=DEVICE), 128, 1, x)


def test_int8_pack_grids_put_groups_on_axis_0(monkeypatch):
    """An 8,192-token message (x 4096, 2 ranks) has 131,072 groups a chunk, above CUDA's
    65,535 cap on grid axes 1 and 2: groups must be axis 0 (the H200 run failed there)."""
    grids = []

    class Recorder:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            grids.append(grid)
            return self.kernel[grid]

    for name in ("_quantize_pack_kernel", "_unpack_dequant_kernel"):
        monkeypatch.setattr(i8, name, Recorder(getattr(i8, name)))
    x = torch.randn(3 * 512, device=DEVICE)
    buf = i8.quantize_pack(x, 3, 512)
    i8.unpack_dequant(buf, 512, x.numel(), torch.float32)
    groups = 512 // i8.GROUP
    assert grids == [(-(-groups // i8.GROUPS_PER_PROGRAM), 3), (groups, 3)]


# The PTX of the all-reduce kernels, compiled for sm_90 on this (GPU-less) machine: a separate
# process, since this module's kernels are the interpreter's.
_PTX_SCRIPT = r"""
import collections, json, re, sys, triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from lightwell.kernels import hostmem_allreduce as hm, int8_pack as i8

def memory_ops(fn, types, consts, warps):
    sig = dict(types, **{k: "constexpr" for k in consts})
    attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(types.values()) if "*" in t}
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    return dict(collections.Counter(re.findall(r"\b(?:ld|st)\.global[.\w]*", ptx.asm["ptx"])))

align = sys.argv[1] == "1"
sizes = {k: "i32" for k in ("n", "row_bytes", "cols")}
tile = {"GROUP": 128, "GPP": 16, "ALIGN": align}
out = {
    "quantize": memory_ops(i8._quantize_pack_kernel, {"x_ptr": "*bf16", "q_ptr": "*i8",
                           "s_ptr": "*fp32", **sizes}, tile, 4),
    "sum": memory_ops(i8._dequant_sum_kernel, {"q_ptr": "*i8", "s_ptr": "*fp32",
                      "out_ptr": "*bf16", "n": "i32", "world": "i32", "rank_stride": "i32",
                      "row_bytes": "i32", "cols": "i32"}, tile, 4),
    "hostmem": memory_ops(hm._hostmem_all_reduce_kernel, {
        "x_ptr": "*bf16", "out_ptr": "*bf16", "slot_ptr": "*i8", "scale_ptr": "*fp32",
        "flag_ptr": "*i32", "epoch_ptr": "*i32", "status_ptr": "*i32", "res_ptr": "*bf16",
        "res_out_ptr": "*bf16", "w_ptr": "*bf16", "eps": "fp32", "n": "i32", "rank": "i32",
        "max_spin": "i32"}, dict(SLOT_ELEMS=1 << 22, MAX_BLOCKS=4096, WORLD=2, BLOCK=4096,
        GROUP=128, INT8=True, ASM=True, NORM=True, HIDDEN=4096, ALIGN=align), 8),
    "hostmem_ll": memory_ops(hm._hostmem_ll_kernel, {
        "x_ptr": "*bf16", "out_ptr": "*bf16", "slot_ptr": "*i64", "dst_ptr": "*i64",
        "epoch_ptr": "*i32",
        "status_ptr": "*i32", "res_ptr": "*bf16", "res_out_ptr": "*bf16", "w_ptr": "*bf16",
        "eps": "fp32", "n": "i32", "rank": "i32", "max_spin": "i32"}, dict(SLOT_WORDS=1 << 16,
        WPB=2048, WORLD=2, BLOCK=4096, GROUP=128, INT8=False, COMP=2, INT_TY=tl.int16, ASM=True,
        NORM=True, HIDDEN=4096, ALIGN=align), 8),
}
print(json.dumps(out))
"""


def _run_ptx_script(script: str, flag: bool) -> dict:
    """Run one of the scripts below (compiles kernels for sm_90, no GPU needed) in a process
    of its own, without the interpreter, with argument "1" / "0"; its last line, as JSON."""
    import json
    import subprocess
    import sys

    import triton.backends

    if "nvidia" not in triton.backends.backends:
        pytest.skip("this Triton has no NVIDIA backend to compile PTX with")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", script, "1" if flag else "0"], env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _ptx_memory_ops(align: bool) -> dict:
    return _run_ptx_script(_PTX_SCRIPT, align)


def test_all_reduce_kernels_move_16_byte_vectors_when_aligned():
    """Sizes are unspecialised (no recompiles per message), which left every element of the
    int8 quantize / sum and of the hostmem kernels' device side its own 1- or 2-byte load and
    store (the H200: 10.5 vs 5.3 us for a 1,024 x 4,096 quantize). With the ALIGN form the
    bf16 / int8 tensors move as 16-byte vectors: no 1- or 2-byte global access is left."""
    aligned, plain = _ptx_memory_ops(True), _ptx_memory_ops(False)
    for name, ops in aligned.items():
        narrow = {op: k for op, k in ops.items() if op.endswith((".b8", ".b16"))}
        assert not narrow, (name, ops)
        assert any(".v4." in op for op in ops), (name, ops)
    # what the hint is for: without it the same kernels move bytes one element at a time
    assert plain["quantize"].get("ld.global.b16", 0) > 0
    assert plain["sum"].get("st.global.b16", 0) > 0


# The kernels that take part in programmatic dependent launch (kernels/pdl.py), compiled for sm_90
# here: what each does before its grid dependency wait, in PTX order.
_PDL_PTX_SCRIPT = r"""
import inspect, json, re, sys, triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from lightwell.kernels import gemv as gv, paged_attention as pa
from lightwell.kernels import rmsnorm as rn

def ops(fn, types, consts, **options):
    names = list(inspect.signature(fn.fn).parameters)
    sig = {n: types.get(n, "i32") for n in names if n not in consts}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if n in sig and n != "M" and sig[n] not in ("fp32",)}
    src = triton.compiler.ASTSource(fn=fn, signature=dict(sig, **{k: "constexpr" for k in consts}),
                                    constexprs=consts, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    found = re.findall(r"\b(griddepcontrol\.\w+|[ls][dt]\.global[.\w]*|atom\.[.\w]*|red\.[.\w]*)",
                       k.asm["ptx"])
    return {"ops": found, "launch_pdl": bool(k.metadata.launch_pdl)}

on = sys.argv[1] == "1"
b16 = {n: "*bf16" for n in ("x_ptr", "w_ptr", "b_ptr", "out_ptr", "res_ptr", "res_out_ptr",
                            "q_ptr", "k_cache_ptr", "v_cache_ptr", "r_ptr", "nw_ptr",
                            "normed_ptr")}
gv_types = dict(b16, eps="fp32")
plain = dict(NORM=False, HAS_RES=False, WRITE_NORMED=False)
out = {}
for silu in (False, True):
    out[f"gemv{'_silu' if silu else ''}"] = ops(gv._gemv_kernel, gv_types, dict(
        BLOCK_M=1, BLOCK_N=2, BLOCK_K=1024, EVEN_K=True, HAS_BIAS=False, SILU_MUL=silu,
        EARLY_W=on, GDC=on, **plain), num_warps=1, num_stages=3, launch_pdl=on)
out["gemv_m4_bias_uneven_k"] = ops(gv._gemv_kernel, gv_types, dict(
    BLOCK_M=4, BLOCK_N=8, BLOCK_K=256, EVEN_K=False, HAS_BIAS=True, SILU_MUL=False,
    EARLY_W=on, GDC=on, **plain), num_warps=4, num_stages=1, launch_pdl=on)
for normed in (False, True):
    out[f"gemv_add_norm{'_normed' if normed else ''}"] = ops(gv._gemv_kernel, gv_types, dict(
        BLOCK_M=1, BLOCK_N=8, BLOCK_K=1024, EVEN_K=True, HAS_BIAS=False, SILU_MUL=False,
        EARLY_W=on, GDC=on, NORM=True, HAS_RES=True, WRITE_NORMED=normed), num_warps=4,
        num_stages=1, launch_pdl=on)
out["rmsnorm"] = ops(rn._rmsnorm_kernel, dict(b16, eps="fp32"), dict(
    HIDDEN=4096, BLOCK=4096, HAS_RESIDUAL=True, GDC=on), num_warps=8, launch_pdl=on)
out["attention"] = ops(pa._paged_attention_kernel, dict(b16, qk_scale="fp32", **{
    n: "*fp32" for n in ("part_acc_ptr", "part_m_ptr", "part_l_ptr")}, **{n: "*i32" for n in (
    "qsl_ptr", "seq_lens_ptr", "block_table_ptr")}), dict(GQA=4, HEAD_DIM=128,
    HEAD_DIM_PAD=128, BLOCK_SIZE=16, BLOCK_M=16, BLOCK_Q=1, BLOCK_N=64, SPLIT_KV=True,
    SLIDING=False, ONE_TILE_PER_REQ=True, PAD_D=False,
    DOT_PREC="tf32", PDL_SIGNAL=on, KV_QUANT=False, F16_DOT=False), num_warps=4, num_stages=1)
print(json.dumps(out))
"""


_PDL_MLA_MOE_SCRIPT = (
    _PDL_PTX_SCRIPT.split("on = sys.argv")[0]
    + r"""
from lightwell.kernels import mla_decode as md, mla_output as mo, mla_prepare as mp
from lightwell.kernels import moe_gemv as mg, moe_router as mr
from lightwell.kernels import argmax as am

on = sys.argv[1] == "1"
bf = "*bf16"
mla = dict(LATENT=512, BLOCK_L=512)
out = {
    "argmax": ops(am._argmax_kernel, dict(x_ptr=bf, key_ptr="*i32", idx_ptr="*i32",
        cnt_ptr="*i32", out_ptr="*i64"), dict(PIECE=4096, PIECES=32, FENCE=True, GDC=on),
        num_warps=4, launch_pdl=on),
    "router": ops(mr._moe_router_kernel, dict(logits_ptr="*fp32", bias_ptr="*fp32",
        weights_ptr="*fp32", ids_ptr="*i64", scaling="fp32"), dict(TOP_K=6, BLOCK_KP=8,
        NUM_GROUPS=1, TOPK_GROUPS=1, TOP2_GROUPS=False, BLOCK_G=1, BLOCK_EG=64, SIGMOID=False,
        HAS_BIAS=False, RENORMALIZE=False, GDC=on), num_warps=1, launch_pdl=on),
    "gate_up": ops(mg._moe_gemv_gate_up, dict(x_ptr=bf, w_ptr=bf, ids_ptr="*i64", out_ptr=bf),
        dict(BLOCK_N=1, BLOCK_K=1024, EVEN_K=True, EARLY=on, GDC=on), num_warps=2,
        launch_pdl=on),
    "down": ops(mg._moe_gemv_down, dict(a_ptr=bf, w_ptr=bf, ids_ptr="*i64",
        weight_ptr="*fp32", out_ptr=bf), dict(BLOCK_N=4, BLOCK_K=1024, EVEN_K=True, GDC=on),
        num_warps=4, launch_pdl=on),
    "down_pairs": ops(mg._moe_gemv_down_pairs, dict(a_ptr=bf, w_ptr=bf, ids_ptr="*i64",
        weight_ptr="*fp32", out_ptr=bf), dict(PAIRS=8, BLOCK_N=8, BLOCK_K=256, EVEN_K=False,
        GDC=on), num_warps=8, num_stages=1, launch_pdl=on),
    "down_split": ops(mg._moe_gemv_down_split, dict(a_ptr=bf, w_ptr=bf, ids_ptr="*i64",
        weight_ptr="*fp32", part_ptr="*fp32", cnt_ptr="*i32", out_ptr=bf), dict(BLOCK_N=16,
        BLOCK_K=256, EVEN_K=False, FENCE=True, GDC=on), num_warps=1, num_stages=3,
        launch_pdl=on),
    "mla_decode": ops(md._mla_decode_kernel, dict(q_ptr=bf, cache_ptr=bf,
        block_table_ptr="*i32", seq_lens_ptr="*i32", part_ptr="*fp32", lse_ptr="*fp32",
        out_ptr=bf, scale="fp32"), dict(mla, BLOCK_SIZE=16, ROPE=64, BLOCK_P=64, BLOCK_H=16,
        BLOCK_S=32, DOT_PREC="tf32", SPLIT=True, KV_QUANT=0, GDC=on), num_warps=4,
        num_stages=2, launch_pdl=on),
    "mla_decode_fp8": ops(md._mla_decode_kernel, dict(q_ptr=bf, cache_ptr="*fp8e4nv",
        block_table_ptr="*i32", seq_lens_ptr="*i32", part_ptr="*fp32", lse_ptr="*fp32",
        out_ptr=bf, scale="fp32"), dict(mla, BLOCK_SIZE=16, ROPE=64, BLOCK_P=64, BLOCK_H=16,
        BLOCK_S=32, DOT_PREC="tf32", SPLIT=True, KV_QUANT=1, GDC=on), num_warps=4,
        num_stages=2, launch_pdl=on),
    "combine": ops(md._combine_kernel, dict(part_ptr="*fp32", lse_ptr="*fp32", out_ptr=bf),
        dict(mla, BLOCK_SPLITS=32, GDC=on), num_warps=4, launch_pdl=on),
    "absorb_few": ops(mo._absorb_few_kernel, dict(o_ptr=bf, lse_ptr=bf, w_ptr=bf, out_ptr=bf),
        dict(NOPE=128, VDIM=128, LATENT=512, BLOCK_L=512, BLOCK_V=16, COMBINE=False,
        BLOCK_SPLITS=1, GDC=on), num_warps=4, launch_pdl=on),
    "absorb_few_combine": ops(mo._absorb_few_kernel, dict(o_ptr="*fp32", lse_ptr="*fp32",
        w_ptr=bf, out_ptr=bf), dict(NOPE=128, VDIM=128, LATENT=512, BLOCK_L=512, BLOCK_V=16,
        COMBINE=True, BLOCK_SPLITS=32, GDC=on), num_warps=4, launch_pdl=on),
    "absorb": ops(mo._absorb_output_kernel, dict(o_ptr=bf, w_ptr=bf, out_ptr=bf), dict(
        NOPE=128, VDIM=128, LATENT=512, BLOCK_V=32, BLOCK_T=16, BLOCK_R=128, PREC="tf32",
        GDC=on), num_warps=4, launch_pdl=on),
    "prepare": ops(mp._prepare_kernel, dict(q_ptr=bf, kv_ptr=bf, norm_ptr=bf, w_ptr=bf,
        pos_ptr="*i64", cs_ptr="*fp32", out_ptr=bf, cache_ptr=bf, slot_ptr="*i64", eps="fp32"),
        dict(mla, HEADS=16, NOPE=128, ROPE=64, VDIM=128, BLOCK_N=128, BLOCK_T=16, BLOCK_R=128,
        HALF_PAD=32, IS_NEOX=False, PREC="tf32", BLOCK_SIZE=16, KV_QUANT=0, INTERPRET=False,
        GDC=on), num_warps=4, launch_pdl=on),
    "prepare_fp8": ops(mp._prepare_kernel, dict(q_ptr=bf, kv_ptr=bf, norm_ptr=bf, w_ptr=bf,
        pos_ptr="*i64", cs_ptr="*fp32", out_ptr=bf, cache_ptr="*fp8e4nv", slot_ptr="*i64",
        eps="fp32"), dict(mla, HEADS=16, NOPE=128, ROPE=64, VDIM=128, BLOCK_N=128, BLOCK_T=16,
        BLOCK_R=128, HALF_PAD=32, IS_NEOX=False, PREC="tf32", BLOCK_SIZE=16, KV_QUANT=1,
        INTERPRET=False, GDC=on), num_warps=4, launch_pdl=on),
}
print(json.dumps(out))
"""
)


@pytest.mark.parametrize("on", [True, False])
def test_mla_and_moe_decode_kernels_wait_before_touching_the_step(on):
    """The MLA (over a bf16 and an fp8 latent cache) and MoE decode kernels, and the greedy
    argmax after the LM head, with PDL on: each waits before any store; all but the
    router signal only after their (first) wait (the down kernel's early read of the router's
    ids relies on the gate/up kernel doing so), the router before it, so the gate/up kernel's
    shared-expert tiles load under it; the router, loop-down, attention, combine and argmax kernels
    load nothing before the wait, the gate/up kernel weights only; the pairs and split down
    kernels read the ids through L2 (``.cg``). Off, none of it is compiled in."""
    kernels = _run_ptx_script(_PDL_MLA_MOE_SCRIPT, on)
    assert len(kernels) == 14
    for name, got in kernels.items():
        found = got["ops"]
        if not on:
            assert not any(op.startswith("griddep") for op in found), (name, found)
            assert not got["launch_pdl"], name
            continue
        assert got["launch_pdl"] and "griddepcontrol.wait" in found, (name, found)
        wait = found.index("griddepcontrol.wait")
        before = found[:wait]
        if name == "router":
            assert before == ["griddepcontrol.launch_dependents"], found
            continue
        early_writes = ("st.", "atom.", "red.", "griddep")
        assert not any(op.startswith(early_writes) for op in before), (name, found)
        assert "griddepcontrol.launch_dependents" in found[wait:], (name, found)
        if name in ("down", "mla_decode", "mla_decode_fp8", "combine", "argmax"):
            assert not before, (name, found)
        elif name == "gate_up":  # the shared experts' first gate and up tiles, 16-byte vectors
            assert before == ["ld.global.v4.b32"] * 4, found  # (1 row x 1,024 x 2 / 64 threads)
        elif name in ("down_pairs", "down_split"):
            assert "ld.global.cg.b64" in before or any(".cg" in op for op in before), found
        else:  # absorb, prepare(_fp8): the first weight chunk; absorb_few(_combine): W_UV
            assert any(op.startswith("ld.global") for op in before), (name, found)


@pytest.mark.parametrize("on", [True, False])
def test_pdl_kernels_wait_before_touching_what_the_kernel_before_wrote(on):
    """With PDL on, the gemv (with the residual add + norm too) signals and loads only
    weights (16-byte vectors) before its single wait, and stores after it; the norm waits
    before any access; the decode attention kernel only signals, first thing. Off, none of it
    is compiled in."""
    kernels = _run_ptx_script(_PDL_PTX_SCRIPT, on)
    for name, got in kernels.items():
        found = got["ops"]
        pdl_ops = [op for op in found if op.startswith("griddep")]
        if not on:
            assert not pdl_ops and not got["launch_pdl"], (name, found)
            continue
        if name == "attention":
            assert pdl_ops == ["griddepcontrol.launch_dependents"] and found[0] == pdl_ops[0]
            continue
        assert got["launch_pdl"], name
        assert found.count("griddepcontrol.wait") == 1, (name, found)
        wait = found.index("griddepcontrol.wait")
        before, after = found[:wait], found[wait + 1 :]
        assert "griddepcontrol.launch_dependents" in before, (name, found)
        assert not any(op.startswith("st.") for op in before), (name, found)
        assert any(op.startswith("st.") for op in after), (name, found)
        if name == "rmsnorm":
            assert before == ["griddepcontrol.launch_dependents"], found
        else:  # weight loads only, then x and the other tiles
            assert any(op.startswith("ld.") for op in before)
            assert all(op.startswith(("griddep", "ld.global")) for op in before)
            assert any(op.startswith("ld.global") for op in after)
            if name != "gemv_m4_bias_uneven_k":  # 2 rows x 1,024 bf16 / 32 threads, 16 B each
                assert before.count("ld.global.v4.b32") == 8, found
