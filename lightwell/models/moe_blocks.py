"""The parts the MoE families share: the sparse MLP block, its decoder layer, and the routing
of HF's per-expert checkpoint tensors to the stacked expert weights.

``MoEBlock``: router (``gate``, a replicated [E, H] weight), routed experts (``FusedMoE``), and
optionally a shared expert (DeepSeek's ``shared_experts``; Qwen2-MoE's ``shared_expert`` scaled
per token by ``sigmoid(shared_expert_gate(x))``). Its ``partial`` is this rank's partial sum of
all of them: one all-reduce for the whole block, consumed by the next norm like a dense MLP's.

DeepSeek's shared experts (``shared_experts``) are stacked after the routed ones where
``folds_shared_experts`` allows (``FusedMoE(num_shared=S)``; ``lightwell/models/deepseek_v2.py``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightwell.distributed.parallel_state import tp_all_reduce
from lightwell.layers.linear import ReplicatedLinear
from lightwell.layers.moe import FusedMoE, RouterConfig, folds_shared_experts, select_experts
from lightwell.layers.norm import DeferredNorm, RMSNorm, pre_norm, reduce_norm
from lightwell.layers.rotary import RotaryEmbedding
from lightwell.models.llama import LlamaMLP
from lightwell.models.pipeline import skip_missing
from lightwell.models.weight_utils import load_packed_weights
from lightwell.quant.base import QuantMethod


def num_experts_of(config: Any) -> int:
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        value = getattr(config, key, None)
        if value:
            return int(value)
    raise ValueError("the MoE config gives no number of experts")


def gated_mlp(config: Any, intermediate_size: int, quant_method: QuantMethod | None) -> LlamaMLP:
    """A dense silu-gated MLP of ``intermediate_size`` (shared experts, dense layers)."""
    shape = SimpleNamespace(
        hidden_size=config.hidden_size,
        intermediate_size=intermediate_size,
        hidden_act=getattr(config, "hidden_act", "silu"),
        mlp_bias=False,
    )
    return LlamaMLP(shape, quant_method)


class Router(nn.Module):
    """The router's [E, H] weight (replicated), optionally kept and applied in fp32 (DeepSeek:
    HF's reference routes in fp32, so bf16 logits could pick other experts), and DeepSeek-V3's
    ``e_score_correction_bias`` [E] (fp32)."""

    def __init__(self, hidden: int, experts: int, fp32: bool, correction_bias: bool):
        super().__init__()
        dtype = torch.float32 if fp32 else torch.get_default_dtype()
        self.weight = nn.Parameter(torch.empty(experts, hidden, dtype=dtype), False)
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(experts, dtype=torch.float32), False)
            if correction_bias
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, E] in the weight's dtype
        if isinstance(x, DeferredNorm):  # the norm in the router's GEMV, which stores the rows
            return x.matmul(self.weight, write_normed=True, out_dtype=self.weight.dtype)
        if x.is_cuda:  # Triton kernels load on CUDA only (the CPU image has no Triton)
            from lightwell.kernels.gemv import MAX_M, gemv

            if x.shape[0] <= MAX_M:  # decode: one launch, x not cast
                return gemv(x, self.weight, out_dtype=self.weight.dtype)
        return F.linear(x.to(self.weight.dtype), self.weight)


class MoEBlock(nn.Module):
    def __init__(
        self,
        config: Any,
        router: RouterConfig,
        intermediate_size: int,
        quant_method: QuantMethod | None,
        *,
        shared: tuple[str, int] | None = None,  # (attribute name, intermediate size)
        shared_experts: int = 0,  # DeepSeek: shared experts of the routed size (with ``shared``)
        shared_gate: bool = False,  # Qwen2-MoE: sigmoid(shared_expert_gate(x)) per token
        correction_bias: bool = False,  # DeepSeek-V3: gate.e_score_correction_bias
        router_fp32: bool = False,  # the router's weight and logits in fp32 (DeepSeek)
    ):
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"MoE experts support hidden_act 'silu' only, not {config.hidden_act}")
        num_experts = num_experts_of(config)
        self.router = router
        self.gate = Router(config.hidden_size, num_experts, router_fp32, correction_bias)
        if shared_experts and folds_shared_experts(quant_method):
            shared = None  # stacked after the routed experts, run in their launches
        else:
            shared_experts = 0
        self.experts = FusedMoE(
            num_experts, config.hidden_size, intermediate_size, quant_method, shared_experts
        )
        self.shared_name = shared[0] if shared else None
        if shared:
            setattr(self, shared[0], gated_mlp(config, shared[1], quant_method))
        self.shared_expert_gate = (
            ReplicatedLinear(config.hidden_size, 1, bias=False) if shared_gate else None
        )

    takes_deferred_norm = True  # ``partial``'s x may be a DeferredNorm (the router's GEMV)

    def partial(
        self, x: torch.Tensor | DeferredNorm
    ) -> torch.Tensor:  # [T, H] -> [T, H], not all-reduced
        bias = self.gate.e_score_correction_bias
        logits = self.gate(x)
        if isinstance(x, DeferredNorm):
            x = x.rows()  # written by the router's GEMV
        weights, ids = select_experts(logits, self.router, bias)  # [T, k] each
        out = self.experts(x, weights, ids)
        if self.shared_name is not None:
            shared = getattr(self, self.shared_name).partial(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        return tp_all_reduce(self.partial(x))

    def compile_kernel_variants(self) -> int:
        """Compile the grouped expert kernels at every tile steps can pick
        (kernels/fused_moe.grouped_variants) and the few-token path, so no step compiles while
        serving; a no-op off CUDA. Returns the launches made."""
        experts = self.experts
        if not experts.cuda_graph_safe:
            return 0
        first = next(experts.parameters())
        k, num_tokens = self.router.top_k, 16
        hidden = self.gate.weight.shape[1]
        x = torch.zeros(num_tokens, hidden, dtype=experts.act_dtype, device=first.device)
        ids = torch.arange(num_tokens * k, device=first.device).view(num_tokens, k)
        ids = ids % experts.num_local_experts
        weights = torch.ones(num_tokens, k, dtype=torch.float32, device=first.device)
        from lightwell.kernels.fused_moe import grouped_variants

        method = experts.quant_method
        variants = grouped_variants(method.kernel_inputs(experts)[2], experts.act_dtype)
        for tiles in variants:
            method.apply(experts, x, weights, ids, gemv=False, **tiles)
        if experts.num_shared:  # large steps add the shared MLP's output in the pair sum
            method.apply(experts, x, weights, ids, gemv=False, add=torch.zeros_like(x))
        for few in (1, 2):  # the few-token path (one and two tokens' down tiles differ)
            method.apply(experts, x[:few], weights[:few], ids[:few])
        return len(variants) + 2 + bool(experts.num_shared)


class MoEDecoderLayer(nn.Module):
    """A pre-norm decoder layer whose MLP ``make_mlp`` picks per layer (sparse or dense);
    ``forward`` returns the MLP's partial sum, as ``LlamaDecoderLayer`` does."""

    partial_output = True

    def __init__(
        self,
        config: Any,
        layer_idx: int,
        rotary_emb: RotaryEmbedding,
        quant_method: QuantMethod | None,
        attention_cls: type[nn.Module],
    ):
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.self_attn = attention_cls(config, layer_idx, rotary_emb, quant_method)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.mlp = self.make_mlp(config, layer_idx, quant_method)

    def make_mlp(self, config: Any, layer_idx: int, quant_method: QuantMethod | None) -> nn.Module:
        raise NotImplementedError

    def forward(
        self,
        positions: torch.Tensor,  # [T]
        hidden: torch.Tensor,  # [T, H]: the embedding, or the previous layer's partial sum
        residual: torch.Tensor | None,  # [T, H]; None before the first layer
    ) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, H] MLP partial sum, [T, H] residual)
        # one decode row: each norm inside the GEMV that reads it, where the consumer takes it
        norm = self.input_layernorm
        rows = DeferredNorm.for_consumer(self.self_attn, norm, hidden, residual)
        if rows is not None:
            hidden, residual = self.self_attn.partial(positions, rows), rows.residual
        else:
            hidden, residual = pre_norm(norm, hidden, residual, partial=True)
            hidden = self.self_attn.partial(positions, hidden)
        norm = self.post_attention_layernorm
        rows = DeferredNorm.for_consumer(self.mlp, norm, hidden, residual)
        if rows is not None:
            return self.mlp.partial(rows), rows.residual
        hidden, residual = reduce_norm(norm, hidden, residual)
        return self.mlp.partial(hidden), residual


