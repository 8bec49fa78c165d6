"""Split one step's flat batch into two micro-batches (for the dual-stream overlap).

Decode-only batches split between requests (half the requests each); others at the middle
token, which may fall inside a request: its first tokens go to micro-batch A and the rest to B,
whose attention then reads A's part from the KV cache like a cached prefix (A runs first in
every layer, so A's K/V are stored before B attends). Device tensors are sliced or derived with
device ops only, so a split made during CUDA-graph capture replays correctly.

A mixed-step graph's metadata (``static_layout``) describes a placeholder layout at capture:
only its token and request counts hold at replay. Such a step splits at its middle token with
every request in both halves (``_split_static``): a request's query tokens on the other side
of the cut count as none in this half (A: fewer keys; B: A's tokens as cached keys), which the
attention kernel takes for any layout, since its grid depends only on the token and request
counts.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from lightwell.attention.metadata import AttentionMetadata


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [Tm]
    positions: torch.Tensor  # [Tm]
    meta: AttentionMetadata


def split_point(meta: AttentionMetadata) -> int:
    """The first token of micro-batch B."""
    qsl = meta.query_start_loc_cpu
    if meta.max_query_len == 1:
        return qsl[meta.num_reqs // 2]
    return qsl[-1] // 2


def split_batch(
    input_ids: torch.Tensor,  # [T]
    positions: torch.Tensor,  # [T]
    meta: AttentionMetadata,
) -> tuple[MicroBatch, MicroBatch]:
    """(A, B): tokens [0, s) and [s, T) with their own attention metadata; needs T >= 2."""
    if meta.static_layout and meta.max_query_len > 1:
        return _split_static(input_ids, positions, meta)
    s = split_point(meta)
    if not 0 < s < meta.num_tokens:
        raise ValueError(f"cannot split a batch of {meta.num_tokens} tokens at {s}")
    i = bisect.bisect_right(meta.query_start_loc_cpu, s) - 1  # request holding token s
    a = MicroBatch(input_ids[:s], positions[:s], _head(meta, s, i))
    b = MicroBatch(input_ids[s:], positions[s:], _tail(meta, s, i))
    return a, b


def _head(meta: AttentionMetadata, s: int, i: int) -> AttentionMetadata:
    """Requests [0, i) whole, plus the first tokens of request i when s cuts it."""
    qsl = meta.query_start_loc_cpu
    cut = s > qsl[i]
    r = i + 1 if cut else i
    qsl_cpu, lens_cpu = qsl[:r] + [s], list(meta.seq_lens_cpu[:r])
    query_start = meta.query_start_loc[: r + 1]  # [r + 1]
    seq_lens = meta.seq_lens[:r]  # [r]
    if cut:
        moved = qsl[i + 1] - s  # request i's tokens that go to B
        lens_cpu[-1] -= moved
        query_start = query_start.clone()
        query_start[-1:].fill_(s)
        seq_lens = seq_lens.clone()
        seq_lens[-1:].sub_(moved)
    return _meta(
        query_start, seq_lens, meta.block_table[:r], meta.slot_mapping[:s], qsl_cpu, lens_cpu
    )


def _tail(meta: AttentionMetadata, s: int, i: int) -> AttentionMetadata:
    """Requests [i, R): request i from token s on (its earlier tokens count as cached)."""
    qsl_cpu = [0] + [q - s for q in meta.query_start_loc_cpu[i + 1 :]]
    query_start = (meta.query_start_loc[i:] - s).clamp_min(0)  # [R - i + 1]
    return _meta(
        query_start,
        meta.seq_lens[i:],
        meta.block_table[i:],
        meta.slot_mapping[s:],
        qsl_cpu,
        list(meta.seq_lens_cpu[i:]),
    )


def _split_static(
    input_ids: torch.Tensor,  # [T]
    positions: torch.Tensor,  # [T]
    meta: AttentionMetadata,
) -> tuple[MicroBatch, MicroBatch]:
    """A mixed graph's split at token T // 2, every request kept in both halves, the device
    metadata derived with device ops (replays with any layout of the same counts)."""
    t = meta.num_tokens
    s = t // 2
    qsl = meta.query_start_loc  # [R + 1] int32
    in_b = (qsl[1:] - qsl[:-1].clamp_min(s)).clamp_min(0)  # [R]: each request's tokens in B
    qsl_cpu = meta.query_start_loc_cpu
    in_b_cpu = [max(0, b - max(a, s)) for a, b in zip(qsl_cpu, qsl_cpu[1:])]
    halves = []
    for lo, hi, starts, lens, starts_cpu, lens_cpu in (
        (0, s, qsl.clamp_max(s), meta.seq_lens - in_b, [min(q, s) for q in qsl_cpu],
         [n - m for n, m in zip(meta.seq_lens_cpu, in_b_cpu)]),
        (s, t, (qsl - s).clamp_min(0), meta.seq_lens, [max(q - s, 0) for q in qsl_cpu],
         list(meta.seq_lens_cpu)),
    ):  # fmt: skip
        half = AttentionMetadata(
            query_start_loc=starts,
            seq_lens=lens,
            block_table=meta.block_table,
            slot_mapping=meta.slot_mapping[lo:hi],
            max_query_len=max(hi - lo, 2),  # any request may hold every token: general tiles
            max_seq_len=meta.max_seq_len,
            query_start_loc_cpu=starts_cpu,
            seq_lens_cpu=lens_cpu,
            num_decodes=0,  # one launch over every request
            static_layout=True,
        )
        halves.append(MicroBatch(input_ids[lo:hi], positions[lo:hi], half))
    return halves[0], halves[1]


def _meta(
    query_start: torch.Tensor,  # [r + 1] int32
    seq_lens: torch.Tensor,  # [r] int32
    block_table: torch.Tensor,  # [r, max_blocks] int32
    slot_mapping: torch.Tensor,  # [t] int64
    qsl_cpu: list[int],
    lens_cpu: list[int],
) -> AttentionMetadata:
    counts = [b - a for a, b in zip(qsl_cpu, qsl_cpu[1:])]
    return AttentionMetadata(
        query_start_loc=query_start,
        seq_lens=seq_lens,
        block_table=block_table,
        slot_mapping=slot_mapping,
        max_query_len=max(counts, default=0),
        max_seq_len=max(lens_cpu, default=0),
        query_start_loc_cpu=qsl_cpu,
        seq_lens_cpu=lens_cpu,
        num_decodes=sum(c == 1 for c in counts),
    )
