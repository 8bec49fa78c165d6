"""Tensor-parallel linear layers. Each allocates only its rank's shard and owns its loader.

Column-parallel layers split the output features across ranks (no communication in forward);
row-parallel layers split the input features and all-reduce their partial sums. Fused layers
(``MergedColumnParallelLinear`` for gate/up, ``QKVParallelLinear`` for q/k/v,
``SplitReplicatedLinear`` for column-parallel beside replicated matrices) hold several
checkpoint tensors side by side; their ``weight_loader`` takes a ``shard_id`` saying which one
(an index, or "q"/"k"/"v"), or ``None`` for a checkpoint that already stores the fused tensor.

The parameters themselves come from the layer's ``QuantMethod``; a loader only reads the
``output_dim`` / ``input_dim`` / ``packed_dim`` attributes the method put on them.
"""

from __future__ import annotations

import torch
from torch import nn

from lightwell.distributed.parallel_state import (
    get_tp_rank,
    get_tp_size,
    tp_all_gather,
    tp_all_reduce,
)
from lightwell.quant.base import (
    QuantizedInput,
    QuantMethod,
    UnquantizedLinearMethod,
    set_weight_attrs,
)


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator != 0:
        raise ValueError(f"{what} ({numerator}) is not divisible by {denominator}")
    return numerator // denominator


