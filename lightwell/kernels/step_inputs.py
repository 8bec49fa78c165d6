"""A decode step's inputs into its CUDA graph's static buffers, in one launch.

A decode graph of B rows reads its input ids, positions, slots, sequence lengths and block
table from static buffers (lightwell/worker/cuda_graph.py). A step of R <= B requests (one
token each) fills rows 0..R-1 from the step's tensors, taking the input tokens still being
sampled by the previous step from that step's sampled tokens (async scheduling), and sets rows
R..B-1 to padding: token 0 at position 0, slot -1 (nothing stored), one token of context read
through block 0. As separate copies that is five to eight launches and copies, each costing the
stream a few microseconds at batch 1; ``fill_decode_inputs`` is one program a row. Its torch
twin, the CPU path and the test's reference, is worker/cuda_graph.py's ``fill_decode_torch``
(the worker's CPU image loads no Triton).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_W = 128  # block-table entries a step of a program's loop copies


# (the sizes unspecialised and the tile fixed: one compiled form per HAS_SRC, made at start-up)
@triton.jit(do_not_specialize=["num_reqs", "width", "stride_table"])
def _decode_inputs_kernel(
    ids_ptr, pos_ptr, slot_ptr, seq_ptr, table_ptr,  # the step's: [R] x 3 int64, [R] int32, [R, w]
    src_ptr,  # [R] int64: a token's row in sampled_ptr, -1 where known (HAS_SRC)
    sampled_ptr,  # [S] int64: the previous step's sampled tokens
    g_ids_ptr, g_pos_ptr, g_slot_ptr, g_seq_ptr, g_table_ptr,  # the graph's: [B] ..., [B, W]
    num_reqs, width, stride_table, stride_g_table,
    HAS_SRC: tl.constexpr, BLOCK_W: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_W)
    g_row = g_table_ptr + row.to(tl.int64) * stride_g_table
    if row < num_reqs:
        token = tl.load(ids_ptr + row)
        if HAS_SRC:
            src = tl.load(src_ptr + row)
            if src >= 0:
                token = tl.load(sampled_ptr + src)
        tl.store(g_ids_ptr + row, token)
        tl.store(g_pos_ptr + row, tl.load(pos_ptr + row))
        tl.store(g_slot_ptr + row, tl.load(slot_ptr + row))
        tl.store(g_seq_ptr + row, tl.load(seq_ptr + row))
        t_row = table_ptr + row.to(tl.int64) * stride_table
        for c0 in range(0, width, BLOCK_W):
            c = c0 + cols
            tl.store(g_row + c, tl.load(t_row + c, mask=c < width), mask=c < width)
    else:  # padding
        tl.store(g_ids_ptr + row, 0)
        tl.store(g_pos_ptr + row, 0)
        tl.store(g_slot_ptr + row, -1)
        tl.store(g_seq_ptr + row, 1)
        for c0 in range(0, width, BLOCK_W):
            c = c0 + cols
            tl.store(g_row + c, tl.zeros([BLOCK_W], dtype=tl.int32), mask=c < width)


def fill_decode_inputs(
    graph: tuple[torch.Tensor, ...],  # the graph's B rows: ids, positions, slots, seq_lens,
    # [B] each, block table [B, W] (worker/cuda_graph.py's DecodeInputs)
    step: tuple[torch.Tensor, ...],  # the step's R <= B rows alike ([R, w] table, w <= W)
    deferred: tuple[torch.Tensor, torch.Tensor] | None = None,  # ([R] rows or -1, [S] tokens)
) -> None:
    """Rows 0..R-1 of ``graph`` from ``step`` (the deferred input tokens from the previous
    step's), rows R..B-1 padding (module docstring); columns w..W-1 of the table are left as
    they are (no row reads past its context)."""
    size, reqs = graph[0].shape[0], step[0].shape[0]
    table, g_table = step[4], graph[4]
    width = table.shape[1]
    if reqs > size or width > g_table.shape[1] or table.shape[0] != reqs:
        raise ValueError(
            f"fill_decode_inputs: a step of {reqs} rows x {width} blocks into a graph of "
            f"{size} x {g_table.shape[1]}"
        )
    if table.stride(1) != 1 or g_table.stride(1) != 1:
        raise ValueError("fill_decode_inputs: block tables need contiguous rows")
    src, sampled = deferred if deferred is not None else (step[0], step[0])
    per_row = (*step[:4], src) + tuple(graph[:4])
    if any(t.dim() != 1 or t.stride(0) != 1 for t in per_row) or any(
        t.shape[0] != n for t, n in zip(per_row, (reqs,) * 5 + (size,) * 4)
    ):
        raise ValueError("fill_decode_inputs: the per-row inputs need R (graph: B) contiguous rows")
    sampled = sampled.contiguous()
    _decode_inputs_kernel[(size,)](
        *step, src, sampled, *graph, reqs, width, table.stride(0), g_table.stride(0),
        HAS_SRC=deferred is not None, BLOCK_W=BLOCK_W, num_warps=1,
    )  # fmt: skip
