"""The worker's last check before the device: a step whose positions pass RoPE's table or
whose block ids pass the KV cache is refused with the values (a GPU kernel would read or write
past the end without a word), and a step inside both limits is prepared as before."""

from __future__ import annotations

import pytest
import torch

from lightwell.scheduler.output import NewRequestData, SchedulerOutput
from lightwell.types import SamplingParams
from lightwell.worker.input_batch import InputBatch

SP = SamplingParams(max_tokens=4)


def _step(tokens: int, blocks: list[int], req: str = "a") -> SchedulerOutput:
    new = NewRequestData(req, list(range(1, tokens + 1)), tokens, SP, blocks, 0)
    return SchedulerOutput([new], [], {req: tokens}, tokens)


def _prepare(batch: InputBatch, sched: SchedulerOutput):
    batch.apply(sched)
    return batch.prepare(sched)


def test_inside_the_limits_prepares_positions_and_slots():
    batch = InputBatch(4, torch.device("cpu"), max_positions=8, num_blocks=3)
    inp = _prepare(batch, _step(8, [2, 1]))  # positions 0..7: the table's last row
    assert inp.positions.tolist() == list(range(8))
    assert inp.meta.slot_mapping.tolist() == [8, 9, 10, 11, 4, 5, 6, 7]


def test_positions_past_the_table_are_refused():
    batch = InputBatch(4, torch.device("cpu"), max_positions=8, num_blocks=8)
    with pytest.raises(RuntimeError, match="request a reaches position 8, past the model's 8"):
        _prepare(batch, _step(9, [0, 1, 2]))


def test_block_ids_past_the_cache_are_refused():
    batch = InputBatch(4, torch.device("cpu"), max_positions=64, num_blocks=3)
    with pytest.raises(RuntimeError, match="request b holds block 3, past the KV cache's 3"):
        _prepare(batch, _step(6, [1, 3], req="b"))


def test_unset_limits_check_nothing():
    batch = InputBatch(4, torch.device("cpu"))
    assert _prepare(batch, _step(9, [5, 6, 7])).positions.shape == (9,)


def test_the_runner_sets_both_limits():
    from lightwell.models.loader import load_model
    from lightwell.worker.model_runner import ModelRunner
    from tests.models.tiny import tiny_config

    cfg = tiny_config()
    model = load_model(None, cfg, torch.float32, "cpu", load_format="dummy")
    r = ModelRunner(model, block_size=4, vocab_size=cfg.vocab_size, device=torch.device("cpu"),
                    dtype=torch.float32)  # fmt: skip
    r.init_kv_cache(5)
    assert (r.batch.max_positions, r.batch.num_blocks) == (cfg.max_position_embeddings, 5)
