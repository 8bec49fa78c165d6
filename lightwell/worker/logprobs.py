"""Logprobs of chosen tokens plus the top alternatives, as plain ``TokenLogprobs`` lists."""

from __future__ import annotations

import torch

from lightwell.scheduler.output import TokenLogprobs

# Rows of a [N, V] log_softmax at a time, to bound the float32 temporary for long prompts.
_ROWS_PER_CHUNK = 256


def gather_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The chosen token then the ``num_top`` most likely ones, per row.

    Returns ids [N, 1 + num_top] int64, their logprobs [N, 1 + num_top] float32 and ranks
    [N, 1 + num_top] int64, where rank = 1 + the number of tokens with a strictly greater logprob.
    """
    # logprobs: [N, V] float32 (log_softmax); token_ids: [N] int64
    ids = token_ids.to(torch.int64).unsqueeze(1)  # [N, 1]
    chosen = logprobs.gather(1, ids)  # [N, 1]
    chosen_rank = (logprobs > chosen).sum(dim=-1, keepdim=True) + 1  # [N, 1]
    if num_top == 0:
        return ids, chosen, chosen_rank
    top_values, top_ids = logprobs.topk(num_top, dim=-1)  # [N, k], descending
    # Within the sorted top-k, the tokens above the j-th are exactly those listed before it.
    top_ranks = (top_values.unsqueeze(1) > top_values.unsqueeze(2)).sum(dim=-1) + 1  # [N, k]
    return (
        torch.cat([ids, top_ids], dim=1),
        torch.cat([chosen, top_values], dim=1),
        torch.cat([chosen_rank, top_ranks], dim=1),
    )


def to_token_logprobs(
    ids: torch.Tensor, logprobs: torch.Tensor, ranks: torch.Tensor, num_top: list[int | None]
) -> list[TokenLogprobs | None]:
    """Copy to host once and cut each row to its own 1 + k entries (None: row wants none)."""
    # ids, ranks: [N, 1 + K] int64; logprobs: [N, 1 + K] float32; len(num_top) == N
    ids_rows = torch.stack([ids, ranks]).cpu().tolist()  # one transfer for both int tensors
    lp_rows = logprobs.float().cpu().tolist()
    out: list[TokenLogprobs | None] = []
    for row, k in enumerate(num_top):
        if k is None:
            out.append(None)
            continue
        n = 1 + k
        out.append(TokenLogprobs(ids_rows[0][row][:n], lp_rows[row][:n], ids_rows[1][row][:n]))
    return out


def sampled_logprobs(
    raw_logprobs: torch.Tensor, sampled: torch.Tensor, num_top: list[int | None]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sampled token then the top-k alternatives, on the device (no host sync):
    ``to_token_logprobs(*result, num_top)`` cuts each row to its own k."""
    # raw_logprobs: [R, V] log_softmax of the unprocessed logits; sampled: [R] int64
    max_top = max((k for k in num_top if k is not None), default=0)
    return gather_logprobs(raw_logprobs, sampled, max_top)  # 3 x [R, 1 + max_top]


def prompt_logprobs(
    logits: torch.Tensor, target_token_ids: torch.Tensor, num_top: int
) -> list[TokenLogprobs]:
    """Per position: the logprob of the next prompt token then the ``num_top`` most likely."""
    # logits: [N, V] (position i predicts target_token_ids[i]); target_token_ids: [N]
    targets = torch.as_tensor(target_token_ids, dtype=torch.int64, device=logits.device)
    if logits.dim() != 2 or targets.shape != (logits.shape[0],):
        raise ValueError(
            f"prompt logprobs need logits [N, V] and targets [N]; got {tuple(logits.shape)} and "
            f"{tuple(targets.shape)}"
        )
    out: list[TokenLogprobs] = []
    for start in range(0, logits.shape[0], _ROWS_PER_CHUNK):
        chunk = logits[start : start + _ROWS_PER_CHUNK].float().log_softmax(dim=-1)
        ids, values, ranks = gather_logprobs(
            chunk, targets[start : start + chunk.shape[0]], num_top
        )
        rows = to_token_logprobs(ids, values, ranks, [num_top] * chunk.shape[0])
        out.extend(r for r in rows if r is not None)
    return out
