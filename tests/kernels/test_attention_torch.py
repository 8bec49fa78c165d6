"""The torch attention backend vs naive dense causal attention, over random batches that mix
fresh prefills, prefill chunks on a cached prefix and decodes, with GQA and scattered blocks."""

from __future__ import annotations

import random

import pytest
import torch

from lightwell.attention.backend import get_attention_backend
from lightwell.attention.metadata import AttentionMetadata


def naive_attention(
    q: torch.Tensor,  # [n, Hq, D]
    k: torch.Tensor,  # [L, Hkv, D] (the whole sequence)
    v: torch.Tensor,  # [L, Hkv, D]
    scale: float,
    window: int | None = None,
) -> torch.Tensor:  # [n, Hq, D]
    n, length = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    q_pos = torch.arange(length - n, length)[:, None]
    key_pos = torch.arange(length)[None, :]
    hidden = key_pos > q_pos
    if window is not None:  # HF's sliding window: a query sees itself and window - 1 before
        hidden |= key_pos <= q_pos - window
    scores = scores.masked_fill(hidden, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _metadata(query_lens, seq_lens, tables, block_size, device="cpu") -> AttentionMetadata:
    starts, slots = [0], []
    for q, s, blocks in zip(query_lens, seq_lens, tables):
        starts.append(starts[-1] + q)
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(s - q, s)]
    width = max(len(t) for t in tables)
    padded = [t + [0] * (width - len(t)) for t in tables]
    return AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=torch.tensor(padded, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=list(seq_lens),
    )


def _random_batch(rng: random.Random, num_reqs: int) -> tuple[list[int], list[int]]:
    """(query_lens, seq_lens): decodes, fresh prefills and chunks after a cached prefix."""
    query_lens, seq_lens = [], []
    for _ in range(num_reqs):
        kind = rng.choice(["decode", "prefill", "chunk"])
        cached = 0 if kind == "prefill" else rng.randint(1, 40)
        new = 1 if kind == "decode" else rng.randint(2, 17)
        query_lens.append(new)
        seq_lens.append(cached + new)
    return query_lens, seq_lens


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (6, 1)])
def test_torch_backend_vs_naive(seed: int, heads: tuple[int, int], device: str):
    _check_vs_naive(seed, heads, device, window=None)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("window", [1, 3, 8])
def test_torch_backend_sliding_window_vs_naive(seed: int, window: int):
    """Contexts up to ~57 keys, windows far shorter: decodes, prefills and chunks."""
    _check_vs_naive(seed, (8, 2), "cpu", window=window)


@pytest.mark.parametrize("num_decodes", [1, 3])
@pytest.mark.parametrize("consecutive", [True, False])
def test_equal_length_decodes(num_decodes: int, consecutive: bool):
    """The fast paths: decodes of one length (fused SDPA), one request on consecutive blocks
    (read in place, no gather)."""
    batch = ([1] * num_decodes, [37] * num_decodes)
    _check_vs_naive(7, (6, 2), "cpu", window=None, batch=batch, shuffle=not consecutive)


def _check_vs_naive(
    seed: int,
    heads: tuple[int, int],
    device: str,
    window: int | None,
    batch: tuple[list[int], list[int]] | None = None,
    shuffle: bool = True,
):
    torch.set_num_threads(1)
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    num_q, num_kv = heads
    head_dim, block_size, num_blocks = 16, rng.choice([1, 4, 8]), 400
    query_lens, seq_lens = batch or _random_batch(rng, rng.randint(1, 6))
    free = list(range(num_blocks))[::-1]  # pop() hands out 0, 1, 2, ...
    if shuffle:
        rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-s // block_size))] for s in seq_lens]

    # Full per-request K/V; the cached prefix goes into the cache up front.
    cache = torch.full((2, num_blocks, block_size, num_kv, head_dim), float("nan"))
    full_k = [torch.randn(s, num_kv, head_dim, generator=gen) for s in seq_lens]
    full_v = [torch.randn(s, num_kv, head_dim, generator=gen) for s in seq_lens]
    for s, q, t, k, v in zip(seq_lens, query_lens, tables, full_k, full_v):
        for p in range(s - q):
            cache[0, t[p // block_size], p % block_size] = k[p]
            cache[1, t[p // block_size], p % block_size] = v[p]

    total = sum(query_lens)
    q = torch.randn(total, num_q, head_dim, generator=gen)
    k = torch.cat([fk[s - n :] for fk, s, n in zip(full_k, seq_lens, query_lens)])
    v = torch.cat([fv[s - n :] for fv, s, n in zip(full_v, seq_lens, query_lens)])
    meta = _metadata(query_lens, seq_lens, tables, block_size, device)
    scale = head_dim**-0.5

    dev = torch.device(device)
    cache_dev = cache.to(dev)
    out = get_attention_backend("torch").forward(
        q.to(dev), k.to(dev), v.to(dev), cache_dev, meta, scale, sliding_window=window
    )
    out, cache = out.cpu(), cache_dev.cpu()

    assert out.shape == q.shape
    starts = meta.query_start_loc_cpu
    for i in range(len(query_lens)):
        ref = naive_attention(q[starts[i] : starts[i + 1]], full_k[i], full_v[i], scale, window)
        torch.testing.assert_close(
            out[starts[i] : starts[i + 1]].double(), ref, atol=1e-5, rtol=1e-5
        )
    # New k/v landed in the cache at their slots.
    flat_k = cache[0].reshape(-1, num_kv, head_dim)
    torch.testing.assert_close(flat_k[meta.slot_mapping.cpu()], k)


@pytest.mark.parametrize("window", [None, 4])
def test_without_cache_is_causal_per_request(window):
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    lens = [5, 1, 9]
    q = torch.randn(sum(lens), 8, 16, generator=gen)
    k = torch.randn(sum(lens), 2, 16, generator=gen)
    v = torch.randn(sum(lens), 2, 16, generator=gen)
    meta = _metadata(lens, lens, [[0], [0], [0]], 16)
    out = get_attention_backend("torch").forward(q, k, v, None, meta, 0.25, sliding_window=window)
    for s, e in [(0, 5), (5, 6), (6, 15)]:
        ref = naive_attention(q[s:e], k[s:e], v[s:e], 0.25, window)
        torch.testing.assert_close(out[s:e].double(), ref, atol=1e-5, rtol=1e-5)


def test_unknown_backend_lists_available():
    with pytest.raises(ValueError, match="torch"):
        get_attention_backend("flashinfer")
