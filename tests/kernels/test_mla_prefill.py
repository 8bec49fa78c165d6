"""The expanded MLA prefill (attention/mla_prefill.py: latents through kv_b_proj, the paged
attention kernel) vs the absorbed torch path (attend_latent, then W_UV) on a tiny latent
layer: a decode, a fresh prompt, a chunk after a cached prefix, a single-token request after
them (the decode kernel's, as the first); scattered blocks, a NaN-poisoned cache outside the
requests' entries; one pass, and passes split by requests and by heads. CPU under
TRITON_INTERPRET=1 (fp32, fp16), compiled on CUDA."""

from __future__ import annotations

import pytest
import torch

from lightwell.attention.metadata import forward_context
from lightwell.attention.mla_prefill import (
    expanded_prefill,
    leading_decodes,
    plan_groups,
    split_step,
)
from lightwell.attention.mla_torch import attend_latent
from lightwell.layers.mla import LatentAttention, MLAttention
from tests.kernels.interpreter import DEVICE
from tests.models.paged import build_metadata

RANK, ROPE, NOPE, VDIM, HEADS, BLOCK = 32, 8, 16, 12, 3, 4
DIMS = (NOPE, ROPE, VDIM)
SCALE = 0.3
TOL = {torch.float32: 1e-4 if DEVICE == "cpu" else 2e-2, torch.float16: 5e-3}
# (query_len, seq_len): a decode, a fresh prompt, a chunk after 9 cached, one token after 10
REQUESTS = [(1, 6), (7, 7), (5, 14), (1, 11)]


