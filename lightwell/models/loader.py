"""Build a model and fill its weights: routing between safetensors, GGUF and dummy weights.

    files = resolve_model(path)                       # lightwell.model_files
    hf_config = load_hf_config(files, overrides)      # lightwell.models.hf_config
    model = load_model(files, hf_config, torch.bfloat16, torch.device("cuda"))

Call ``init_tp_group`` first under tensor parallelism: layers read rank and size at build time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from lightwell import progress
from lightwell.model_files import ModelFiles
from lightwell.models.hf_config import load_hf_config
from lightwell.models.registry import get_model_class
from lightwell.quant import describe

__all__ = ["load_hf_config", "load_model", "resolve_load_format"]


def resolve_load_format(files: ModelFiles | None, load_format: str) -> str:
    if load_format == "auto":
        if files is None:
            raise ValueError("load_format 'auto' needs model files")
        return "safetensors" if files.kind == "hf" else "gguf"
    if load_format not in ("safetensors", "gguf", "dummy"):
        raise ValueError(f"unknown load_format {load_format!r}")
    if load_format != "dummy" and (files is None or files.kind != _KIND[load_format]):
        where = files.path if files is not None else "no model files"
        raise ValueError(f"load_format {load_format!r} does not fit {where}")
    return load_format


_KIND = {"safetensors": "hf", "gguf": "gguf"}


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(prev)


@torch.no_grad()
def load_model(
    files: ModelFiles | None,
    hf_config: Any,
    dtype: torch.dtype,
    device: torch.device | str,
    load_format: str = "auto",
    seed: int = 0,
    quantization: str = "auto",
    cpu_int8_activations: bool = False,
) -> nn.Module:
    """The model for ``hf_config``, built on ``device`` in ``dtype``, weights loaded, in eval
    mode. ``files`` may be None for ``load_format="dummy"``. ``quantization``: see
    ``lightwell.quant`` (auto: the checkpoint's ``quantization_config``, if any).
    ``cpu_int8_activations``: GGUF blocks on the CPU take int8 inputs in small steps."""
    fmt = resolve_load_format(files, load_format)
    cls = get_model_class(hf_config)
    device = torch.device(device)
    if quantization == "auto" and _gguf_kernels_fit(files, fmt, dtype, device):
        quantization = "gguf"
    method = _quant_method(hf_config, quantization, fmt, device, cpu_int8_activations)
    with torch.device(device), _default_dtype(dtype):
        model = cls(hf_config, method) if method is not None else cls(hf_config)
    # a method that also swaps the embedding and LM head: True when they take blocks
    raw = bool(method.prepare_model(model)) if hasattr(method, "prepare_model") else False
    if fmt == "dummy":
        from lightwell.models.dummy import init_dummy_weights

        with progress.stage("Initialising random weights") as st:
            init_dummy_weights(model, seed)
            _sync(device)
            st.summary = f"initialised random weights on {device}"
    else:
        checkpoint = _open_checkpoint(files, fmt, hf_config, method, raw)
        _load_checkpoint(model, checkpoint, files.path, method, device)
    _process_after_loading(model, method, device)
    if device.type == "cpu":
        _trim_heap()
    return model.eval()


def _trim_heap() -> None:
    """Hand the heap's free pages (the load's scratch: blocks read, then joined or converted)
    back to the OS, so the resident memory is the model's (glibc only; elsewhere nothing)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError, TypeError):
        pass


