"""Test helper: write tiny HF checkpoints in the published quantized layouts, and give the HF
reference model the dequantized weights (so HF transformers in fp32 is the reference).

Layouts, as their tools write them (independently of lightwell/quant):
- GPTQ (AutoGPTQ / GPTQModel): ``qweight`` [K/P, N] int32, P = 32/bits values per word packed
  along the inputs, value j at bits j*bits; ``qzeros`` [G, N/P] packed the same way along the
  outputs, holding ``zero - 1`` (checkpoint_format gptq) or ``zero`` (gptq_v2); ``scales``
  [G, N] fp16; ``g_idx`` [K] int32. Act-order: group j holds inputs perm[j*gs:(j+1)*gs].
- AWQ (AutoAWQ GEMM): ``qweight`` [K, N/8], ``qzeros`` [G, N/8] packed along the outputs with
  nibble i of each word holding column ORDER[i] = (0, 2, 4, 6, 1, 3, 5, 7); ``scales`` [G, N].
- compressed-tensors pack-quantized: ``weight_packed`` [N, K/P] (signed values + 2^(bits-1),
  packed along the inputs), ``weight_scale`` [N, G], ``weight_shape``, and when asymmetric
  ``weight_zero_point`` [N/P, G] packed along the outputs (also offset).
- compressed-tensors int-quantized / float-quantized: ``weight`` int8 / fp8 [N, K],
  ``weight_scale`` [N, 1] or [1], static ``input_scale`` [1].
- HF fine-grained FP8: ``weight`` fp8 [N, K], ``weight_scale_inv`` [N/bn, K/bk] float32.
"""

from __future__ import annotations

import json
import os

import torch

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
QUANT_CONFIG = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    architectures=["LlamaForCausalLM"],
)


def pack_words(values: torch.Tensor, bits: int) -> torch.Tensor:
    """[R, C] unsigned -> [R, C * bits / 32] int32 along the last dim, value j at j*bits."""
    per = 32 // bits
    v = values.to(torch.int64).reshape(values.shape[0], -1, per)
    words = torch.zeros(v.shape[:2], dtype=torch.int64)
    for j in range(per):
        words |= v[:, :, j] << (bits * j)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def rtn(w: torch.Tensor, bits: int, gs: int, sym: bool, g_idx: torch.Tensor):
    """Round-to-nearest per group. w [N, K] -> (q [N, K] unsigned, scales [G, N] fp16,
    zeros [G, N] int, dequantized [N, K] fp32)."""
    n, k = w.shape
    groups = int(g_idx.max()) + 1
    maxq = 2**bits - 1
    scales, zeros = torch.zeros(groups, n), torch.zeros(groups, n, dtype=torch.int64)
    for g in range(groups):
        cols = w[:, g_idx == g]
        if sym:
            s = cols.abs().amax(1) / (maxq / 2)
            z = torch.full((n,), 2 ** (bits - 1))
        else:
            lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
            s = (hi - lo) / maxq
            z = torch.round(-lo / s).clamp(1, maxq).long()  # >= 1: GPTQ v1 stores z - 1
        scales[g], zeros[g] = s, z
    scales = scales.half()
    s_k, z_k = scales.float()[g_idx].t(), zeros[g_idx].t()  # [N, K]
    q = torch.clamp(torch.round(w / s_k) + z_k, 0, maxq).long()
    return q, scales, zeros, (q - z_k).float() * s_k


def _groups(k: int, gs: int, act_order: bool, seed: int) -> torch.Tensor:
    gs = k if gs < 0 else gs
    if not act_order:
        return torch.arange(k) // gs
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
    g_idx = torch.empty(k, dtype=torch.int64)
    g_idx[perm] = torch.arange(k) // gs
    return g_idx


def gptq_tensors(w, bits=4, gs=32, sym=True, act_order=False, v2=False, seed=0):
    g_idx = _groups(w.shape[1], gs, act_order, seed)
    q, scales, zeros, deq = rtn(w, bits, gs, sym, g_idx)
    stored_zeros = zeros if v2 else zeros - 1
    out = {
        "qweight": pack_words(q, bits).t().contiguous(),  # [K/P, N]
        "qzeros": pack_words(stored_zeros & (2**bits - 1), bits),
        "scales": scales,
        "g_idx": g_idx.to(torch.int32),
    }
    return out, deq


