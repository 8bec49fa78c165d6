"""The CPU side of ``--quantization gguf``: linears, the token embedding and the LM head run on
the file's blocks through ``lightwell.kernels.cpu.gguf_cpu`` (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
Q4_K, Q5_K, Q6_K), float32 activations, every weight dequantized in registers to gguf-py's
exact float32 value. With ``int8_act`` (``--cpu-int8-activations``, a model's setting: the
model's ``GGUFLinearMethod`` passes it to ``apply_cpu``, ``quantize_embeddings`` stores it on
the LM head) the direct steps of linears and LM head in blocks of 32 (Q4_0 / Q4_1 / Q5_0 /
Q5_1 / Q8_0) round their inputs to int8 by blocks of 32 and use integer dot products.

A layer's parts (one per fused shard) that share one supported type are joined into one block
tensor at load (parts of different supported types stay segments of the output). A step of at
most ``DIRECT_MAX_ROWS`` rows runs the blocks directly; a larger one (prefill) dequantizes
``TILE_FLOATS`` weights at a time into float32 and multiplies them with torch's GEMM. Other
types keep the per-call dequantization of ``lightwell.quant.gguf``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightwell.kernels.cpu import gguf_cpu as kernels
from lightwell.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from lightwell.quant.base import set_weight_attrs

DIRECT_MAX_ROWS = 8  # above: dequantized weight tiles + torch GEMM (faster from ~8 rows on)
TILE_FLOATS = 1 << 18  # weights dequantized at a time for larger steps (a 1 MB tile)


def supported(qtype: int | None) -> bool:
    return qtype in kernels.SUPPORTED and kernels.available()


def blocks_matmul(
    x: torch.Tensor,  # [T, K] float32
    blocks: torch.Tensor,  # [N, bytes per row] uint8
    qtype: int,
    out: torch.Tensor,  # [T, N] float32, possibly a column slice of a wider output
    int8_act: bool = False,  # a direct step rounds x to int8 by blocks of 32 (32-value types)
) -> None:
    K, N = x.shape[1], blocks.shape[0]
    if x.shape[0] <= DIRECT_MAX_ROWS:
        kernels.gguf_mm(x, blocks, qtype, out, int8_act=int8_act)
        return
    rows = max(64, TILE_FLOATS // K)
    for start in range(0, N, rows):
        ids = torch.arange(start, min(start + rows, N))
        w = kernels.gguf_dequant_rows(blocks, qtype, K, ids)  # [rows, K]
        torch.mm(x, w.T, out=out[:, start : start + ids.numel()])


def prepare_cpu(layer: nn.Module) -> bool:
    """Set ``layer.gguf_cpu``, its segments ``(qtype, blocks [rows, bytes], first output
    column)`` (parts of one type joined into one); False (nothing changed) unless every part is
    on the CPU in a supported type."""
    parts = layer.gguf_parts
    if not all(supported(q) and p.device.type == "cpu" for q, p in parts):
        return False
    if len({q for q, _ in parts}) == 1:
        parts = [
            (parts[0][0], parts[0][1] if len(parts) == 1 else torch.cat([p for _, p in parts]))
        ]
    starts = [0]
    for _, p in parts[:-1]:
        starts.append(starts[-1] + p.shape[0])
    layer.gguf_cpu = [(q, p, start) for (q, p), start in zip(parts, starts)]
    layer.gguf_out = starts[-1] + parts[-1][1].shape[0]  # output features
    layer.gguf_parts = None  # the segments replace them
    return True


def apply_cpu(
    layer: nn.Module,
    x: torch.Tensor,  # [T, K]
    bias: torch.Tensor | None,  # [N]
    int8_act: bool = False,  # the model's --cpu-int8-activations (its GGUFLinearMethod's)
) -> torch.Tensor:  # [T, N]
    x32 = x.float().contiguous()
    out = torch.empty(x.shape[0], layer.gguf_out, dtype=torch.float32)
    for qtype, blocks, start in layer.gguf_cpu:
        blocks_matmul(x32, blocks, qtype, out[:, start : start + blocks.shape[0]], int8_act)
    if bias is not None:
        out += bias
    return out.to(x.dtype)


class GGUFEmbedding(VocabParallelEmbedding):
    """The token table kept as the file's blocks (one GPU-free rank); rows dequantized on
    lookup. A float table (F32/F16, or a type the kernels lack, dequantized by the loader)
    is kept as float32."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype):
        super().__init__(num_embeddings, embedding_dim)
        self.dtype = dtype  # of the rows it returns (the model's activations)
        self.weight = nn.Parameter(torch.empty(0), requires_grad=False)
        set_weight_attrs(self.weight, {"weight_loader": self.load_blocks, "gguf_type": None})

    def load_blocks(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        if loaded.shape[0] != self.org_vocab_size:
            raise ValueError(
                f"shape mismatch: checkpoint tensor has {loaded.shape[0]} rows, expected "
                f"{self.org_vocab_size}"
            )
        qtype = getattr(loaded, "gguf_type", None)
        param.gguf_type = qtype if supported(qtype) else None
        param.data = loaded.contiguous() if param.gguf_type else loaded.float()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        if self.weight.gguf_type is None:
            return F.embedding(input_ids, self.weight).to(self.dtype)
        qtype = self.weight.gguf_type
        rows = kernels.gguf_dequant_rows(self.weight, qtype, self.embedding_dim, input_ids)
        return rows.to(self.dtype)


class GGUFLMHead(GGUFEmbedding):
    """Hidden states -> logits on the table's blocks (tied to the embedding, or the file's
    ``output.weight``)."""

    bias = None
    int8_act = False  # direct steps on int8 inputs (set by quantize_embeddings)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, V]
        if self.weight.gguf_type is None:
            return F.linear(hidden.float(), self.weight)
        out = torch.empty(hidden.shape[0], self.org_vocab_size, dtype=torch.float32)
        x = hidden.float().contiguous()
        blocks_matmul(x, self.weight, self.weight.gguf_type, out, self.int8_act)
        return out

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N] int64
        return self.compute_logits(hidden).argmax(dim=-1)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("GGUFLMHead is not an embedding: call compute_logits(hidden)")


def quantize_embeddings(model: nn.Module, int8_act: bool = False) -> bool:
    """Swap a single-rank model's token embedding and LM head for block-keeping ones (before
    its weights load), re-tying a tied LM head, the LM head on int8 inputs with ``int8_act``;
    whether any was swapped (none when the kernels are unavailable or the model is not on the
    CPU)."""
    first = next(model.parameters(), None)
    if not kernels.available() or (first is not None and first.device.type != "cpu"):
        return False
    swapped = False
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            new = _swap(child)
            if new is not None:
                setattr(module, name, new)
                swapped = True
    lm_head = getattr(model, "lm_head", None)
    if isinstance(lm_head, GGUFLMHead):
        lm_head.int8_act = bool(int8_act)
        if getattr(model, "tie_word_embeddings", False):
            embed = model.get_submodule("model.embed_tokens")
            if isinstance(embed, GGUFEmbedding):
                lm_head.weight = embed.weight
    return swapped


def _swap(child: Any) -> GGUFEmbedding | None:
    if getattr(child, "tp_size", 1) != 1:
        return None
    if type(child) is ParallelLMHead and child.bias is None:
        return GGUFLMHead(child.org_vocab_size, child.embedding_dim, child.weight.dtype)
    if type(child) is VocabParallelEmbedding:
        return GGUFEmbedding(child.org_vocab_size, child.embedding_dim, child.weight.dtype)
    return None