def _sync(device: torch.device) -> None:
    """Wait for the device's queued copies and kernels (a stage's seconds include them)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _process_after_loading(model: nn.Module, method: Any, device: torch.device) -> None:
    """Each layer's quantization method converts its loaded weights (repacking for a kernel,
    quantizing an unquantized checkpoint): a stage of its own when the model is quantized."""
    layers = [m for m in model.modules() if getattr(m, "quant_method", None) is not None]
    if method is None:  # unquantized: nothing to convert
        for layer in layers:
            layer.quant_method.process_after_loading(layer)
        return
    with progress.stage("Converting quantized weights", len(layers), "layer") as st:
        for layer in st.iter(layers):
            layer.quant_method.process_after_loading(layer)
        _sync(device)
        st.summary = f"converted the weights of {len(layers)} layers ({type(method).__name__})"


def _gguf_kernels_fit(
    files: ModelFiles | None, fmt: str, dtype: torch.dtype, device: torch.device
) -> bool:
    """``auto`` keeps a GGUF file's blocks (``quant.gguf_cpu``) on a single CPU rank in
    float32 when every quantized tensor's type and every layer matrix's type (none of them
    float: those would be joined at every call) is one the compiled CPU kernels take; else
    the file is dequantized at load."""
    from lightwell.distributed.parallel_state import get_tp_size
    from lightwell.distributed.pipeline import get_pp_size

    if fmt != "gguf" or device.type != "cpu" or dtype != torch.float32:
        return False
    if get_tp_size() != 1 or get_pp_size() != 1:
        return False
    from lightwell.models.gguf_config import open_gguf
    from lightwell.quant.gguf_cpu import supported

    float_types = {0, 1, 30}  # F32, F16, BF16
    tensors = open_gguf(files.path).tensors
    types = {int(t.tensor_type) for t in tensors} - float_types
    layers = {int(t.tensor_type) for t in tensors if t.name.startswith("blk.") and len(t.shape) > 1}
    return bool(layers) and not layers & float_types and all(supported(q) for q in types)


def _quant_method(
    hf_config: Any, quantization: str, fmt: str, device: torch.device, int8_act: bool = False
) -> Any:
    """``gguf``: a GGUF file's linears stay in the file's blocks (CPU, CUDA); other values as
    ``lightwell.quant.get_quant_method`` (a GGUF file's weights arrive dequantized)."""
    from lightwell.quant import get_quant_method

    if fmt == "gguf" and quantization in ("gptq", "awq", "compressed-tensors"):
        raise ValueError(f"quantization {quantization!r} does not apply to a GGUF file")
    if quantization == "gguf":
        if fmt != "gguf" or device.type not in ("cpu", "cuda"):
            raise ValueError("quantization 'gguf' keeps a .gguf file's blocks, on CPU or CUDA")
        from lightwell.quant.gguf import GGUFLinearMethod

        return GGUFLinearMethod(int8_act=int8_act and device.type == "cpu")
    return get_quant_method(hf_config, quantization)


def _open_checkpoint(
    files: ModelFiles, fmt: str, hf_config: Any, method: Any = None, raw: bool = False
) -> Any:
    """A sized iterable of ``(source, hf_name, tensor)``; ``raw``: a GGUF file's token
    embedding and LM head as their blocks where the CPU kernels take their type."""
    if fmt == "gguf":
        from lightwell.models.gguf_loader import GGUFCheckpoint

        keep = type(method).__name__ == "GGUFLinearMethod"
        return GGUFCheckpoint(files.path, hf_config, keep_quantized=keep, raw_embeddings=raw)
    if files.remote is not None:
        from lightwell.models.remote_model import S3Checkpoint

        return S3Checkpoint(files.remote, files.path, progress=progress.enabled())
    from lightwell.models.safetensors_loader import SafetensorsCheckpoint

    return SafetensorsCheckpoint(files.path)


class _Tracked:
    """Yields ``(name, tensor)`` while remembering where the current tensor came from, the
    stage's bar advancing a tensor at a time."""

    def __init__(self, items: Iterable[tuple[str, str, torch.Tensor]], st: progress.Stage):
        self.items, self.stage = items, st
        self.current: tuple[str, str] | None = None

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for source, name, tensor in self.stage.iter(self.items):
            self.current = (source, name)
            yield name, tensor
        self.current = None


def _load_checkpoint(
    model: nn.Module, checkpoint: Any, path: str, method: Any, device: torch.device
) -> None:
    """Every tensor read (a GGUF file's blocks dequantized as they are read, unless kept
    quantized) and copied into its parameter, which lives on ``device`` already."""
    total = len(checkpoint)
    with progress.stage(f"Loading weights ({device})", total, "tensor") as st:
        loaded = _load_tracked(model, _Tracked(checkpoint, st), path, method)
        _sync(device)
        st.summary = f"loaded {total} weight tensors onto {device}"
    _check_complete(model, loaded, path, method)


def _load_tracked(model: nn.Module, tracked: _Tracked, path: str, method: Any) -> set[str]:
    try:
        return model.load_weights(tracked)
    except ValueError as e:
        if tracked.current is None:
            raise ValueError(f"{path}: {e}") from e
        source, name = tracked.current
        raise ValueError(f"{source}: tensor {name!r}: {e}{_quant_hint(name, method)}") from e


def _check_complete(model: nn.Module, loaded: set[str], path: str, method: Any) -> None:
    missing = sorted(set(dict(model.named_parameters())) - loaded)
    if missing and method is not None:
        raise ValueError(
            f"{path}: the checkpoint does not match its quantization config: no tensor for "
            f"{missing[0]} ({len(missing)} missing); the layers expect {describe(method)}"
        )
    if missing:
        shown = ", ".join(missing[:8]) + (
            f" ... ({len(missing)} in all)" if len(missing) > 8 else ""
        )
        raise ValueError(f"{path}: checkpoint is missing tensor(s) for parameter(s) {shown}")


def _quant_hint(name: str, method: Any) -> str:
    """Why a tensor may not fit: the checkpoint's tensors and its quantization config disagree."""
    from lightwell.quant import QUANTIZED_SUFFIXES

    if method is not None:
        return (
            f" (the checkpoint does not match its quantization config: the layers expect "
            f"{describe(method)})"
        )
    if name.endswith(QUANTIZED_SUFFIXES):
        return " (a quantized tensor, but config.json has no quantization_config)"
    return ""
