"""The sampler's structured-output hook: the engine's grammar bitmask of a step's constrained
rows, moved to the logits' device and applied before any other logits processing (so
temperature, top-k/p and min-p only ever see allowed tokens). Steps without constrained rows
never reach this module."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightwell.scheduler.output import GrammarBitmask
from lightwell.worker.input_batch import to_device

_NEG_INF = float("-inf")


@dataclass
class GrammarMask:
    rows: torch.Tensor  # [G] int64: the constrained rows of the sampling batch
    bitmask: torch.Tensor  # [G, W] int32, W = ceil(V / 32); bit set = token allowed


def grammar_mask(
    grammar: GrammarBitmask, sample_req_ids: list[str], device: torch.device
) -> GrammarMask | None:
    """The step's bitmask, with each row placed at its request's sampling row."""
    where = {r: i for i, r in enumerate(sample_req_ids)}
    keep = [g for g, r in enumerate(grammar.req_ids) if r in where]
    if not keep:
        return None
    bitmask = torch.from_numpy(grammar.bitmask)  # [G, W] int32
    if len(keep) < len(grammar.req_ids):
        bitmask = bitmask[keep]
    rows = torch.tensor([where[grammar.req_ids[g]] for g in keep], dtype=torch.int64)
    return GrammarMask(to_device(rows, device), to_device(bitmask.contiguous(), device))


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[G, W] int32 bit words -> [G, V] bool (token t is bit t % 32 of word t // 32)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)  # [32]
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [G, W, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_grammar_mask(logits: torch.Tensor, mask: GrammarMask) -> torch.Tensor:
    """Set every disallowed token of the constrained rows to -inf, in place."""
    # logits: [R, V] float32
    allowed = unpack_bitmask(mask.bitmask, logits.shape[1])  # [G, V]
    rows = logits.index_select(0, mask.rows)  # [G, V]
    logits.index_copy_(0, mask.rows, rows.masked_fill_(~allowed, _NEG_INF))
    return logits
