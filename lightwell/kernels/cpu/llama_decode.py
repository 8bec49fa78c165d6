"""A Llama-shaped model's decode step (up to ``MAX_ROWS`` requests, one token each) in one C call
(``llama_decode.c``, compiled with ``gguf_cpu.c`` and ``gguf_kquant.c``): every layer's norms,
GGUF-block matmuls (any type of ``gguf_cpu.SUPPORTED``; a matrix may be up to ``MAX_SEGMENTS``
runs of rows of different types), the q/k/v bias and per-head q/k norms where the layers have
them, RoPE, paged float32 KV-cache store and attention, the final norm and, optionally, the LM
head on GGUF blocks with each row's greedy token, in one OpenMP region.

``LlamaDecoder`` holds the ctypes description of the model (built once, the tensors it points
into kept alive) and scratch rows for ``MAX_ROWS`` requests; calling it runs one step. Its torch
reference is the model's own forward (``tests/models/test_gguf_fused_decode.py``).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from lightwell.kernels.cpu import gguf_cpu
from lightwell.kernels.gguf_blocks import BLOCKS

MAX_ROWS = 8  # requests a step (llama_decode.c's MAX_ROWS)
MAX_SEGMENTS = 3  # runs of rows of one type a matrix (llama_decode.c's MAX_SEGMENTS)
MAX_HEAD_DIM = 256
MAX_GROUP = 16  # query heads a KV head (llama_decode.c's MAX_GROUP)
KV_SPLITS = 4  # llama_decode.c's: key ranges of a (request, KV head) in the attention
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


class _Segment(ctypes.Structure):
    _fields_ = [("w", _ptr), ("rows", _i64), ("row_bytes", _i64), ("qtype", _i64)]


class _Linear(ctypes.Structure):
    _fields_ = [("seg", _Segment * MAX_SEGMENTS), ("nseg", _i64), ("rows", _i64)]


class _Layer(ctypes.Structure):
    _fields_ = [(n, _ptr) for n in ("in_norm", "post_norm", "qkv_bias", "q_norm", "k_norm")]
    _fields_ += [(n, _Linear) for n in ("qkv", "o", "gate_up", "down")]
    _fields_ += [("kv_cache", _ptr)]


class _Model(ctypes.Structure):
    _fields_ = [
        (n, _i64)
        for n in ("num_layers", "hidden", "heads", "kv_heads", "head_dim", "inter")
        + ("num_blocks", "block_size", "int8_act")
    ]
    _fields_ += [(n, ctypes.c_float) for n in ("eps", "scale", "qk_eps")]
    _fields_ += [("cos_sin", _ptr), ("final_norm", _ptr), ("layers", ctypes.POINTER(_Layer))]
    _fields_ += [("lm_head", _Linear)]


# llama_decode.c's lw_step row pointers, in its order: float32 rows, then int8 rows and scales
_SCRATCH = ("residual", "normed", "qkv", "attn", "act", "partial", "part")
_SCRATCH += ("q_normed", "q_attn", "q_act", "ds_normed", "ds_attn", "ds_act")


class _Step(ctypes.Structure):
    _fields_ = [("R", _i64), ("ld_table", _i64), ("positions", _ptr), ("slots", _ptr)]
    _fields_ += [("block_table", _ptr), ("seq_lens", _ptr)]
    _fields_ += [(n, _ptr) for n in _SCRATCH]
    _fields_ += [("logits", _ptr), ("tokens", _ptr)]


Segments = list[tuple[int, torch.Tensor]]  # a matrix's runs of rows: (ggml type, uint8 blocks)


@dataclass
class LayerWeights:
    in_norm: torch.Tensor  # [H] float32
    post_norm: torch.Tensor  # [H] float32
    qkv: Segments  # [(Hq + 2 Hkv) D, H] in 1..MAX_SEGMENTS runs of rows
    o: Segments  # [H, Hq D]
    gate_up: Segments  # [2 I, H]: gate rows, then up rows
    down: Segments  # [H, I]
    kv_cache: torch.Tensor  # [2, N, B, Hkv, D] float32
    qkv_bias: torch.Tensor | None = None  # [(Hq + 2 Hkv) D] float32 (Qwen2)
    q_norm: torch.Tensor | None = None  # [D] float32: RMSNorm of each q head (Qwen3)
    k_norm: torch.Tensor | None = None  # [D] float32: of each k head


@dataclass(frozen=True)
class Shape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    eps: float
    scale: float
    qk_eps: float = 1e-6  # the q / k head norms' (where the layers have them)


def _linear(parts: Segments, rows: int, cols: int) -> _Linear:
    if not 1 <= len(parts) <= MAX_SEGMENTS:
        raise ValueError(f"llama_decode: {len(parts)} segments, 1 to {MAX_SEGMENTS} a matrix")
    segments = (_Segment * MAX_SEGMENTS)()
    for i, (qtype, blocks) in enumerate(parts):
        values, nbytes = BLOCKS[qtype] if qtype in gguf_cpu.SUPPORTED else (0, 0)
        ok = values and blocks.dtype == torch.uint8 and blocks.is_contiguous() and blocks.dim() == 2
        if not ok or blocks.shape[1] != cols // values * nbytes or cols % values:
            raise ValueError(f"llama_decode: blocks of type {qtype} {tuple(blocks.shape)} do "
                             f"not hold rows of {cols} values")  # fmt: skip
        segments[i] = _Segment(blocks.data_ptr(), blocks.shape[0], blocks.shape[1], qtype)
    total = sum(blocks.shape[0] for _, blocks in parts)
    if total != rows:
        raise ValueError(f"llama_decode: segments of {total} rows for a [{rows}, {cols}] matrix")
    return _Linear(segments, len(parts), rows)


def _f32(t: torch.Tensor, shape: tuple[int, ...], what: str) -> torch.Tensor:
    if t.dtype != torch.float32 or tuple(t.shape) != shape or not t.is_contiguous():
        raise ValueError(f"llama_decode: {what} must be contiguous float32 {list(shape)}")
    return t


def _optional(t: torch.Tensor | None, shape: tuple[int, ...], what: str) -> int:
    return 0 if t is None else _f32(t, shape, what).data_ptr()


class LlamaDecoder:
    def __init__(
        self,
        layers: list[LayerWeights],
        final_norm: torch.Tensor,  # [H] float32
        cos_sin: torch.Tensor,  # [positions, D] float32: D / 2 cosines, then D / 2 sines
        shape: Shape,
        int8_act: bool = False,  # blocks of 32's inputs (matmuls, LM head) rounded to int8
        lm_head: Segments | None = None,  # [V, H] blocks
    ):
        s = self.shape = shape
        H, D, Hq, Hkv, inter = s.hidden, s.head_dim, s.heads, s.kv_heads, s.inter
        bad_group = Hq % Hkv or Hq // Hkv > MAX_GROUP
        if D > MAX_HEAD_DIM or D % 2 or bad_group or not layers or (int8_act and D % 32):
            raise ValueError(f"llama_decode: unsupported heads {Hq}/{Hkv} x {D}")
        cache_shape = tuple(layers[0].kv_cache.shape)
        if len(cache_shape) != 5 or cache_shape[0] != 2 or cache_shape[3:] != (Hkv, D):
            raise ValueError(
                f"llama_decode: KV cache {list(cache_shape)} is not [2, N, B, {Hkv}, {D}]"
            )
        self.max_positions = cos_sin.shape[0]
        self.vocab = sum(b.shape[0] for _, b in lm_head) if lm_head is not None else 0
        head = _linear(lm_head, self.vocab, H) if lm_head is not None else _Linear()
        self._keep = [final_norm, _f32(cos_sin, (cos_sin.shape[0], D), "cos_sin"), layers, lm_head]
        table = (_Layer * len(layers))()
        for i, w in enumerate(layers):
            table[i] = _Layer(
                _f32(w.in_norm, (H,), "in_norm").data_ptr(),
                _f32(w.post_norm, (H,), "post_norm").data_ptr(),
                _optional(w.qkv_bias, ((Hq + 2 * Hkv) * D,), "qkv_bias"),
                _optional(w.q_norm, (D,), "q_norm"),
                _optional(w.k_norm, (D,), "k_norm"),
                _linear(w.qkv, (Hq + 2 * Hkv) * D, H),
                _linear(w.o, H, Hq * D),
                _linear(w.gate_up, 2 * inter, H),
                _linear(w.down, H, inter),
                _f32(w.kv_cache, cache_shape, "kv_cache").data_ptr(),
            )
        self._table = table
        self._model = _Model(
            len(layers), H, Hq, Hkv, D, inter, cache_shape[1], cache_shape[2], int(int8_act),
            s.eps, s.scale, s.qk_eps,
            cos_sin.data_ptr(), _f32(final_norm, (H,), "final_norm").data_ptr(), table,
            head,
        )  # fmt: skip
        widths = {"residual": H, "normed": H, "qkv": (Hq + 2 * Hkv) * D, "attn": Hq * D}
        widths.update(act=inter, partial=H, part=Hq * KV_SPLITS * (D + 2))
        self._scratch = {n: torch.empty(MAX_ROWS, w) for n, w in widths.items()}
        for n in ("normed", "attn", "act"):  # int8 rows and their (d, s) per block of 32
            self._scratch["q_" + n] = torch.empty(MAX_ROWS, widths[n], dtype=torch.int8)
            self._scratch["ds_" + n] = torch.empty(MAX_ROWS, widths[n] // 32 * 2)

    def __call__(
        self,
        x: torch.Tensor,  # [R, H] float32: the token embeddings
        positions: torch.Tensor,  # [R] int64
        slots: torch.Tensor,  # [R] int64: block_id * B + offset of each new token
        block_table: torch.Tensor,  # [R, W] int32
        seq_lens: torch.Tensor,  # [R] int32: cached tokens + the new one
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The final norm's output [R, H] float32; with an LM head, the logits [R, V] float32
        and each row's greedy token [R] int64 (else None, None)."""
        R = x.shape[0]
        self._check(x, positions, slots, block_table, seq_lens)
        sc = self._scratch
        logits = torch.empty(R, self.vocab) if self.vocab else None
        tokens = torch.empty(R, dtype=torch.int64) if self.vocab else None
        step = _Step(
            R, block_table.stride(0), positions.data_ptr(), slots.data_ptr(),
            block_table.data_ptr(), seq_lens.data_ptr(),
            *(sc[n].data_ptr() for n in _SCRATCH),
            logits.data_ptr() if self.vocab else 0, tokens.data_ptr() if self.vocab else 0,
        )  # fmt: skip
        out = torch.empty(R, self.shape.hidden)
        lib = gguf_cpu._lib()
        rc = lib.lw_llama_decode(
            ctypes.byref(self._model), ctypes.byref(step), x.data_ptr(), out.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        if rc:
            raise ValueError(f"llama_decode: the kernel refused the step ({rc})")
        return out, logits, tokens

    def _check(self, x, positions, slots, block_table, seq_lens) -> None:
        R = x.shape[0]
        if not 1 <= R <= MAX_ROWS:
            raise ValueError(f"llama_decode: {R} requests, at most {MAX_ROWS}")
        _f32(x, (R, self.shape.hidden), "x")
        for t, dtype, name in ((positions, torch.int64, "positions"), (slots, torch.int64,
                               "slots"), (seq_lens, torch.int32, "seq_lens")):  # fmt: skip
            if t.dtype != dtype or tuple(t.shape) != (R,) or not t.is_contiguous():
                raise ValueError(f"llama_decode: {name} must be contiguous {dtype} [{R}]")
        if (
            block_table.dtype != torch.int32
            or block_table.shape[0] != R
            or block_table.stride(1) != 1
        ):
            raise ValueError(f"llama_decode: block_table must be int32 [{R}, W], rows contiguous")
        cache = self._keep[2][0].kv_cache
        capacity, blocks = block_table.shape[1] * cache.shape[2], cache.shape[1]
        bounds = (  # (values, first allowed, first past the end, what they are)
            (seq_lens, 1, capacity + 1, f"seq_lens must lie in [1, {capacity}]"),
            (positions, 0, self.max_positions, f"positions must lie in [0, {self.max_positions})"),
            (
                slots,
                0,
                blocks * cache.shape[2],
                f"slots must lie in [0, {blocks * cache.shape[2]})",
            ),
            (block_table, 0, blocks, f"block ids must lie in [0, {blocks})"),
        )
        for values, first, end, what in bounds:
            lo, hi = gguf_cpu.value_range(values)
            if lo < first or hi >= end:
                raise ValueError(f"llama_decode: {what}")
