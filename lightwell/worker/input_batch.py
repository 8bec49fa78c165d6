"""The worker's persistent per-request state, and the flat inputs of one step built from it."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from lightwell.attention.metadata import AttentionMetadata
from lightwell.scheduler.output import SchedulerOutput
from lightwell.types import SamplingParams


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host -> device without blocking the host: a plain ``.to(device)`` waits for the stream
    to drain, which would stall async scheduling behind the step in flight. On CUDA the copy
    goes through pinned memory (the caching host allocator keeps the block until it is done)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def to_device_many(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Several host arrays to the device in one copy (each copy costs the GPU's stream a few
    microseconds, however small): packed into one pinned byte buffer at 16-byte aligned offsets,
    copied as ``to_device`` does, and returned as views of the device buffer with each array's
    dtype and shape. On the CPU: the arrays' own memory, no copy. Each view starts 16-byte
    aligned, as a tensor of its own would: Triton compiles a kernel variant per pointer
    alignment it meets (kernels/step_inputs.py reads these views)."""
    if device.type != "cuda":
        return [torch.from_numpy(a) for a in arrays]
    offsets, total = [], 0
    for a in arrays:
        offsets.append(total)
        total += -(-a.nbytes // 16) * 16
    host = torch.empty(max(total, 16), dtype=torch.uint8, pin_memory=True)
    view = host.numpy()
    for a, off in zip(arrays, offsets):
        view[off : off + a.nbytes] = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
    dev = host.to(device, non_blocking=True)
    return [
        dev[off : off + a.nbytes].view(_TORCH_DTYPES[a.dtype]).view(a.shape)
        for a, off in zip(arrays, offsets)
    ]


_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32}


@dataclass
class CachedRequestState:
    req_id: str
    token_ids: list[int]  # prompt + outputs known to the worker
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    eos_token_id: int | None = None

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


@dataclass
class ModelInput:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    req_ids: list[str]  # [R], batch order
    # Requests whose last scheduled token is the last known token: they sample a new one.
    sample_req_ids: list[str]
    logits_indices: torch.Tensor  # [S] int64: flat index of each sampling request's last token
    # Prompt-logprob rows: req_id -> (flat token indices [P], target token ids [P]).
    prompt_logprob_rows: dict[str, tuple[list[int], list[int]]] = field(default_factory=dict)
    # Async scheduling: (flat index, req_id) of input tokens the previous step is sampling on
    # the device; the runner fills them in from its sampled-token tensor.
    deferred_tokens: list[tuple[int, str]] = field(default_factory=list)
    # The same on the device, per input token: its row in the previous step's sampled tokens,
    # -1 where the token is known ([T] int64; None when no token is deferred).
    token_src: torch.Tensor | None = None
    # Per sampling request: output tokens before the one sampled this step [S].
    num_outputs: list[int] = field(default_factory=list)
    # The fused CPU decode's LM head: logits [T, V] float32 and their argmax [T] int64, per row.
    fused_logits: tuple[torch.Tensor, torch.Tensor] | None = None


