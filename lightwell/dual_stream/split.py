"""Split one step's flat batch into micro-batches (for the dual-stream overlap): two, or more.

Decode-only batches split between requests (an equal share of the requests each); others at
equal token counts, a cut possibly inside a request: its first tokens go to the earlier
micro-batch and the rest to the later ones, whose attention then reads the earlier part from
the KV cache like a cached prefix (micro-batches run in order in every layer, so earlier K/V
are stored before later ones attend). Device tensors are sliced or derived with device ops
only, so a split made during CUDA-graph capture replays correctly.

A mixed-step graph's metadata (``static_layout``) describes a placeholder layout at capture:
only its token and request counts hold at replay. Such a step splits at equal token counts
with every request in every part (``_split_static``): a request's query tokens outside a part
count as none in it (those before it as cached keys, those after it as not yet there), which
the attention kernel takes for any layout, since its grid depends only on the token and
request counts.
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


def split_points(meta: AttentionMetadata, parts: int) -> list[int]:
    """The first token of every micro-batch after the first (``parts - 1`` of them)."""
    qsl = meta.query_start_loc_cpu
    if meta.max_query_len == 1:
        return [qsl[meta.num_reqs * j // parts] for j in range(1, parts)]
    return [qsl[-1] * j // parts for j in range(1, parts)]


def can_split(meta: AttentionMetadata, parts: int) -> bool:
    """Every one of ``parts`` micro-batches would get a token (a request, decode-only)."""
    if meta.max_query_len == 1:
        return meta.num_reqs >= parts
    return meta.num_tokens >= parts


def split_batch(
    input_ids: torch.Tensor,  # [T]
    positions: torch.Tensor,  # [T]
    meta: AttentionMetadata,
    parts: int = 2,
) -> list[MicroBatch]:
    """``parts`` micro-batches, tokens [0, s1), [s1, s2), ... [s_last, T), each with its own
    attention metadata; needs ``can_split(meta, parts)``."""
    if parts < 2 or not can_split(meta, parts):
        raise ValueError(f"cannot split a batch of {meta.num_tokens} tokens in {parts}")
    if meta.static_layout:  # (a mixed graph's: a decode graph's layout holds at replay)
        return _split_static(input_ids, positions, meta, parts)
    out, done = [], 0  # tokens [0, done) are split off; ``meta`` describes the rest
    for s in split_points(meta, parts):
        cut = s - done
        i = bisect.bisect_right(meta.query_start_loc_cpu, cut) - 1  # request holding the cut
        out.append(MicroBatch(input_ids[:cut], positions[:cut], _head(meta, cut, i)))
        # copies (as in ``_tail``): kernels taking these see 16-byte aligned addresses only
        input_ids, positions = input_ids[cut:].clone(), positions[cut:].clone()
        meta = _tail(meta, cut, i)
        done = s
    out.append(MicroBatch(input_ids, positions, meta))
    return out


def _head(meta: AttentionMetadata, s: int, i: int) -> AttentionMetadata:
    """Requests [0, i) whole, plus the first tokens of request i when s cuts it."""
    qsl = meta.query_start_loc_cpu
    cut = s > qsl[i]
    r = i + 1 if cut else i
    qsl_cpu, lens_cpu = qsl[:r] + [s], list(meta.seq_lens_cpu[:r])
    query_start = meta.query_start_loc[: r + 1]  # [r + 1]
    seq_lens = meta.seq_lens[:r]  # [r]
    if cut:
        moved = qsl[i + 1] - s  # request i's tokens that go to the later pieces
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
    # Copies, not views: a view's address is 16-byte aligned or not by i and s, and Triton
    # would compile a kernel variant for each (about a second, mid-serving).
    return _meta(
        query_start,
        meta.seq_lens[i:].clone(),
        meta.block_table[i:].clone(),
        meta.slot_mapping[s:].clone(),
        qsl_cpu,
        list(meta.seq_lens_cpu[i:]),
    )


def _split_static(
    input_ids: torch.Tensor,  # [T]
    positions: torch.Tensor,  # [T]
    meta: AttentionMetadata,
    parts: int,
) -> list[MicroBatch]:
    """A mixed graph's split at equal token counts, every request kept in every part, the
    device metadata derived with device ops (replays with any layout of the same counts)."""
    t = meta.num_tokens
    qsl = meta.query_start_loc  # [R + 1] int32
    qsl_cpu = meta.query_start_loc_cpu
    out = []
    for j in range(parts):
        lo, hi = t * j // parts, t * (j + 1) // parts
        # each request's query tokens at or after ``hi``: not in the KV cache yet
        later = (qsl[1:] - qsl[:-1].clamp_min(hi)).clamp_min(0)  # [R]
        later_cpu = [max(0, b - max(a, hi)) for a, b in zip(qsl_cpu, qsl_cpu[1:])]
        piece = AttentionMetadata(
            query_start_loc=qsl.clamp(lo, hi) - lo,
            seq_lens=meta.seq_lens - later,
            block_table=meta.block_table,
            slot_mapping=meta.slot_mapping[lo:hi],
            max_query_len=max(hi - lo, 2),  # any request may hold every token: general tiles
            max_seq_len=meta.max_seq_len,
            query_start_loc_cpu=[min(max(q, lo), hi) - lo for q in qsl_cpu],
            seq_lens_cpu=[n - m for n, m in zip(meta.seq_lens_cpu, later_cpu)],
            num_decodes=0,  # one launch over every request
            static_layout=True,
        )
        out.append(MicroBatch(input_ids[lo:hi], positions[lo:hi], piece))
    return out


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
