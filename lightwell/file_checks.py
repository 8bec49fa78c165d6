"""A model file's integrity, checked before anything loads it: a truncated or corrupt .gguf or
.safetensors file is named in one line (what is wrong, what to do), not a loader's traceback.

Only headers are read (GGUF metadata and tensor table; the safetensors JSON header) and each
tensor's extent is checked against the file's size. Pure Python, no torch.
"""

from __future__ import annotations

import json
import mmap
import os
import struct

_ADVICE = "the file is truncated or corrupt: copy or download it again"
# GGUF metadata value types: struct format of the scalars; 8 = string, 9 = array
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q"}
_SCALARS[12] = "d"
_U64 = struct.Struct("<Q")


class _Reader:
    """Little-endian reads from a buffer; ValueError past its end."""

    def __init__(self, buf: bytes | mmap.mmap) -> None:
        self.buf, self.pos = buf, 0

    def take(self, fmt: str) -> object:
        size = struct.calcsize("<" + fmt)
        if self.pos + size > len(self.buf):
            raise ValueError(f"the header ends early (at byte {len(self.buf)})")
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = int(self.take("Q"))
        if self.pos + n > len(self.buf):
            raise ValueError(f"the header ends early (at byte {len(self.buf)})")
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int) -> object:
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype])
        if vtype == 8:
            return self.string()
        if vtype == 9:
            item, count = int(self.take("I")), int(self.take("Q"))
            if item in _SCALARS:  # skipped whole
                self.pos += count * struct.calcsize("<" + _SCALARS[item])
                if self.pos > len(self.buf):
                    raise ValueError(f"the header ends early (at byte {len(self.buf)})")
                return None
            if item == 8:  # strings (a vocabulary): lengths only
                pos, buf = self.pos, self.buf
                for _ in range(count):
                    pos += 8 + _U64.unpack_from(buf, pos)[0]
                self.pos = pos
                return None
            for _ in range(count):
                self.value(item)
            return None
        raise ValueError(f"unknown metadata value type {vtype}")


def check_gguf_file(path: str) -> None:
    """ValueError (one line) if ``path`` is not a complete GGUF file."""
    size = os.path.getsize(path)
    if size < 24:
        raise ValueError(f"{path}: {size} bytes, too short for a GGUF file; {_ADVICE}")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file (it does not start with 'GGUF')")
        try:
            last_name, end = _gguf_extent(_Reader(buf))
        except (ValueError, struct.error, OverflowError) as e:
            why = f"the header ends early (at byte {size})" if isinstance(e, struct.error) else e
            raise ValueError(f"{path}: not a valid GGUF file ({why}); {_ADVICE}") from None
    if end > size:
        raise ValueError(
            f"{path}: tensor {last_name!r} ends at byte {end} but the file has {size} bytes; "
            + _ADVICE
        )


def _gguf_extent(r: _Reader) -> tuple[str, int]:
    """(the tensor ending last, its end offset in the file)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    r.take("I")  # magic
    r.take("I")  # version
    n_tensors, n_kv = int(r.take("Q")), int(r.take("Q"))
    alignment = 32
    for _ in range(n_kv):
        key, vtype = r.string(), int(r.take("I"))
        value = r.value(vtype)
        if key == "general.alignment" and isinstance(value, int) and value > 0:
            alignment = value
    tensors = []
    for _ in range(n_tensors):
        name, n_dims = r.string(), int(r.take("I"))
        numel = 1
        for _ in range(n_dims):
            numel *= int(r.take("Q"))
        ggml_type, offset = int(r.take("I")), int(r.take("Q"))
        try:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
        except (ValueError, KeyError):
            raise ValueError(f"tensor {name!r} has unknown type {ggml_type}") from None
        tensors.append((name, offset + numel // block * type_size))
    data_start = -(-r.pos // alignment) * alignment
    name, end = max(tensors, key=lambda t: t[1]) if tensors else ("", 0)
    return name, data_start + end


def check_safetensors_file(path: str) -> None:
    """ValueError (one line) if the header does not parse or names bytes past the end."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        first8 = f.read(8)
        n = int.from_bytes(first8, "little") if len(first8) == 8 else -1
        if n < 0 or n > size - 8:
            raise ValueError(f"{path}: not a valid safetensors file (bad header length); {_ADVICE}")
        try:
            header = json.loads(f.read(n))
            ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
        except (ValueError, TypeError, KeyError, AttributeError, IndexError):
            why = "not a valid safetensors file (bad header)"
            raise ValueError(f"{path}: {why}; {_ADVICE}") from None
    end = 8 + n + max(ends, default=0)
    if end > size:
        raise ValueError(
            f"{path}: the tensors end at byte {end} but the file has {size} bytes; {_ADVICE}"
        )


def check_model_file(kind: str, path: str) -> None:
    """Check a local model (``kind`` "gguf": the file; "hf": every *.safetensors in the folder)."""
    if kind == "gguf":
        check_gguf_file(path)
        return
    if kind == "hf" and os.path.isdir(path):
        for name in sorted(os.listdir(path)):
            if name.endswith(".safetensors"):
                check_safetensors_file(os.path.join(path, name))
