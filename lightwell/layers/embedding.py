"""Vocabulary-parallel token embedding and LM head.

The vocabulary is padded to a multiple of ``padding_size * tp_size`` and split into equal
contiguous ranges, rank r holding rows [r*V/tp, (r+1)*V/tp) of the padded table. Padding rows
are zero and their logits are cut off, so callers only ever see ``org_vocab_size`` columns.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lightwell.distributed.comm.base import exact_sum
from lightwell.distributed.parallel_state import (
    get_tp_rank,
    get_tp_size,
    tp_all_gather,
    tp_all_reduce,
)
from lightwell.quant.base import dense_linear, set_weight_attrs

DEFAULT_VOCAB_PADDING = 64


def pad_vocab_size(vocab_size: int, multiple: int) -> int:
    return -(-vocab_size // multiple) * multiple


class VocabParallelEmbedding(nn.Module):
    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_size: int = DEFAULT_VOCAB_PADDING,
    ):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.org_vocab_size = num_embeddings
        self.embedding_dim = embedding_dim
        self.num_embeddings_padded = pad_vocab_size(num_embeddings, padding_size * self.tp_size)
        self.num_embeddings_per_partition = self.num_embeddings_padded // self.tp_size
        self.vocab_start_index = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end_index = self.vocab_start_index + self.num_embeddings_per_partition
        self.weight = nn.Parameter(
            torch.empty(self.num_embeddings_per_partition, embedding_dim), requires_grad=False
        )
        set_weight_attrs(self.weight, {"output_dim": 0, "weight_loader": self.weight_loader})

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
        """Copy this rank's rows of the [org_vocab, H] checkpoint table; zero the padding."""
        expected = (self.org_vocab_size, *param.shape[1:])
        if tuple(loaded_weight.shape) != expected:
            raise ValueError(
                f"shape mismatch: checkpoint tensor has shape {tuple(loaded_weight.shape)}, "
                f"expected {expected}"
            )
        start = min(self.vocab_start_index, self.org_vocab_size)
        end = min(self.vocab_end_index, self.org_vocab_size)
        n = end - start
        param.data[:n].copy_(loaded_weight[start:end])
        param.data[n:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        in_range = (input_ids >= self.vocab_start_index) & (input_ids < self.vocab_end_index)
        local_ids = (input_ids - self.vocab_start_index) * in_range
        out = F.embedding(local_ids, self.weight) * in_range.unsqueeze(-1).to(self.weight.dtype)
        with exact_sum():  # one rank's row each: an int8 payload would only lose precision
            return tp_all_reduce(out)

    def extra_repr(self) -> str:
        return (
            f"vocab={self.org_vocab_size} (padded {self.num_embeddings_padded}), "
            f"dim={self.embedding_dim}, tp={self.tp_size}"
        )


class ParallelLMHead(VocabParallelEmbedding):
    """Hidden states -> logits over the vocabulary, vocab-sharded like the embedding."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        bias: bool = False,
        padding_size: int = DEFAULT_VOCAB_PADDING,
    ):
        super().__init__(num_embeddings, embedding_dim, padding_size)
        if bias:
            self.bias = nn.Parameter(
                torch.empty(self.num_embeddings_per_partition), requires_grad=False
            )
            set_weight_attrs(self.bias, {"output_dim": 0, "weight_loader": self.weight_loader})
        else:
            self.register_parameter("bias", None)

    def tie_weights(self, embed_tokens: VocabParallelEmbedding) -> None:
        """Share the embedding table (tie_word_embeddings); shapes and sharding must agree."""
        if embed_tokens.weight.shape != self.weight.shape:
            raise ValueError(
                f"cannot tie LM head {tuple(self.weight.shape)} to embedding "
                f"{tuple(embed_tokens.weight.shape)}"
            )
        self.weight = embed_tokens.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, V]
        logits = dense_linear(hidden, self.weight, self.bias)  # [N, V_padded / tp]
        logits = tp_all_gather(logits, dim=-1)  # [N, V_padded]
        return logits[..., : self.org_vocab_size]

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N] int64
        """``compute_logits(hidden).argmax(-1)`` without gathering the logits: each rank takes
        the first largest logit of its vocabulary shard (padding excluded), the ranks exchange
        (value, index) pairs (16 bytes a row instead of V / tp logits) and keep the first
        largest, lowest rank first: the same token, ties and NaNs included, on every rank. One
        rank: the argmax of the logits in their own dtype (no fp32 copy), on a GPU in one
        launch (kernels/argmax.py)."""
        logits = dense_linear(hidden, self.weight, self.bias)  # [N, V_padded / tp]
        if self.tp_size == 1:
            logits = logits[:, : self.org_vocab_size]
            if logits.is_cuda:
                from lightwell.kernels.argmax import argmax_rows

                return argmax_rows(logits)
            return logits.argmax(dim=-1)
        real = self.org_vocab_size - self.vocab_start_index  # this shard's non-padding columns
        if real < logits.shape[-1]:
            logits[:, max(real, 0) :] = float("-inf")
        index = logits.argmax(dim=-1)  # [N]
        value = logits.gather(-1, index[:, None])[:, 0]
        pair = torch.stack([value.double(), (index + self.vocab_start_index).double()])
        pairs = tp_all_gather(pair, dim=0).view(self.tp_size, 2, -1)  # [tp, 2, N]
        best = pairs[:, 0].argmax(dim=0)  # [N]: the first rank holding the largest
        return pairs[:, 1].gather(0, best[None])[0].long()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead is not an embedding: call compute_logits(hidden)")