def _stored(param: torch.Tensor, dim: int, n: int) -> int:
    """Logical size ``n`` along ``dim`` -> stored size (packed quantized formats store less;
    a trailing partial pack or group takes a whole stored element)."""
    factor = (getattr(param, "pack_factors", None) or {}).get(dim)
    if factor is None and getattr(param, "packed_dim", None) == dim:
        factor = param.pack_factor
    return -(-n // factor) if factor else n


def _load_indexed(param: torch.Tensor, loaded: torch.Tensor, index: int | None) -> None:
    """A ``shard_indexed`` parameter: shard ``index``'s one-element tensor at ``index``, or the
    whole parameter at once (``index`` None: a checkpoint that stores the fused layer)."""
    if index is None:
        _check_shape(loaded.reshape(-1), param.shape, " (per-shard values)")
        param.data.copy_(loaded.reshape(-1))
        return
    if loaded.numel() != 1:
        raise ValueError(f"expected one value per shard, got shape {tuple(loaded.shape)}")
    param.data[index] = loaded.reshape(())


def _check_shape(loaded: torch.Tensor, expected: list[int] | torch.Size, what: str) -> None:
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(
            f"shape mismatch{what}: checkpoint tensor has shape {tuple(loaded.shape)}, "
            f"expected {tuple(expected)}"
        )


def _load_sharded(
    param: torch.Tensor,  # this rank's parameter
    loaded: torch.Tensor,  # the full checkpoint tensor (or one shard of a fused one)
    dim: int | None,  # the sharded dimension, None when replicated
    offset: int,  # where the shard starts in param along dim (stored units)
    size: int,  # shard size along dim (stored units)
    src_start: int,  # where this rank's slice starts in the checkpoint tensor (stored units)
    src_total: int,  # the checkpoint tensor's size along dim (stored units)
    what: str = "",
) -> None:
    if dim is None:
        if getattr(param, "shard_indexed", False):  # a per-tensor scale: [] or [1] alike
            loaded = loaded.reshape(-1)
        _check_shape(loaded, param.shape, what)
        param.data.copy_(loaded)
        return
    expected = list(param.shape)
    expected[dim] = src_total
    _check_shape(loaded, expected, what)
    param.data.narrow(dim, offset, size).copy_(loaded.narrow(dim, src_start, size))


def balanced_split(total: int, parts: int, index: int) -> tuple[int, int]:
    """(start, size) of part ``index`` when ``total`` items split into ``parts`` near-equal
    contiguous parts (the first ``total % parts`` parts one larger)."""
    base, extra = divmod(total, parts)
    return index * base + min(index, extra), base + (index < extra)


class LinearBase(nn.Module):
    def __init__(self, input_size: int, output_size: int, quant_method: QuantMethod | None):
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.quant_method = quant_method or UnquantizedLinearMethod()
        self.tp_rank = get_tp_rank()
        self.tp_size = get_tp_size()

    def _create_params(
        self, input_per_partition: int, output_sizes: list[int], bias: bool, bias_sharded: bool
    ) -> None:
        dtype = torch.get_default_dtype()
        self.quant_method.create_weights(
            self, input_per_partition, output_sizes, dtype, self.weight_loader
        )
        if not bias:
            self.register_parameter("bias", None)
            return
        b = nn.Parameter(torch.empty(sum(output_sizes), dtype=dtype), requires_grad=False)
        set_weight_attrs(b, {"output_dim": 0 if bias_sharded else None})
        set_weight_attrs(b, {"weight_loader": self.weight_loader})
        self.bias = b

    def weight_loader(
        self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: int | str | None = None
    ) -> None:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, in] -> [T, out]
        return self.quant_method.apply(self, x, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, tp={self.tp_size}"


class ReplicatedLinear(LinearBase):
    """Every rank holds the whole weight."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        quant_method: QuantMethod | None = None,
    ):
        super().__init__(input_size, output_size, quant_method)
        self._create_params(input_size, [output_size], bias, bias_sharded=False)

    def weight_loader(
        self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: int | str | None = None
    ) -> None:
        _load_sharded(param, loaded_weight, None, 0, 0, 0, 0)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks: rank r holds rows [r*out/tp, (r+1)*out/tp)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        gather_output: bool = False,
        quant_method: QuantMethod | None = None,
        output_sizes: list[int] | None = None,
        partition_sizes: list[int] | None = None,
    ):
        """``partition_sizes``: this rank's share of each of ``output_sizes`` when the split is
        not even (QKV by heads); default ``size / tp`` each."""
        super().__init__(input_size, output_size, quant_method)
        self.gather_output = gather_output
        self.output_sizes = list(output_sizes or [output_size])
        self.output_partition_sizes = partition_sizes or [
            divide(s, self.tp_size, "output size") for s in self.output_sizes
        ]
        self.output_size_per_partition = sum(self.output_partition_sizes)
        self._create_params(input_size, self.output_partition_sizes, bias, bias_sharded=True)

    def weight_loader(
        self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: int | str | None = None
    ) -> None:
        dim = getattr(param, "output_dim", None)
        size = param.shape[dim] if dim is not None else 0
        rank, tp = self.tp_rank, self.tp_size
        _load_sharded(param, loaded_weight, dim, 0, size, rank * size, tp * size)

    def forward(
        self,
        x: torch.Tensor | QuantizedInput,  # [T, in]; quantized by the norm before (W8A8)
    ) -> torch.Tensor:  # [T, out(/tp)]
        if isinstance(x, QuantizedInput):
            out = self.quant_method.apply_quantized(self, x, self.bias)
        else:
            out = self.quant_method.apply(self, x, self.bias)
        return tp_all_gather(out, dim=-1) if self.gather_output else out


class _FusedColumnLinear(ColumnParallelLinear):
    """Column-parallel matrices side by side in one weight; ``weight_loader`` takes which one.

    Subclasses say how checkpoint shards are named (``_shard_index``), how big each is in the
    checkpoint (``_checkpoint_sizes``), and which slice of it this rank holds (``_partition``).
    """

    def _shard_index(self, shard_id: int | str) -> int:
        index = int(shard_id)
        if not 0 <= index < len(self.output_sizes):
            raise ValueError(f"shard id {shard_id!r} out of range for {len(self.output_sizes)}")
        return index

    def _checkpoint_sizes(self) -> list[int]:
        return self.output_sizes

    def _partition(self, index: int) -> int:
        """Where this rank's slice of checkpoint shard ``index`` starts (logical units)."""
        return self.tp_rank * self.output_partition_sizes[index]

    def weight_loader(
        self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: int | str | None = None
    ) -> None:
        if getattr(param, "shard_indexed", False):  # one value per shard (per-tensor scales)
            _load_indexed(
                param, loaded_weight, None if shard_id is None else self._shard_index(shard_id)
            )
            return
        dim = getattr(param, "output_dim", None)
        if dim is None:  # a replicated parameter (a g_idx ...): copy whole
            _load_sharded(param, loaded_weight, None, 0, 0, 0, 0)
            return
        if shard_id is None:  # the checkpoint already stores the fused tensor
            full = [_stored(param, dim, s) for s in self._checkpoint_sizes()]
            _check_shape(loaded_weight, _with(param.shape, dim, sum(full)), " (fused)")
            for i, part in enumerate(loaded_weight.split(full, dim=dim)):
                self.weight_loader(param, part, i)
            return
        index = self._shard_index(shard_id)
        sizes = [_stored(param, dim, s) for s in self.output_partition_sizes]
        start = _stored(param, dim, self._partition(index))
        total = _stored(param, dim, self._checkpoint_sizes()[index])
        what = f" (shard {shard_id!r})"
        _load_sharded(
            param, loaded_weight, dim, sum(sizes[:index]), sizes[index], start, total, what
        )


class MergedColumnParallelLinear(_FusedColumnLinear):
    """Several column-parallel matrices side by side (gate and up): shard_id = their index."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        gather_output: bool = False,
        quant_method: QuantMethod | None = None,
    ):
        super().__init__(
            input_size, sum(output_sizes), bias, gather_output, quant_method, output_sizes
        )


class SplitReplicatedLinear(_FusedColumnLinear):
    """Matrices side by side in one weight, each column-parallel or replicated (``sharded``):
    MLA's query projection (split by heads) beside its latent one (whole on every rank), which
    read the same input; shard_id = their index."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        sharded: list[bool],
        quant_method: QuantMethod | None = None,
    ):
        tp = get_tp_size()
        self.sharded = list(sharded)
        parts = [divide(n, tp, "output size") if cut else n
                 for n, cut in zip(output_sizes, sharded)]  # fmt: skip
        super().__init__(input_size, sum(output_sizes), False, False, quant_method, output_sizes,
                         parts)  # fmt: skip

    def _partition(self, index: int) -> int:
        return self.tp_rank * self.output_partition_sizes[index] if self.sharded[index] else 0


