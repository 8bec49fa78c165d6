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


_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip
MAX_HEADER_BYTES = 100 << 20


def header_length(first8: bytes, total: int) -> int:
    """The JSON header's length from a file's first 8 bytes; ValueError if it cannot fit."""
    if len(first8) < 8 or total < 8:
        raise ValueError(f"{total} bytes: too short for a safetensors file")
    n = int.from_bytes(first8[:8], "little")
    if n > min(total - 8, MAX_HEADER_BYTES):
        raise ValueError(f"header length {n} does not fit the file's {total} bytes")
    return n


def parse_header(header: bytes, total: int) -> dict[str, tuple[torch.dtype, list[int], int, int]]:
    """name -> (dtype, shape, begin, end) with offsets from the file's start, every entry
    checked against the file's ``total`` size; ValueError on a corrupt or truncated file."""
    try:
        entries = json.loads(bytes(header))
    except (UnicodeDecodeError, ValueError):
        raise ValueError("the header is not valid JSON") from None
    if not isinstance(entries, dict):
        raise ValueError("the header is not a JSON object")
    entries.pop("__metadata__", None)
    base, out = 8 + len(header), {}
    for name, info in entries.items():
        try:
            dtype, shape = _DTYPES[info["dtype"]], [int(d) for d in info["shape"]]
            begin, end = (base + int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"tensor {name!r}: malformed header entry {info!r}") from None
        numel = 1
        for d in shape:
            numel *= d
        if end - begin != numel * dtype.itemsize or begin < base:
            raise ValueError(f"tensor {name!r}: offsets do not match its shape and dtype")
        if end > total:
            raise ValueError(f"tensor {name!r} ends at byte {end}, past the file's {total}")
        out[name] = (dtype, shape, begin, end)
    return out


def tensors_from_buffer(buf: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of a safetensors file held in memory (``buf``: uint8 [N]); views of it
    where their bytes are aligned, copies where not. ValueError on a corrupt file."""
    total = buf.numel()
    n = header_length(bytes(buf[:8].tolist()) if total >= 8 else b"", total)
    entries = parse_header(buf[8 : 8 + n].numpy().tobytes(), total)
    for name, (dtype, shape, begin, end) in entries.items():
        raw = buf[begin:end]
        if begin % dtype.itemsize:
            raw = raw.clone()
        yield name, raw.view(dtype).view(shape)


def check_safetensors_file(path: str) -> None:
    """ValueError if the file's header does not parse or names bytes past its end."""
    total = os.path.getsize(path)
    with open(path, "rb") as f:
        n = header_length(f.read(8), total)
        parse_header(f.read(n), total)
