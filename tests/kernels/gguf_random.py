"""Random valid GGUF blocks (random bytes, sane fp16 scales) and gguf-py's dequantize of them,
for the kernel tests (Triton and CPU); no Triton import."""

from __future__ import annotations

import numpy as np
import torch

from lightwell.kernels.gguf_blocks import BLOCKS, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0

# where each type keeps its fp16 scales (d, and m / dmin where it has one)
SCALES = {Q4_0: (0,), Q4_1: (0, 2), Q5_0: (0,), Q5_1: (0, 2), Q8_0: (0,), Q4_K: (0, 2),
          Q5_K: (0, 2), Q6_K: (208,)}  # fmt: skip


def random_blocks(n: int, k: int, qtype: int, seed: int = 0) -> torch.Tensor:  # [n, B] uint8
    """Random bytes with fp16 scales of either sign between 1e-3 and 4e-3."""
    values, nbytes = BLOCKS[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (n, k // values, nbytes), dtype=np.uint8)
    for offset in SCALES[qtype]:
        scale = rng.uniform(1e-3, 4e-3, (n, k // values)) * rng.choice([-1, 1], (n, k // values))
        blocks[:, :, offset : offset + 2] = (
            scale.astype(np.float16).view(np.uint8).reshape(n, -1, 2)
        )
    return torch.from_numpy(blocks.reshape(n, -1))


def gguf_py(w: torch.Tensor, qtype: int) -> torch.Tensor:  # [N, K] fp32
    import gguf

    out = gguf.quants.dequantize(w.cpu().numpy(), gguf.GGMLQuantizationType(qtype))
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32))
