"""Quantization methods: a registry from the checkpoint's ``quantization_config`` (config.json)
or the ``--quantization`` option to the ``QuantMethod`` every linear layer of the model uses.
Method modules are imported only when chosen.

``--quantization`` values: ``auto`` (what config.json says, else none), ``none`` (refuses a
quantized checkpoint), a checkpoint method (must match config.json's ``quant_method``), or
``int8`` / ``fp8``: quantize a 16/32-bit checkpoint at load (``fp8`` also reads HF fine-grained
FP8 checkpoints, whose ``quant_method`` is ``fp8``).
"""

from __future__ import annotations

import importlib
from typing import Any

from lightwell.config import QUANTIZATIONS

# checkpoint quant_method -> module with from_config(quantization_config) -> QuantMethod
CHECKPOINT_METHODS = {
    "gptq": "lightwell.quant.gptq",
    "awq": "lightwell.quant.awq",
    "compressed-tensors": "lightwell.quant.compressed_tensors",
    "fp8": "lightwell.quant.fp8",
}
# --quantization value -> (module, function) quantizing a 16/32-bit checkpoint at load
ONLINE_METHODS = {
    "int8": ("lightwell.quant.int8", "from_config"),
    "fp8": ("lightwell.quant.fp8", "online"),
}
# tensor-name endings that only quantized checkpoints hold (for a clearer error without a config)
QUANTIZED_SUFFIXES = (
    ".qweight", ".qzeros", ".scales", ".g_idx", ".weight_packed", ".weight_scale",
    ".weight_scale_inv", ".input_scale", ".weight_zero_point", ".weight_shape",
)  # fmt: skip


def checkpoint_quant_config(hf_config: Any) -> dict[str, Any] | None:
    """config.json's ``quantization_config`` (a dict), or None."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else dict(vars(qc))
    return qc


def _method_name(qc: dict[str, Any]) -> str:
    name = str(qc.get("quant_method", "")).lower().replace("_", "-")
    if name not in CHECKPOINT_METHODS:
        raise ValueError(
            f"quantization_config: quant_method {qc.get('quant_method')!r} is not supported; "
            f"supported: {', '.join(CHECKPOINT_METHODS)} (and --quantization int8 / fp8 of an "
            "unquantized checkpoint)"
        )
    return name


def get_quant_method(hf_config: Any, quantization: str = "auto") -> Any:
    """The ``QuantMethod`` for the model's linear layers, or None (unquantized)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization {quantization!r} is not one of {', '.join(QUANTIZATIONS)}")
    qc = checkpoint_quant_config(hf_config)
    if qc is None:
        if quantization in ("auto", "none"):
            return None
        if quantization in ONLINE_METHODS:
            module, fn = ONLINE_METHODS[quantization]
            return getattr(importlib.import_module(module), fn)({})
        raise ValueError(
            f"quantization {quantization!r} reads {quantization} checkpoints, but config.json "
            "has no quantization_config; to quantize a 16/32-bit checkpoint at load use int8 "
            "or fp8"
        )
    name = _method_name(qc)
    if quantization == "none":
        raise ValueError(
            f"the checkpoint is quantized ({name}); quantization 'none' cannot load it"
        )
    if quantization not in ("auto", name):
        raise ValueError(
            f"quantization {quantization!r} does not match the checkpoint's quantization_config "
            f"(quant_method {name!r}); use auto or {name}"
        )
    return importlib.import_module(CHECKPOINT_METHODS[name]).from_config(qc)


def describe(method: Any) -> str:
    """A method's name and the tensors it reads per linear (for load errors)."""
    tensors = getattr(method, "checkpoint_tensors", ("weight",))
    return f"{type(method).__name__} (per linear: {', '.join(tensors)})"
