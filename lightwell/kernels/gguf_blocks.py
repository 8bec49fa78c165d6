"""GGUF block layouts (ggml), one definition for every kernel that reads them: the type ids,
``BLOCKS`` (values and bytes a block), ``check_blocks`` and the torch reference
``gguf_dequantize_ref`` (gguf-py's arithmetic on torch tensors, rounded in its order). No Triton:
the CPU kernels (``kernels/cpu/gguf_cpu.py``) use it too.

Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: blocks of 32 values; Q4_K, Q5_K, Q6_K: super-blocks of 256 in
sub-blocks of 32 (Q6_K: 16) sharing a scale. Layouts:
  Q4_0 (18 B): d f16, qs[16]: value i = (qs[i % 16] >> 4 * (i // 16) & 15) - 8, w = d * q
  Q4_1 (20 B): d f16, m f16, qs[16]: q as Q4_0 without the -8, w = d * q + m
  Q5_0 (22 B): d f16, qh u32, qs[16]: q = (qs nibble as Q4_1 | (qh >> i & 1) << 4) - 16, w = d * q
  Q5_1 (24 B): d f16, m f16, qh u32, qs[16]: q as Q5_0 without the -16, w = d * q + m
  Q8_0 (34 B): d f16, qs[32] int8: w = d * q
  Q4_K (144 B): d, dmin f16, scales[12] (eight 6-bit scales and mins), qs[128]: sub-block j,
    value i: q = qs[32 * (j // 2) + i] >> 4 * (j % 2) & 15, w = (d * sc[j]) * q - dmin * mn[j]
  Q5_K (176 B): as Q4_K with qh[32] before qs: q |= (qh[i] >> j & 1) << 4
  Q6_K (210 B): ql[128], qh[64], scales[16] int8, d f16: sub-block j = 4a + g, value i:
    q = (ql[64a + 32 (g % 2) + i] >> 4 (g // 2) & 15 | (qh[32a + i] >> 2g & 3) << 4) - 32,
    w = (d * scales[2j + i // 16]) * q
"""

from __future__ import annotations

import torch

Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 6, 7, 8, 12, 13, 14  # ggml type ids
# type -> (values, bytes) per block
BLOCKS = {Q4_0: (32, 18), Q4_1: (32, 20), Q5_0: (32, 22), Q5_1: (32, 24), Q8_0: (32, 34),
          Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210)}  # fmt: skip
# the types the Triton kernels (kernels/gguf_dequant.py) read; the CPU's: kernels/cpu/gguf_cpu.py
SUPPORTED = (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K)


def check_blocks(w: torch.Tensor, qtype: int) -> int:
    """K (values per row) of the blocks w, after checking them."""
    if qtype not in BLOCKS:
        raise ValueError(f"GGUF block layouts known: types {tuple(BLOCKS)}, got {qtype}")
    values, nbytes = BLOCKS[qtype]
    if w.dtype != torch.uint8 or w.dim() != 2 or w.stride(1) != 1 or w.shape[1] % nbytes:
        raise ValueError(f"GGUF blocks must be uint8 [N, B] rows of {nbytes}-byte blocks")
    return w.shape[1] // nbytes * values


def _f16_ref(b: torch.Tensor) -> torch.Tensor:  # [..., 2] uint8 -> [...] fp32
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _i8_ref(b: torch.Tensor) -> torch.Tensor:  # uint8 -> fp32 of the bytes read as int8
    return b.contiguous().view(torch.int8).float()


def _nibbles(qs: torch.Tensor, dim: int) -> torch.Tensor:  # low nibbles, then high, along dim
    return torch.stack((qs & 15, qs >> 4), dim=dim)


def _ref_32(blk: torch.Tensor, qtype: int) -> torch.Tensor:  # [n, nb, bytes] -> [n, nb, 32]
    d = _f16_ref(blk[..., 0:2])[..., None]
    if qtype == Q8_0:
        return _i8_ref(blk[..., 2:]) * d
    if qtype == Q4_0:
        return d * (_nibbles(blk[..., 2:].int(), 2).flatten(2) - 8).float()
    with_min = qtype in (Q4_1, Q5_1)
    first = (4 if with_min else 2) + (4 if qtype in (Q5_0, Q5_1) else 0)
    q = _nibbles(blk[..., first:].int(), 2).flatten(2)
    if qtype in (Q5_0, Q5_1):
        qh = blk[..., first - 4 : first].int()  # [n, nb, 4] little-endian bytes
        bits = torch.arange(32, dtype=torch.int32, device=blk.device)
        q = q | ((qh[..., bits // 8] >> (bits % 8)) & 1) << 4
    if not with_min:  # Q5_0
        return d * (q - 16).float()
    return d * q.float() + _f16_ref(blk[..., 2:4])[..., None]


def _scale_min_ref(sb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [.., 12] -> [.., 8]
    a, b, c = sb[..., 0:4].int(), sb[..., 4:8].int(), sb[..., 8:12].int()
    sc = torch.cat((a & 63, (c & 15) | ((a >> 6) << 4)), -1)
    mn = torch.cat((b & 63, (c >> 4) | ((b >> 6) << 4)), -1)
    return sc.float(), mn.float()


def _ref_k(blk: torch.Tensor, qtype: int) -> torch.Tensor:  # [n, nb, bytes] -> [n, nb, 8, 32]
    n, nb = blk.shape[:2]
    if qtype == Q6_K:
        low = _nibbles(blk[..., :128].int().reshape(n, nb, 2, 64), 3).reshape(n, nb, 8, 32)
        shifts = torch.tensor([0, 2, 4, 6], dtype=torch.int32, device=blk.device)[:, None]
        qh = blk[..., 128:192].int().reshape(n, nb, 2, 1, 32) >> shifts
        q = (low | ((qh & 3).reshape(n, nb, 8, 32) << 4)) - 32
        d = _f16_ref(blk[..., 208:210])[..., None] * _i8_ref(blk[..., 192:208])  # [n, nb, 16]
        return (d[..., None] * q.reshape(n, nb, 16, 16).float()).reshape(n, nb, 8, 32)
    sc, mn = _scale_min_ref(blk[..., 4:16])
    first = 16 if qtype == Q4_K else 48
    q = _nibbles(blk[..., first:].int().reshape(n, nb, 4, 32), 3).reshape(n, nb, 8, 32)
    if qtype == Q5_K:
        bits = torch.arange(8, dtype=torch.int32, device=blk.device)[:, None]
        q = q | (((blk[..., 16:48].int()[..., None, :] >> bits) & 1) << 4)
    d = (_f16_ref(blk[..., 0:2])[..., None] * sc)[..., None]
    dm = (_f16_ref(blk[..., 2:4])[..., None] * mn)[..., None]
    return d * q.float() - dm


def gguf_dequantize_ref(
    w: torch.Tensor,  # [N, B] uint8 blocks
    qtype: int,
) -> torch.Tensor:  # [N, K] fp32
    """gguf-py's dequantize (its arithmetic, rounded in its order) in torch."""
    check_blocks(w, qtype)
    values, nbytes = BLOCKS[qtype]
    blk = w.reshape(w.shape[0], -1, nbytes)
    out = _ref_32(blk, qtype) if values == 32 else _ref_k(blk, qtype)
    return out.reshape(w.shape[0], -1)