class InputBatch:
    """Holds CachedRequestState per request and turns a SchedulerOutput into a ModelInput."""

    def __init__(
        self,
        block_size: int,
        device: torch.device,
        max_positions: int | None = None,
        num_blocks: int | None = None,
    ) -> None:
        """``max_positions`` (RoPE's table length) and ``num_blocks`` (the KV cache's): a step
        whose positions or block ids reach them is refused here, with the values, instead of
        a GPU kernel reading or writing past its table (which can go unnoticed, or fault in a
        later step). The scheduler keeps both in range; this is the last check before the
        device. None: unchecked."""
        self.block_size = block_size
        self.device = device
        self.max_positions = max_positions
        self.num_blocks = num_blocks
        self.requests: dict[str, CachedRequestState] = {}

    def apply(self, out: SchedulerOutput) -> None:
        self._check_new_blocks(out)  # before any change: a refused step changes nothing
        for req_id in out.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in out.new_reqs:
            self.requests[new.req_id] = CachedRequestState(
                new.req_id,
                list(new.token_ids),
                new.num_prompt_tokens,
                new.sampling_params,
                list(new.block_ids),
                new.num_computed_tokens,
                new.eos_token_id,
            )
        for diff in out.cached_reqs:
            state = self.requests[diff.req_id]
            state.token_ids.extend(diff.new_token_ids)
            state.block_ids.extend(diff.new_block_ids)
            state.num_computed_tokens = diff.num_computed_tokens

    def prepare(self, out: SchedulerOutput, sampled_req_ids: list[str] | None = None) -> ModelInput:
        """Flat input ids, positions and attention metadata for the scheduled tokens, on the
        device in one copy. ``sampled_req_ids``: the requests of the previous step's sampled
        tokens, in row order (async scheduling), for the input tokens still being sampled
        (``token_src``)."""
        req_ids = list(out.num_scheduled_tokens)
        states = [self.requests[r] for r in req_ids]
        counts = np.array([out.num_scheduled_tokens[r] for r in req_ids], dtype=np.int64)
        starts = np.array([s.num_computed_tokens for s in states], dtype=np.int64)
        query_start = np.zeros(len(req_ids) + 1, dtype=np.int64)
        np.cumsum(counts, out=query_start[1:])
        total = int(query_start[-1])
        # positions: start_i + (0..n_i-1) for every request, flattened
        offsets = np.arange(total, dtype=np.int64) - np.repeat(query_start[:-1], counts)
        positions = np.repeat(starts, counts) + offsets
        input_ids = np.zeros(total, dtype=np.int64)
        deferred: list[tuple[int, str]] = []
        for i, s in enumerate(states):
            a, n, q = int(starts[i]), int(counts[i]), int(query_start[i])
            known = s.token_ids[a : a + n]
            input_ids[q : q + len(known)] = known
            if len(known) < n:  # async scheduling: the last input token is still being sampled
                if a + n != len(s.token_ids) + 1:
                    raise RuntimeError(
                        f"request {req_ids[i]}: {a + n - len(s.token_ids)} input tokens unknown "
                        "(only the one sampled by the previous step can be)"
                    )
                deferred.append((q + n - 1, req_ids[i]))
        seq_lens = starts + counts
        block_table = self._block_table(states, seq_lens)
        self._check_positions(req_ids, seq_lens)
        req_index = np.repeat(np.arange(len(req_ids)), counts)
        block_of_token = block_table[req_index, positions // self.block_size]
        slots = block_of_token.astype(np.int64) * self.block_size + positions % self.block_size
        rows = self._logit_rows(req_ids, states, query_start, counts)
        sample_ids, logits_idx, num_outputs, prompt_rows = rows
        host = [
            input_ids,
            positions,
            np.array(logits_idx, dtype=np.int64),
            query_start.astype(np.int32),
            seq_lens.astype(np.int32),
            block_table,
            slots,
        ]
        if deferred:
            host.append(_token_sources(total, deferred, sampled_req_ids or []))
        dev = to_device_many(host, self.device)
        ids, pos, logits_indices, dev_query_start, dev_seq_lens, dev_table, dev_slots = dev[:7]
        meta = AttentionMetadata(
            query_start_loc=dev_query_start,
            seq_lens=dev_seq_lens,
            block_table=dev_table,
            slot_mapping=dev_slots,
            max_query_len=int(counts.max(initial=0)),
            max_seq_len=int(seq_lens.max(initial=0)),
            query_start_loc_cpu=query_start.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
            num_decodes=int((counts == 1).sum()),
        )
        return ModelInput(
            input_ids=ids,
            positions=pos,
            meta=meta,
            req_ids=req_ids,
            sample_req_ids=sample_ids,
            logits_indices=logits_indices,
            prompt_logprob_rows=prompt_rows,
            deferred_tokens=deferred,
            token_src=dev[7] if deferred else None,
            num_outputs=num_outputs,
        )

    def _check_positions(self, req_ids: list[str], seq_lens: np.ndarray) -> None:
        """Positions below ``max_positions`` (see __init__)."""
        if self.max_positions is not None and len(seq_lens) and seq_lens.max() > self.max_positions:
            i = int(seq_lens.argmax())
            raise RuntimeError(
                f"request {req_ids[i]} reaches position {int(seq_lens[i]) - 1}, past the model's "
                f"{self.max_positions} positions"
            )

    def _check_new_blocks(self, out: SchedulerOutput) -> None:
        """Block ids below ``num_blocks`` (see __init__), checked once, as they arrive."""
        if self.num_blocks is None:
            return
        added = [(n.req_id, n.block_ids) for n in out.new_reqs]
        added += [(d.req_id, d.new_block_ids) for d in out.cached_reqs]
        for req_id, ids in added:
            if ids and max(ids) >= self.num_blocks:
                raise RuntimeError(
                    f"request {req_id} holds block {max(ids)}, past the KV cache's "
                    f"{self.num_blocks} blocks"
                )

    def _block_table(self, states: list[CachedRequestState], seq_lens: np.ndarray) -> np.ndarray:
        width = max(1, int(-(-int(seq_lens.max(initial=1)) // self.block_size)))
        table = np.zeros((len(states), width), dtype=np.int32)
        for i, s in enumerate(states):
            ids = s.block_ids[:width]
            table[i, : len(ids)] = ids
        return table

    def _logit_rows(
        self,
        req_ids: list[str],
        states: list[CachedRequestState],
        query_start: np.ndarray,
        counts: np.ndarray,
    ) -> tuple[list[str], list[int], list[int], dict[str, tuple[list[int], list[int]]]]:
        sample_ids: list[str] = []
        logits_idx: list[int] = []
        num_outputs: list[int] = []
        prompt_rows: dict[str, tuple[list[int], list[int]]] = {}
        for i, s in enumerate(states):
            start, n = s.num_computed_tokens, int(counts[i])
            if start + n >= len(s.token_ids):  # > only with a deferred (in-flight) token
                sample_ids.append(req_ids[i])
                logits_idx.append(int(query_start[i]) + n - 1)
                num_outputs.append(start + n - s.num_prompt_tokens)
            if s.sampling_params.prompt_logprobs is not None and start < s.num_prompt_tokens - 1:
                # position p predicts token p+1; only prompt targets count
                last = min(start + n, s.num_prompt_tokens - 1)
                rows = [int(query_start[i]) + p - start for p in range(start, last)]
                prompt_rows[req_ids[i]] = (rows, s.token_ids[start + 1 : last + 1])
        return sample_ids, logits_idx, num_outputs, prompt_rows


def _token_sources(
    num_tokens: int, deferred: list[tuple[int, str]], sampled_req_ids: list[str]
) -> np.ndarray:  # [T] int64
    """Each input token's row in the previous step's sampled tokens when it is one still being
    sampled (``deferred``: flat index, request), else -1."""
    rows = {r: i for i, r in enumerate(sampled_req_ids)}
    missing = [r for _, r in deferred if r not in rows]
    if missing:
        raise RuntimeError(f"the previous step sampled no token for {missing[:3]}")
    src = np.full(num_tokens, -1, dtype=np.int64)
    for flat, req_id in deferred:
        src[flat] = rows[req_id]
    return src