def _step(dtype: torch.dtype, seed: int):
    """A step's metadata, queries, entries, kv_b weight and a cache holding every request's
    cached prefix (NaN elsewhere)."""
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(24, generator=gen).tolist()
    tables, used = [], 0
    for _, length in REQUESTS:
        n = -(-length // BLOCK)
        tables.append(perm[used : used + n])
        used += n
    meta, _ = build_metadata([q for q, _ in REQUESTS], [s for _, s in REQUESTS], tables, BLOCK,
                             torch.device(DEVICE))  # fmt: skip
    cache = torch.full((1, 24, BLOCK, 1, RANK + ROPE), float("nan"))
    flat = cache.view(-1, RANK + ROPE)
    for (q_len, length), blocks in zip(REQUESTS, tables):
        for pos in range(length - q_len):
            slot = blocks[pos // BLOCK] * BLOCK + pos % BLOCK
            flat[slot] = torch.randn(RANK + ROPE, generator=gen)
    tokens = meta.num_tokens
    rnd = lambda *shape: torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)  # noqa: E731
    q_nope, q_pe = rnd(tokens, HEADS, NOPE), rnd(tokens, HEADS, ROPE)
    entry = rnd(tokens, RANK + ROPE)
    w = (torch.randn(HEADS * (NOPE + VDIM), RANK, generator=gen) / 4).to(dtype).to(DEVICE)
    return meta, q_nope, q_pe, entry, w, cache.to(dtype).to(DEVICE)


def _absorbed(meta, q_nope, q_pe, entry, w, cache) -> torch.Tensor:  # [T, H, v]
    w_uk, w_uv = w.view(HEADS, NOPE + VDIM, RANK).split([NOPE, VDIM], dim=1)
    q = torch.cat([torch.einsum("thn,hnr->thr", q_nope, w_uk), q_pe], dim=-1)
    out = attend_latent(q, entry, cache, meta, SCALE, RANK)
    return torch.einsum("thr,hvr->thv", out, w_uv)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_expanded_step_matches_the_absorbed_path(dtype):
    """The layer's kernel path for a step with prefill tokens: entries stored, the two
    single-token requests (one leading, one after the chunks) through the decode kernel, the
    fresh prompt and the chunk expanded."""
    meta, q_nope, q_pe, entry, w, cache = _step(dtype, 1)
    want = _absorbed(meta, q_nope, q_pe, entry, w, cache.clone())
    layer = LatentAttention(HEADS, RANK, ROPE, SCALE)
    layer.decode_kernel, layer.kv_cache = True, cache
    with forward_context(meta):
        assert layer.expanded(q_nope)
        got = layer.forward_expanded(q_nope, q_pe, entry, w, DIMS)
    assert got.shape == (meta.num_tokens, HEADS, VDIM) and not got.isnan().any()
    assert _rel(got, want) < TOL[dtype]
    slots = meta.slot_mapping
    assert torch.equal(cache.view(-1, RANK + ROPE)[slots], entry)


def test_passes_split_by_requests_and_heads_give_the_same_output():
    """A budget that fits one request at a time, with two heads (the 8-key fresh prompt) or
    one (the 16-key chunk) per expansion."""
    meta, q_nope, q_pe, entry, w, cache = _step(torch.float32, 2)
    want = _absorbed(meta, q_nope, q_pe, entry, w, cache)  # (stores the entries)
    split = split_step(meta)
    assert split.num_decodes == 2 and split.prefill.seq_lens_cpu == [7, 14]
    rows = split.prefill_rows
    q = torch.cat([q_nope[rows], q_pe[rows]], dim=-1)
    elt = 4
    budget = 16 * ((RANK + ROPE) * elt + (2 * NOPE + VDIM + ROPE) * elt)
    got = expanded_prefill(q, cache, split.prefill, w, DIMS, SCALE, budget)
    cached = split.prefill.backend_cache
    passes = next(v for k, v in cached.items() if k[-1] == budget)
    assert [(p.reqs, p.heads) for p in passes] == [((0, 1), 2), ((1, 2), 1)]
    assert _rel(got, want[rows]) < TOL[torch.float32]


def test_compile_variants_reads_the_cache_only():
    from lightwell.attention.mla_prefill import compile_variants

    gen = torch.Generator().manual_seed(5)
    cache = torch.randn(1, 4, BLOCK, 1, RANK + ROPE, generator=gen).to(DEVICE)
    w = torch.randn(HEADS * (NOPE + VDIM), RANK, generator=gen).to(DEVICE)
    before = cache.clone()
    assert compile_variants(cache, w, DIMS, HEADS) == 4
    assert torch.equal(cache, before)


def test_plan_groups_bounds_each_pass():
    # 10 bytes a key + 5 per head and key, 4 heads: 30 bytes a key with every head
    # (blocks of 4 keys): 16 keys fit 480 bytes with every head; 32 keys, one head at a time
    assert plan_groups([1, 1, 2, 8], 4, 10, 5, 4, budget=480) == [(0, 3, 4), (3, 4, 1)]
    assert plan_groups([1, 1, 2, 8], 4, 10, 5, 4, budget=479) == [(0, 2, 4), (2, 3, 4), (3, 4, 1)]
    assert plan_groups([8], 4, 10, 5, 4, budget=640) == [(0, 1, 2)]
    # one request past the bound even with one head: alone, one head at a time
    assert plan_groups([2, 100], 4, 10, 5, 4, budget=300) == [(0, 1, 4), (1, 2, 1)]


def test_leading_decodes_stop_at_the_first_longer_request():
    meta, *_ = build_metadata([3, 1, 1], [9, 5, 6], [[0, 1, 2], [3, 4], [5, 6]], 4,
                              torch.device("cpu"))  # fmt: skip
    meta.num_decodes = 2  # (the model runner counts every single-token request)
    assert leading_decodes(meta) == 0
    meta, *_ = build_metadata([1, 1, 4], [9, 5, 6], [[0, 1, 2], [3, 4], [5, 6]], 4,
                              torch.device("cpu"))  # fmt: skip
    assert leading_decodes(meta) == 2


@pytest.mark.skipif(DEVICE == "cuda", reason="a CPU model through the interpreter")
def test_deepseek_v2_prefill_through_the_kernels_matches_the_torch_path(tmp_path, monkeypatch):
    """A tiny DeepSeek-V2 (plain q, YaRN mscale) on the kernel path gives the torch path's
    logits: fresh prompts; a chunk after its cached prefix ahead of two decodes (the
    scheduler's running order); decodes then a last chunk. ``num_decodes`` counts every
    single-token request, as the model runner's does."""
    import tests.models.paged as paged
    from tests.models.families import deepseek_v2
    from tests.models.paged import PagedRunner
    from tests.models.tiny import load_ours, rel_err

    def runner_metadata(query_lens, *args):
        meta, positions = build_metadata(query_lens, *args)
        meta.num_decodes = sum(n == 1 for n in query_lens)
        return meta, positions

    monkeypatch.setattr(paged, "build_metadata", runner_metadata)
    torch.set_num_threads(1)
    deepseek_v2(str(tmp_path), 3, num_hidden_layers=1)  # (one dense layer: MLA is the point)
    logits = {}
    for kernel in (False, True):
        model = load_ours(str(tmp_path))
        for layer in model.modules():
            if isinstance(layer, LatentAttention):
                layer.decode_kernel = kernel
        runner = PagedRunner(model, block_size=4, num_blocks=32, seed=2)
        a, b, c = list(range(3, 12)), list(range(20, 26)), list(range(40, 54))
        out = runner.step([("a", a, 0), ("b", b, 0), ("c", c[:5], 0)])
        ta, tb = int(out[0][-1].argmax()), int(out[1][-1].argmax())
        out += runner.step([("c", c[5:11], 5), ("a", [ta], 9), ("b", [tb], 6)])
        ta, tb = int(out[-2][-1].argmax()), int(out[-1][-1].argmax())
        out += runner.step([("a", [ta], 10), ("b", [tb], 7), ("c", c[11:], 11)])
        logits[kernel] = torch.cat(out)
    (mla,) = [m for m in model.modules() if isinstance(m, MLAttention)]
    before = mla.attn.kv_cache.clone()
    # decode splits 1..32, the output's one-token kernel alone and combining 2..32 splits,
    # the prefill variants
    assert mla.compile_kernel_variants() == 6 + 1 + 5 + 4
    torch.testing.assert_close(mla.attn.kv_cache, before, rtol=0, atol=0, equal_nan=True)
    assert rel_err(logits[True], logits[False]) < 1e-4


def test_steps_launch_only_the_attention_variants_compiled_at_start_up(monkeypatch):
    """Steps with 0-4 leading decodes before two prefill requests (their lengths then a slice
    of the step's at any offset) launch only paged-attention variants that ``compile_variants``
    launched: on a GPU, none compiles in the middle of serving."""
    import lightwell.kernels.paged_attention as pa
    from lightwell.attention.mla_prefill import compile_variants
    from tests.kernels.test_triton_kernels import _SpecRecorder

    attn = _SpecRecorder(pa._paged_attention_kernel)
    monkeypatch.setattr(pa, "_paged_attention_kernel", attn)
    gen = torch.Generator().manual_seed(8)
    cache = torch.randn(1, 40, BLOCK, 1, RANK + ROPE, generator=gen).to(DEVICE)
    w = (torch.randn(HEADS * (NOPE + VDIM), RANK, generator=gen) / 4).to(DEVICE)
    assert compile_variants(cache, w, DIMS, HEADS) == 4
    at_start = set(attn.keys)
    for decodes in range(5):
        reqs = [(1, 5)] * decodes + [(7, 7), (5, 14)]
        tables, used = [], 0
        for _, length in reqs:
            tables.append(list(range(used, used + -(-length // BLOCK))))
            used += len(tables[-1])
        meta, _ = build_metadata([q for q, _ in reqs], [s for _, s in reqs], tables, BLOCK,
                                 torch.device(DEVICE))  # fmt: skip
        split = split_step(meta)
        assert split.num_decodes == decodes
        q = torch.randn(12, HEADS, NOPE + ROPE, generator=gen).to(DEVICE)
        expanded_prefill(q, cache, split.prefill, w, DIMS, SCALE)
    assert attn.keys <= at_start, attn.keys - at_start
