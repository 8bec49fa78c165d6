"""Embedding requests (``--task embed``): a prompt's final hidden states pooled into one vector.

``last`` takes the last prompt token's state; ``mean`` averages every prompt token's, summed
chunk by chunk under chunked prefill (embedding requests never take prefix-cache hits, so every
state is computed here). The vector is cut to ``dimensions`` and L2-normalised as asked.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from lightwell.scheduler.output import ModelRunnerOutput
from lightwell.types import PoolingParams
from lightwell.worker.input_batch import CachedRequestState, ModelInput


class Pooler:
    def __init__(self) -> None:
        self._sums: dict[str, tuple[torch.Tensor, int]] = {}  # mean: sum [H] fp32, tokens

    def forget(self, req_ids: Iterable[str]) -> None:
        """Drop partial sums of finished, aborted or preempted requests (recomputed later)."""
        for req_id in req_ids:
            self._sums.pop(req_id, None)

    def step(
        self, inp: ModelInput, hidden: torch.Tensor, states: dict[str, CachedRequestState]
    ) -> dict[str, list[float]]:
        """The vectors of the embedding requests whose prompt ends in this step."""
        # hidden: [T, H], rows in inp.req_ids order (query_start_loc_cpu gives the ranges)
        starts = inp.meta.query_start_loc_cpu
        done = set(inp.sample_req_ids)
        out: dict[str, list[float]] = {}
        for i, req_id in enumerate(inp.req_ids):
            params = states[req_id].sampling_params.pooling
            if params is None:
                continue
            a, b = int(starts[i]), int(starts[i + 1])
            if params.pooling == "mean":
                total, count = self._sums.get(req_id, (0.0, 0))
                self._sums[req_id] = (hidden[a:b].float().sum(dim=0) + total, count + b - a)
            if req_id not in done:
                continue
            if params.pooling == "mean":
                total, count = self._sums.pop(req_id)
                vector = total / count  # [H]
            else:
                vector = hidden[b - 1].float()  # [H]
            out[req_id] = finish_vector(vector, params).tolist()
        return out


def finish_vector(vector: torch.Tensor, params: PoolingParams) -> torch.Tensor:
    """Cut to ``dimensions`` (a ValueError past the hidden size), then normalise if asked."""
    # vector: [H] float32
    if params.dimensions is not None:
        if params.dimensions > vector.shape[0]:
            raise ValueError(
                f"dimensions={params.dimensions} is more than the model's {vector.shape[0]}"
            )
        vector = vector[: params.dimensions]
    if params.normalize:
        vector = torch.nn.functional.normalize(vector, dim=0)
    return vector


def take_pooled(
    inp: ModelInput,
    pooled: dict[str, list[float]],
    out: ModelRunnerOutput | None,
    states: dict[str, CachedRequestState],
) -> None:
    """Pooled requests leave the step's sampling rows; ``out`` (the driver's) gets their
    vectors and a placeholder token, their EOS, that ends them."""
    if not pooled:
        return
    if out is not None:
        out.pooled.update(pooled)
        for req_id in pooled:
            out.sampled_token_ids[req_id] = [states[req_id].eos_token_id or 0]
    keep = [i for i, r in enumerate(inp.sample_req_ids) if r not in pooled]
    inp.sample_req_ids = [inp.sample_req_ids[i] for i in keep]
    inp.num_outputs = [inp.num_outputs[i] for i in keep] if inp.num_outputs else []
    index = torch.tensor(keep, dtype=torch.int64).to(inp.logits_indices.device)
    inp.logits_indices = inp.logits_indices[index]
