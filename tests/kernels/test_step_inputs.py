"""kernels/step_inputs.py: ``fill_decode_inputs`` (one launch) equals worker/cuda_graph.py's
``fill_decode_torch`` (torch copies) on a decode graph's static buffers, with tokens still being
sampled, padding rows and a block table narrower than the graph's; on CPU under
TRITON_INTERPRET=1, compiled on CUDA. ``to_device_many`` (worker/input_batch.py) on CUDA:
views equal to the arrays."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightwell.kernels.step_inputs import fill_decode_inputs
from lightwell.worker.cuda_graph import DecodeInputs, fill_decode_torch, take_sampled
from tests.kernels.interpreter import DEVICE


def _graph(size: int, width: int, seed: int) -> DecodeInputs:
    """Static buffers holding a previous step's leftovers (random), as between replays."""
    g = torch.Generator().manual_seed(seed)
    i64 = [torch.randint(-5, 1000, (size,), generator=g) for _ in range(3)]
    seq = torch.randint(1, 100, (size,), generator=g, dtype=torch.int32)
    table = torch.randint(0, 500, (size, width), generator=g, dtype=torch.int32)
    return DecodeInputs(*(t.to(DEVICE) for t in (*i64, seq, table)))


def _step(reqs: int, width: int, seed: int) -> DecodeInputs:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 3000, (reqs,), generator=g)
    pos = torch.randint(0, 4 * width, (reqs,), generator=g)
    slots = torch.randint(0, 9000, (reqs,), generator=g)
    seq = pos.to(torch.int32) + 1
    table = torch.randint(1, 700, (reqs, width), generator=g, dtype=torch.int32)
    return DecodeInputs(*(t.to(DEVICE) for t in (ids, pos, slots, seq, table)))


@pytest.mark.parametrize("size,reqs,width", [(1, 1, 3), (8, 5, 40), (16, 16, 1), (4, 1, 1300)])
@pytest.mark.parametrize("with_deferred", [False, True])
def test_fill_decode_inputs_matches_the_torch_copies(size, reqs, width, with_deferred):
    graph_width = width + 7
    step = _step(reqs, width, seed=size + reqs)
    deferred = None
    if with_deferred:  # every other row's token still being sampled, rows of a larger batch
        sampled = torch.arange(100, 100 + reqs + 3, device=DEVICE)
        src = torch.tensor([(i + 2) if i % 2 == 0 else -1 for i in range(reqs)], device=DEVICE)
        deferred = (src, sampled)
    got, want = _graph(size, graph_width, 1), _graph(size, graph_width, 1)
    step_before = [t.clone() for t in step]
    fill_decode_inputs(got, step, deferred)
    fill_decode_torch(want, step, deferred)
    for name, a, b in zip(DecodeInputs._fields, got, want):
        assert torch.equal(a, b), name
    for a, b in zip(step, step_before):  # the step's own tensors are read only
        assert torch.equal(a, b)
    if with_deferred:
        assert got.input_ids[0].item() == 102 and (reqs < 2 or got.input_ids[1] == step[0][1])
    if size > reqs:  # padding: token 0 at position 0, no slot, one token through block 0
        assert got.slot_mapping[reqs:].eq(-1).all() and got.seq_lens[reqs:].eq(1).all()
        assert got.block_table[reqs:, 0].eq(0).all()


def test_fill_decode_inputs_refuses_a_step_larger_than_the_graph():
    with pytest.raises(ValueError, match="a step of 5 rows"):
        fill_decode_inputs(_graph(4, 8, 1), _step(5, 3, 2))
    with pytest.raises(ValueError, match="x 9 blocks"):
        fill_decode_inputs(_graph(4, 8, 1), _step(2, 9, 2))
    step = _step(3, 2, 2)
    short = step._replace(positions=step.positions[:2])
    with pytest.raises(ValueError, match="per-row inputs"):
        fill_decode_inputs(_graph(4, 8, 1), short)
    with pytest.raises(ValueError, match="per-row inputs"):  # a strided row of token rows
        src = torch.tensor([0, -1, 1, 0, 0, 0], device=DEVICE)[::2]
        fill_decode_inputs(_graph(4, 8, 1), step, (src, torch.arange(2, device=DEVICE)))


def test_fill_decode_inputs_reads_strided_sampled_tokens():
    """The previous step's tokens as a strided view: the kernel reads them as the torch twin
    indexes them."""
    step = _step(2, 3, 4)
    pair = torch.tensor([[11, 0], [12, 0], [13, 0]], device=DEVICE)
    deferred = (torch.tensor([2, -1], device=DEVICE), pair[:, 0])
    got, want = _graph(2, 5, 3), _graph(2, 5, 3)
    fill_decode_inputs(got, step, deferred)
    fill_decode_torch(want, step, deferred)
    assert torch.equal(got.input_ids, want.input_ids) and got.input_ids[0].item() == 13


def test_take_sampled_fills_only_the_pending_tokens():
    ids = torch.tensor([5, 6, 7, 8])
    take_sampled(ids, torch.tensor([-1, 1, -1, 0]), torch.tensor([40, 41]))
    assert ids.tolist() == [5, 41, 7, 40]


@pytest.mark.skipif(DEVICE != "cuda", reason="one pinned copy: CUDA only (CPU: the arrays)")
def test_to_device_many_gives_views_of_one_copy():
    from lightwell.worker.input_batch import to_device_many

    arrays = [
        np.arange(5, dtype=np.int64),
        np.array([3, 1, 2], dtype=np.int32),  # 12 bytes: the next starts 8-aligned
        np.arange(12, dtype=np.int32).reshape(3, 4),
        np.zeros(0, dtype=np.int64),
        np.array([-1, 2**40], dtype=np.int64),
    ]
    got = to_device_many(arrays, torch.device("cuda"))
    base = got[0].untyped_storage().data_ptr()
    for a, t in zip(arrays, got):
        assert t.is_cuda and t.shape == a.shape and t.untyped_storage().data_ptr() == base
        assert np.array_equal(t.cpu().numpy(), a)
