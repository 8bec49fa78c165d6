"""A lean GGUF reader: the metadata and tensor table parsed with ``struct``, tensor data as
views of one read-only memory map. Arrays of strings (a tokenizer's vocabulary and merges) are
decoded only when asked for, so reading a config holds no per-token Python objects.

The interface is the part of gguf-py's ``GGUFReader`` that Lightwell uses: ``fields[key]`` with
``contents()`` and ``len()``, ``tensors`` with ``name``, ``tensor_type``, ``shape`` (GGUF order,
fastest dimension first) and ``data`` (numpy, rows first: uint8 [..., bytes per row] for block
types, the element dtype for float and integer types).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}  # fmt: skip
_STRING, _ARRAY = 8, 9
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
          6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}  # fmt: skip
# tensor types stored as plain elements (else blocks: uint8 rows)
_ELEMENTS = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32,
             27: np.int64, 28: np.float64}  # fmt: skip


class Field:
    """One metadata value: a scalar, a numeric array (numpy) or a string array (lazy)."""

    def __init__(self, buf: Any, kind: int, value: Any, count: int = 1, start: int = 0):
        self._buf, self.kind, self._value, self.count, self._start = buf, kind, value, count, start

    def __len__(self) -> int:
        return self.count

    def contents(self) -> Any:
        if self.kind == _STRING and self._value is None:  # a string array, decoded now
            out, pos = [], self._start
            for _ in range(self.count):
                s, pos = _string(self._buf, pos)
                out.append(s)
            return out
        if isinstance(self._value, np.ndarray):
            return self._value.tolist()
        return self._value


@dataclass
class Tensor:
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: the fastest-varying dimension first
    data: np.ndarray  # a view of the file's memory map
    path: str
    offset: int  # of the data in the file

    def read(self) -> np.ndarray:
        """The data as a new array read from the file (``data``'s shape and dtype): unlike
        ``data``, it leaves no pages of the file mapped into the process."""
        out = np.fromfile(self.path, self.data.dtype, self.data.size, offset=self.offset)
        return out.reshape(self.data.shape)


def _string(buf: Any, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, pos)
    return bytes(buf[pos + 8 : pos + 8 + n]).decode("utf-8", errors="replace"), pos + 8 + n


def _value(buf: Any, pos: int, kind: int) -> tuple[Field, int]:
    if kind == _STRING:
        s, pos = _string(buf, pos)
        return Field(buf, kind, s), pos
    if kind in _SCALARS:
        fmt = _SCALARS[kind]
        return Field(buf, kind, struct.unpack_from(fmt, buf, pos)[0]), pos + struct.calcsize(fmt)
    if kind != _ARRAY:
        raise ValueError(f"unknown GGUF value type {kind}")
    elem, count = struct.unpack_from("<IQ", buf, pos)
    pos += 12
    if elem == _STRING:
        start = pos
        for _ in range(count):
            (n,) = struct.unpack_from("<Q", buf, pos)
            pos += 8 + n
        return Field(buf, _STRING, None, count, start), pos
    if elem not in _NUMPY:
        raise ValueError(f"GGUF arrays of type {elem} are not supported")
    arr = np.frombuffer(buf, dtype=_NUMPY[elem], count=count, offset=pos)
    return Field(buf, elem, arr, count), pos + arr.nbytes


class GGUFFile:
    """``fields`` and ``tensors`` of the GGUF file at ``path`` (see the module docstring)."""

    def __init__(self, path: str):
        try:
            self._parse(path)
        except (struct.error, OverflowError, ZeroDivisionError, KeyError, TypeError) as e:
            raise ValueError(f"{path} is not a valid GGUF file ({type(e).__name__}: {e})") from e
        except ValueError as e:  # numpy's "buffer is smaller than requested size", bad enums
            if str(e).startswith(path):
                raise
            raise ValueError(f"{path} is not a valid GGUF file ({e})") from e

    def _parse(self, path: str) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        buf = np.memmap(path, dtype=np.uint8, mode="r")
        if bytes(buf[:4]) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        _, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        pos, self.fields = 24, {}
        for _ in range(n_kv):
            key, pos = _string(buf, pos)
            (kind,) = struct.unpack_from("<I", buf, pos)
            self.fields[key], pos = _value(buf, pos + 4, kind)
        infos = []
        for _ in range(n_tensors):
            name, pos = _string(buf, pos)
            (n_dims,) = struct.unpack_from("<I", buf, pos)
            dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
            qtype, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            infos.append((name, dims, qtype, offset))
        align = (
            self.fields["general.alignment"].contents()
            if "general.alignment" in self.fields
            else 32
        )  # noqa: E501
        if not isinstance(align, int) or align <= 0:
            raise ValueError(f"{path} is not a valid GGUF file (general.alignment {align!r})")
        base = -(-pos // align) * align
        self.tensors = []
        for name, dims, qtype, offset in infos:
            rows = tuple(reversed(dims[1:]))
            if qtype in _ELEMENTS:
                dtype, last = np.dtype(_ELEMENTS[qtype]), dims[0]
            else:
                values, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
                dtype, last = np.dtype(np.uint8), dims[0] // values * nbytes
            count = int(np.prod(rows, dtype=np.int64)) * last
            data = np.frombuffer(buf, dtype=dtype, count=count, offset=base + offset)
            shape = (*rows, last)
            qt = GGMLQuantizationType(qtype)
            self.tensors.append(Tensor(name, qt, dims, data.reshape(shape), path, base + offset))