class QKVParallelLinear(_FusedColumnLinear):
    """Fused q/k/v projection, split by heads; shard_id "q", "k", "v" (or 0, 1, 2).

    GQA-aware: with more ranks than KV heads, each KV head is replicated on
    ``tp_size // total_num_kv_heads`` ranks. When the KV heads outnumber the ranks but do not
    divide among them (SmolLM2-135M: 3 KV heads, 9 query heads, on 2 ranks), ranks take
    near-equal runs of whole KV groups (2 and 1), each with its query heads (6 and 3): the
    o_proj that follows must use the same split (``q_partition``)."""

    SHARD_IDS = {"q": 0, "k": 1, "v": 2}

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int | None = None,
        bias: bool = False,
        quant_method: QuantMethod | None = None,
    ):
        tp, rank = get_tp_size(), get_tp_rank()
        kv = total_num_kv_heads or total_num_heads
        group = divide(total_num_heads, kv, "number of attention heads over KV heads")
        self.head_size = head_size
        self.total_num_heads, self.total_num_kv_heads = total_num_heads, kv
        self.num_kv_head_replicas = 1
        if tp >= kv:
            self.num_heads = divide(total_num_heads, tp, "number of attention heads")
            self.num_kv_head_replicas = divide(tp, kv, "tensor-parallel size over KV heads")
            self.kv_head_start, self.num_kv_heads = rank // self.num_kv_head_replicas, 1
            self.q_head_start = rank * self.num_heads
        else:  # whole KV groups per rank, as even as they come
            self.kv_head_start, self.num_kv_heads = balanced_split(kv, tp, rank)
            self.q_head_start = self.kv_head_start * group
            self.num_heads = self.num_kv_heads * group
        self.q_size = self.num_heads * head_size
        self.kv_size = self.num_kv_heads * head_size
        q, k = total_num_heads * head_size, kv * head_size
        parts = [self.q_size, self.kv_size, self.kv_size]
        super().__init__(hidden_size, q + 2 * k, bias, False, quant_method, [q, k, k], parts)

    @property
    def q_partition(self) -> tuple[int, int]:
        """(start, size) of this rank's query features: the input split of the o_proj."""
        return self.q_head_start * self.head_size, self.q_size

    def _shard_index(self, shard_id: int | str) -> int:
        index = self.SHARD_IDS.get(shard_id) if isinstance(shard_id, str) else shard_id
        if index not in (0, 1, 2):
            raise ValueError(f"QKV shard id must be q, k, v or 0-2, got {shard_id!r}")
        return index

    def _checkpoint_sizes(self) -> list[int]:
        kv = self.total_num_kv_heads * self.head_size
        return [self.total_num_heads * self.head_size, kv, kv]

    def _partition(self, index: int) -> int:
        start = self.q_head_start if index == 0 else self.kv_head_start
        return start * self.head_size


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs are all-reduced (bias added once).

    With ``reduce_results=False`` the caller owns the reduction (e.g. fused with a norm).
    ``input_partition``: (start, size) of this rank's input features when the split is not
    even (an o_proj after uneven heads); default ``size / tp`` each."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        reduce_results: bool = True,
        quant_method: QuantMethod | None = None,
        input_partition: tuple[int, int] | None = None,
    ):
        super().__init__(input_size, output_size, quant_method)
        self.reduce_results = reduce_results
        if input_partition is None:
            per = divide(input_size, self.tp_size, "input size")
            input_partition = (self.tp_rank * per, per)
        self.input_start, self.input_size_per_partition = input_partition
        self._create_params(self.input_size_per_partition, [output_size], bias, bias_sharded=False)

    def weight_loader(
        self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: int | str | None = None
    ) -> None:
        dim = getattr(param, "input_dim", None)
        size = param.shape[dim] if dim is not None else 0
        start = _stored(param, dim, self.input_start) if dim is not None else 0
        total = _stored(param, dim, self.input_size) if dim is not None else 0
        _load_sharded(param, loaded_weight, dim, 0, size, start, total)

    def partial(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, in/tp] -> [T, out]
        """This rank's partial sum, not reduced (the caller reduces: e.g. on another stream)."""
        # Rank 0 alone adds the bias, so the sum over ranks holds it once.
        return self.quant_method.apply(self, x, self.bias if self.tp_rank == 0 else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, in/tp] -> [T, out]
        out = self.partial(x)
        if self.reduce_results and self.tp_size > 1:
            out = tp_all_reduce(out)
        return out

    def fused_silu_mul(self, gate_up: torch.Tensor, reduce: bool) -> torch.Tensor | None:
        """``forward`` (``reduce``) or ``partial`` of ``silu(gate) * up`` for a gated MLP's
        ``gate_up = [gate | up]`` ([T, 2 * in/tp]), with the activation fused into the matmul
        (16-bit GEMV at batch-1 decode) or into the activations' quantization (W8A8), where the
        quant method fuses it for this input (``apply_silu_mul``); else None."""
        fused = getattr(self.quant_method, "apply_silu_mul", None)
        out = fused(self, gate_up, self.bias if self.tp_rank == 0 else None) if fused else None
        if out is not None and reduce and self.reduce_results and self.tp_size > 1:
            out = tp_all_reduce(out)
        return out


def _with(shape: torch.Size, dim: int, size: int) -> list[int]:
    out = list(shape)
    out[dim] = size
    return out