def hf_skip(model: nn.Module) -> Callable[[str], bool]:
    """Checkpoint names a model leaves alone: RoPE buffers, and a tied LM head."""
    tied = bool(getattr(model, "tie_word_embeddings", False))

    def skip(name: str) -> bool:
        if "rotary_emb.inv_freq" in name or "rotary_emb.cos_cached" in name:
            return True
        return tied and name.startswith("lm_head.")

    return skip


_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(\w+)\.(\w+)$")


def load_moe_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    packed_modules_mapping: dict[str, list[str]],
    expert_names: dict[str, str],  # checkpoint projection name -> "gate" / "up" / "down"
    skip: Callable[[str], bool] = lambda name: False,
) -> set[str]:
    """``load_packed_weights`` with per-expert tensors (``...experts.{e}.{proj}.{tensor}``)
    routed to the stacked ``w13_{tensor}`` / ``w2_{tensor}`` loaders; a stacked parameter counts
    as loaded once every expert's shards arrived."""
    skip = skip_missing(model, skip)  # tensors of the layers other pipeline stages hold
    params = dict(model.named_parameters())
    seen: dict[str, set[tuple[str, int]]] = {}
    weights = dequantized_8bit(weights, _router)  # a checkpoint may quantize the routers

    tensors = set(model_experts_tensors(model))

    def others() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            match = _EXPERT.match(name)
            if match is None or match.group(3) not in expert_names or skip(name):
                yield name, tensor
                continue
            prefix, expert, shard = match.group(1), int(match.group(2)), expert_names[match[3]]
            if match.group(4) in IGNORED_EXPERT_TENSORS and match.group(4) not in tensors:
                continue  # a g_idx without act-order (contiguous groups), a weight_shape
            target = f"{prefix}.{'w2' if shard == 'down' else 'w13'}_{match.group(4)}"
            param = params.get(target)
            if param is None:
                raise ValueError(f"unexpected tensor {name!r}: no parameter {target!r}")
            param.weight_loader(param, tensor, shard, expert)
            seen.setdefault(target, set()).add((shard, expert))

    loaded = load_packed_weights(model, others(), packed_modules_mapping, skip)
    for target, shards in seen.items():
        module = model.get_submodule(target.rsplit(".", 1)[0])
        per_expert = 1 if target.rsplit(".", 1)[1].startswith("w2_") else 2
        if len(shards) == per_expert * (module.num_experts + module.num_shared):
            loaded.add(target)
    return loaded


