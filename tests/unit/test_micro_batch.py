"""Splitting a step into micro-batches (the dual-stream overlap): each piece's attention
metadata, on the CPU lists and the device tensors alike."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lightwell.dual_stream.split import can_split, split_batch
from tests.models.paged import build_metadata

CPU = torch.device("cpu")


def _layout(mb) -> tuple[list[int], list[int], list[int]]:
    """(query_start_loc, seq_lens, positions) of a piece, checking the device tensors equal
    the CPU lists."""
    m = mb.meta
    assert m.query_start_loc.tolist() == m.query_start_loc_cpu
    assert m.seq_lens.tolist() == m.seq_lens_cpu
    assert m.slot_mapping.numel() == mb.input_ids.numel() == mb.positions.numel()
    return m.query_start_loc_cpu, m.seq_lens_cpu, mb.positions.tolist()


def _step(query_lens: list[int], seq_lens: list[int], static: bool = False):
    tables = [list(range(1 + 4 * i, 5 + 4 * i)) for i in range(len(query_lens))]
    meta, pos = build_metadata(query_lens, seq_lens, tables, 4, CPU)
    if static:
        meta = dataclasses.replace(meta, static_layout=True)
    return torch.arange(meta.num_tokens) + 100, pos, meta


def test_decode_batch_splits_between_requests():
    ids, pos, meta = _step([1] * 5, [3, 5, 7, 9, 11])
    assert can_split(meta, 5) and not can_split(meta, 6)
    parts = split_batch(ids, pos, meta, 3)
    assert [_layout(mb) for mb in parts] == [
        ([0, 1], [3], [2]),
        ([0, 1, 2], [5, 7], [4, 6]),
        ([0, 1, 2], [9, 11], [8, 10]),
    ]
    assert [mb.meta.num_decodes for mb in parts] == [1, 2, 2]
    assert torch.equal(torch.cat([mb.input_ids for mb in parts]), ids)


def test_prefill_cut_twice_inside_a_request():
    """Tokens 0-2 | 3-6 | 7-10 of a 2-token prompt and a 9-token chunk after 3 cached tokens:
    the chunk's later pieces see its earlier ones as cached keys."""
    ids, pos, meta = _step([2, 9], [2, 12])
    parts = split_batch(ids, pos, meta, 3)
    assert [_layout(mb) for mb in parts] == [
        ([0, 2, 3], [2, 4], [0, 1, 3]),
        ([0, 4], [8], [4, 5, 6, 7]),
        ([0, 4], [12], [8, 9, 10, 11]),
    ]
    assert [mb.meta.max_query_len for mb in parts] == [2, 4, 4]
    assert [mb.meta.max_seq_len for mb in parts] == [4, 8, 12]
    assert torch.equal(torch.cat([mb.meta.slot_mapping for mb in parts]), meta.slot_mapping)


def test_static_layout_keeps_every_request_in_every_piece():
    """A mixed graph's split: the same cuts, every request in each piece (none of its query
    tokens where the cut leaves it none), keys up to the piece's last token."""
    ids, pos, meta = _step([2, 9], [2, 12], static=True)
    parts = split_batch(ids, pos, meta, 3)
    assert [_layout(mb) for mb in parts] == [
        ([0, 2, 3], [2, 4], [0, 1, 3]),
        ([0, 0, 4], [2, 8], [4, 5, 6, 7]),
        ([0, 0, 4], [2, 12], [8, 9, 10, 11]),
    ]
    assert all(mb.meta.static_layout and mb.meta.num_decodes == 0 for mb in parts)


def test_too_few_tokens_or_requests_to_split():
    ids, pos, meta = _step([1, 1], [4, 4])
    assert not can_split(meta, 3)
    with pytest.raises(ValueError, match="cannot split"):
        split_batch(ids, pos, meta, 3)
    with pytest.raises(ValueError, match="cannot split"):
        split_batch(ids, pos, meta, 1)


def test_every_piece_tensor_starts_16_byte_aligned():
    """Triton specialises a kernel on whether each pointer is 16-byte aligned: a piece made of
    views at odd offsets would compile new kernel variants in the middle of serving."""
    import random

    rng = random.Random(3)
    for _ in range(20):
        n = rng.randint(2, 6)
        qlens = [rng.choice([1, rng.randint(1, 9)]) for _ in range(n)]
        ctxs = [q + rng.randint(0, 5) for q in qlens]
        ids, pos, meta = _step(qlens, ctxs)
        parts = rng.randint(2, 3)
        if not can_split(meta, parts):
            continue
        for mb in split_batch(ids, pos, meta, parts):
            m = mb.meta
            for t in (mb.input_ids, mb.positions, m.query_start_loc, m.seq_lens,
                      m.block_table, m.slot_mapping):  # fmt: skip
                assert t.data_ptr() % 16 == 0, (qlens, ctxs, parts)
