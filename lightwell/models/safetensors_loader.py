"""Tensors of an HF folder's safetensors checkpoint (single file or sharded), read lazily."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import torch

INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(folder: str) -> list[str]:
    """The checkpoint files: those the index names, else every ``*.safetensors`` in the folder."""
    index = os.path.join(folder, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map", {})
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not os.path.isfile(os.path.join(folder, n))]
        if missing:
            raise FileNotFoundError(f"{index} names missing shard file(s): {', '.join(missing)}")
    else:
        names = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    if not names:
        raise FileNotFoundError(
            f"{folder} holds no .safetensors files (Lightwell does not load .bin/.pt checkpoints)"
        )
    return [os.path.join(folder, n) for n in names]


class SafetensorsCheckpoint:
    """Iterate ``(source, name, tensor)`` over a folder's checkpoint, one tensor at a time."""

    def __init__(self, folder: str):
        from safetensors import safe_open

        self.files = safetensors_files(folder)
        self._count = 0
        for path in self.files:
            with safe_open(path, framework="pt") as f:  # reads the header only
                self._count += len(list(f.keys()))

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[tuple[str, str, torch.Tensor]]:
        from safetensors import safe_open

        for path in self.files:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    yield path, name, f.get_tensor(name)