IGNORED_EXPERT_TENSORS = ("g_idx", "weight_shape")


def _router(module: str) -> bool:
    """A MoE router (``mlp.gate``; Qwen2-MoE's ``mlp.shared_expert_gate``): it runs unquantized."""
    return module.endswith((".mlp.gate", ".mlp.shared_expert_gate"))


def dequantized_8bit(
    weights: Iterable[tuple[str, torch.Tensor]],
    float_module: Callable[[str], bool],  # module name -> it runs unquantized
    block: tuple[int, int] = (128, 128),  # a block-scaled weight's [bn, bk]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with the 8-bit weights of modules that run unquantized (MoE
    routers; DeepSeek's kv_b_proj, which MLA absorbs) replaced by fp32 ones, dequantized once
    their scale arrives: a block scale (HF fine-grained ``weight_scale_inv`` or
    compressed-tensors' block ``weight_scale``) or a scale per row or per tensor
    (compressed-tensors int8 / fp8); a static ``input_scale`` is dropped. Other tensors pass."""
    held: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        module, _, kind = name.rpartition(".")
        if kind not in _SCALED_TENSORS or not float_module(module):
            yield name, tensor
            continue
        if kind == "weight" and tensor.dtype not in (torch.float8_e4m3fn, torch.int8):
            yield name, tensor
            continue
        if kind == "input_scale":
            continue
        parts = held.setdefault(module, {})
        parts[kind] = tensor
        if len(parts) == 2:
            del held[module]
            scale = parts.get("weight_scale_inv", parts.get("weight_scale"))
            yield f"{module}.weight", _dequantize(parts["weight"], scale, block)
    if held:
        raise ValueError(f"{next(iter(held))}: an 8-bit weight without its scale (or back)")


def _dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    from lightwell.quant.fp8 import dequantize_blocks

    rows = weight.shape[0]
    if scale.numel() == 1 or tuple(scale.shape) in ((rows,), (rows, 1)):
        return weight.float() * scale.float().reshape(-1, 1)  # per tensor or per row
    return dequantize_blocks(weight, scale, block)


_SCALED_TENSORS = ("weight", "weight_scale_inv", "weight_scale", "input_scale")


def model_experts_tensors(model: nn.Module) -> Iterator[str]:
    """The checkpoint tensor names (``weight``, ``qweight`` ...) the model's experts read."""
    for module in model.modules():
        if isinstance(module, FusedMoE):
            yield from module.quant_method.checkpoint_tensors
