"""RMSNorm (and Cohere's bias-free LayerNorm), optionally fused with the residual add that
precedes it."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightwell.distributed.parallel_state import (
    get_tp_size,
    tp_all_reduce,
    tp_all_reduce_add_rmsnorm,
)
from lightwell.quant import utils as quant_utils
from lightwell.quant.base import SKINNY_GEMM_MAX_ROWS, QuantizedInput


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        residual: torch.Tensor | None = None,  # [T, H]
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``norm(x)``; with ``residual``: ``x = x + residual`` first, returning
        ``(norm(x), x)`` so the caller carries the new residual on."""
        if x.is_cuda:
            return self._forward_triton(x, residual)
        if residual is not None:
            x = x + residual
            residual = x
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            out = F.rms_norm(x, (self.hidden_size,), self.weight, self.eps)  # one fused op
            return out if residual is None else (out, residual)
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = (self.weight * h.to(dtype)).to(dtype)
        return out if residual is None else (out, residual)

    def quantized(
        self,
        x: torch.Tensor,  # [T, H]
        residual: torch.Tensor | None,  # [T, H]
        quant: tuple[torch.dtype, torch.Tensor | None],  # the next linear's ``input_quant``
    ) -> tuple[QuantizedInput, torch.Tensor]:  # (normalised rows quantized, new residual)
        """``forward`` with the output quantized per row for the W8A8 linear after it, in one
        launch (kernels/rmsnorm.py's ``rmsnorm_quant``: ``forward`` then the linear's own
        quantization, up to the last bit of the norm's rstd). Without ``residual`` the residual
        returned is ``x``."""
        from lightwell.kernels.rmsnorm import rmsnorm_quant

        dtype, static = quant
        q, scale, res = rmsnorm_quant(x, residual, self.weight, self.eps, dtype, static)
        out = QuantizedInput(q, scale, torch.result_type(x, self.weight))
        return out, res if res is not None else x

    def _forward_triton(
        self,
        x: torch.Tensor,  # [T, H]
        residual: torch.Tensor | None,  # [T, H]
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        from lightwell.kernels.rmsnorm import fused_add_rmsnorm, rmsnorm

        if residual is None:
            return rmsnorm(x, self.weight, self.eps)
        return fused_add_rmsnorm(x, residual, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"


class DeferredNorm:
    """A decoder layer's residual add + RMSNorm of one decode row, left to the GEMV that reads
    the normalised row (kernels/gemv.py's ``gemv_add_norm``): the norm's own launch goes.

    ``matmul(weight)`` is ``linear(normalised row, weight)`` in that one launch, which also
    writes the residual sum, and with ``write_normed`` the normalised row for later readers
    (``rows``). ``rows()`` gives the normalised row (the norm kernel runs if no matmul wrote
    it). ``residual``, the new residual, is valid once a matmul or ``rows()`` ran. Made only
    where ``defers`` holds: an RMSNorm's 16-bit row on the GPU at TP=1 (nothing to all-reduce
    first), the rows ``dense_linear`` multiplies on the GEMV."""

    def __init__(
        self,
        norm: RMSNorm,
        hidden: torch.Tensor,  # [1, H]: the embedding, or the previous block's output
        residual: torch.Tensor | None,  # [1, H]; None before the first layer
    ):
        self.norm, self.hidden, self._residual_in = norm, hidden, residual
        self._residual = hidden if residual is None else torch.empty_like(hidden)
        self._normed: torch.Tensor | None = None
        self._done = residual is None  # the residual holds the sum

    @classmethod
    def for_consumer(
        cls,
        consumer: nn.Module,
        norm: nn.Module,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
    ) -> DeferredNorm | None:
        """One for ``consumer`` (whose ``takes_deferred_norm`` says it takes one) where
        ``defers`` holds; else None (the caller norms as before)."""
        if getattr(consumer, "takes_deferred_norm", False) and cls.defers(norm, hidden, residual):
            return cls(norm, hidden, residual)
        return None

    @staticmethod
    def defers(norm: nn.Module, hidden: torch.Tensor, residual: torch.Tensor | None) -> bool:
        rows = (hidden,) if residual is None else (hidden, residual)
        return (
            type(norm) is RMSNorm
            and hidden.is_cuda
            and hidden.dim() == 2
            and 0 < hidden.shape[0] <= SKINNY_GEMM_MAX_ROWS
            and hidden.dtype in (torch.float16, torch.bfloat16)
            and norm.weight.dtype == hidden.dtype
            and all(t.is_contiguous() and t.dtype == hidden.dtype for t in rows)
            and get_tp_size() == 1
        )

    @property
    def shape(self) -> torch.Size:
        return self.hidden.shape

    @property
    def is_cuda(self) -> bool:
        return self.hidden.is_cuda

    @property
    def residual(self) -> torch.Tensor:
        if not self._done:
            raise RuntimeError("DeferredNorm: the residual is read before any matmul ran")
        return self._residual

    def matmul(
        self,
        weight: torch.Tensor,  # [N, H]
        *,
        write_normed: bool = False,  # also store the normalised row (for ``rows``)
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:  # [1, N]
        from lightwell.kernels.gemv import gemv_add_norm

        normed = torch.empty_like(self.hidden) if write_normed else None
        res_in = self._residual_in
        out = gemv_add_norm(
            self.hidden, res_in, self.norm.weight, self.norm.eps, weight,
            residual_out=self._residual if res_in is not None else None, normed_out=normed,
            out_dtype=out_dtype,
        )  # fmt: skip
        self._done, self._normed = True, normed
        return out

    def rows(self) -> torch.Tensor:  # [1, H]
        if self._normed is None:
            if self._residual_in is None:
                self._normed = self.norm(self.hidden)
            else:
                self._normed, self._residual = self.norm(self.hidden, self._residual_in)
            self._done = True
        return self._normed


class LayerNorm(nn.Module):
    """LayerNorm with a weight and no bias (Cohere), computed in float32; same residual
    interface as ``RMSNorm``. ``shape`` may be ``(heads, head_dim)``: one weight row per head,
    normalised over the last dimension (Command R+'s q/k norm)."""

    def __init__(self, shape: int | tuple[int, ...], eps: float = 1e-5):
        super().__init__()
        self.shape = (shape,) if isinstance(shape, int) else tuple(shape)
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(self.shape), requires_grad=False)

    def forward(
        self,
        x: torch.Tensor,  # [T, H] or [T, heads, head_dim]
        residual: torch.Tensor | None = None,  # like x
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = x + residual
            residual = x
        h = F.layer_norm(x.float(), x.shape[-1:], eps=self.eps)
        out = (self.weight.float() * h).to(x.dtype)
        return out if residual is None else (out, residual)

    def extra_repr(self) -> str:
        return f"{self.shape}, eps={self.eps}, bias=False"


def reduce_norm(
    norm: nn.Module,
    partial: torch.Tensor,  # [T, H]: a row-parallel layer's partial sum, not all-reduced
    residual: torch.Tensor,  # [T, H]
    quant: Any = None,  # the next linear's ``input_quant`` (quant/base.py), or None
) -> tuple[torch.Tensor | QuantizedInput, torch.Tensor]:  # (normalised, new residual [T, H])
    """The norm that consumes a row-parallel output: all-reduce ``partial`` over the TP group,
    add the residual, normalise. One kernel where the all-reduce strategy fuses the add + norm
    (``hostmem`` with an RMSNorm whose hidden size divides its block), else the all-reduce then
    the norm's own fused add. At TP=1 just the norm. With ``quant``, an RMSNorm on the GPU
    writes its output quantized for the W8A8 linear after it (``RMSNorm.quantized``), except
    where the all-reduce fused the norm (16-bit rows: the linear quantizes them)."""
    if isinstance(norm, RMSNorm):
        fused = tp_all_reduce_add_rmsnorm(partial, residual, norm.weight, norm.eps)
        if fused is not None:
            return fused
    return _norm(norm, tp_all_reduce(partial), residual, quant)


def _norm(
    norm: nn.Module,
    x: torch.Tensor,  # [T, H]
    residual: torch.Tensor | None,  # [T, H]
    quant: Any,  # the next linear's ``input_quant``, or None
) -> tuple[torch.Tensor | QuantizedInput, torch.Tensor]:
    if quant is not None and isinstance(norm, RMSNorm) and quant_utils.norm_quant_fusable(x):
        return norm.quantized(x, residual, quant)
    if residual is None:
        return norm(x), x
    return norm(x, residual)


def pre_norm(
    norm: nn.Module,
    hidden: torch.Tensor,  # [T, H]: the previous layer's output
    residual: torch.Tensor | None,  # [T, H]; None before the first layer
    partial: bool = False,  # hidden is a partial sum still to be all-reduced (reduce_norm)
    quant: Any = None,  # the next linear's ``input_quant`` (quant/base.py), or None
) -> tuple[torch.Tensor | QuantizedInput, torch.Tensor]:  # (normalised, new residual [T, H])
    """A decoder layer's input norm: the first layer normalises its input, which becomes the
    residual; later layers add the residual first (fused into the norm), all-reducing the
    previous layer's output first when it is ``partial``. With ``quant``, as ``reduce_norm``."""
    if residual is not None and partial:
        return reduce_norm(norm, hidden, residual, quant)
    return _norm(norm, hidden, residual, quant)