def awq_tensors(w, gs=32, seed=0):
    g_idx = _groups(w.shape[1], gs, False, seed)
    q, scales, zeros, deq = rtn(w, 4, gs, False, g_idx)

    def interleave(v: torch.Tensor) -> torch.Tensor:  # [R, C]: nibble i <- column ORDER[i]
        r, c = v.shape
        return v.view(r, c // 8, 8)[:, :, list(AWQ_ORDER)].reshape(r, c)

    out = {
        "qweight": pack_words(interleave(q.t().contiguous()), 4),  # [K, N/8]
        "qzeros": pack_words(interleave(zeros), 4),
        "scales": scales,
    }
    return out, deq


def ct_packed_tensors(w, bits=4, gs=32, sym=True, seed=0):
    g_idx = _groups(w.shape[1], gs, False, seed)
    q, scales, zeros, deq = rtn(w, bits, gs, sym, g_idx)
    out = {
        "weight_packed": pack_words(q, bits),  # [N, K/P]
        "weight_scale": scales.t().contiguous(),  # [N, G]
        "weight_shape": torch.tensor(list(w.shape)),
    }
    if not sym:
        out["weight_zero_point"] = pack_words(zeros, bits).t().contiguous()  # [N/P, G]
    return out, deq


def scaled_tensors(w, dtype, per_channel=True, static_input=None):
    """int8 / fp8 weights with channel ([N, 1]) or tensor ([1]) scales."""
    qmax = 127.0 if dtype == torch.int8 else 448.0
    amax = w.abs().amax(1, keepdim=True) if per_channel else w.abs().amax().reshape(1, 1)
    scale = (amax / qmax).float()
    x = (w / scale).clamp(-qmax, qmax)
    q = torch.round(x).to(dtype) if dtype == torch.int8 else x.to(dtype)
    out = {"weight": q, "weight_scale": scale if per_channel else scale.reshape(1)}
    if static_input is not None:
        out["input_scale"] = torch.tensor([static_input], dtype=torch.float32)
    return out, q.float() * scale


def fp8_block_tensors(w, block=(16, 16)):
    """Partial blocks at the edges (zero-padded for the scale, as the format allows)."""
    n, k = w.shape
    bn, bk = block
    padded = torch.nn.functional.pad(w, (0, -k % bk, 0, -n % bn))
    blocks = padded.view(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk)
    scale = (blocks.abs().amax((1, 3)) / 448.0).float()  # [N/bn, K/bk]
    q = (blocks / scale[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    deq = (q.float() * scale[:, None, :, None]).view(padded.shape)[:n, :k]
    q = q.view(padded.shape)[:n, :k]
    return {"weight": q.contiguous(), "weight_scale_inv": scale}, deq


def write_quantized(hf_model, folder: str, quant_config: dict, make) -> None:
    """Save ``hf_model`` with every decoder linear replaced by ``make(weight)`` tensors, and
    set the model's weights to the dequantized ones (the reference)."""
    from safetensors.torch import save_file

    hf_model.save_pretrained(folder)
    state, tensors = hf_model.state_dict(), {}
    for name, value in state.items():
        module = name.rsplit(".", 2)
        if len(module) == 3 and module[1] in LINEARS and module[2] == "weight":
            parts, deq = make(value.float())
            for suffix, t in parts.items():
                tensors[f"{module[0]}.{module[1]}.{suffix}"] = t.contiguous()
            value.copy_(deq)
        else:
            tensors[name] = value.contiguous()
    for f in os.listdir(folder):
        if f.endswith(".safetensors"):
            os.remove(os.path.join(folder, f))
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = quant_config
    with open(path, "w") as f:
        json.dump(cfg, f)


def ct_config(fmt: str, weights: dict, inputs: dict | None = None, ignore=("lm_head",)) -> dict:
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "ignore": list(ignore),
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"symmetric": True, "dynamic": False, **weights},
                "input_activations": inputs,
                "output_activations": None,
                "format": fmt,
            }
        },
    }


def write_quantized_moe(hf_model, folder: str, quant_config: dict, make, quantize) -> None:
    """Rewrite the HF-saved MoE checkpoint in ``folder``: every linear weight for which
    ``quantize(name)`` holds, the per-expert ones (``experts.{e}.{proj}.weight``) included,
    replaced by ``make(weight)`` tensors; the HF model gets the dequantized weights (its
    experts are stacked: ``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I])."""
    import re

    from safetensors.torch import load_file, save_file

    path = os.path.join(folder, "model.safetensors")
    tensors, out = load_file(path), {}
    params = dict(hf_model.named_parameters())
    expert = re.compile(r"^(.*\.experts)\.(\d+)\.(\w+)\.weight$")
    with torch.no_grad():
        for name, value in tensors.items():
            if not (name.endswith(".weight") and quantize(name)):
                out[name] = value
                continue
            parts, deq = make(value.float())
            out.update({f"{name[: -len('weight')]}{k}": t.contiguous() for k, t in parts.items()})
            m = expert.match(name)
            if m is None:
                params[name].copy_(deq)
                continue
            e, proj = int(m.group(2)), m.group(3)
            stacked = m.group(1).replace(".block_sparse_moe.", ".mlp.")  # Mixtral's old name
            if proj in ("down_proj", "w2"):
                params[f"{stacked}.down_proj"][e].copy_(deq)
            else:
                rows = deq.shape[0]
                up = proj in ("up_proj", "w3")
                params[f"{stacked}.gate_up_proj"][e, up * rows : (up + 1) * rows].copy_(deq)
    save_file(out, path, metadata={"format": "pt"})
    cfg_path = os.path.join(folder, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = quant_config
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
