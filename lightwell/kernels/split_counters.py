"""The per-tile counters of split-K kernels (kernels/int8_gemm.py, kernels/w4a16_skinny.py): the
programs of an output tile count themselves in, the last adds the partials and sets the count
back to zero, so one zeroed int32 buffer per device and stream serves every call and every
CUDA graph replay."""

from __future__ import annotations

import torch

_COUNTERS: dict[tuple[int, int], torch.Tensor] = {}


def split_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """At least ``tiles`` zeroed int32 counters on ``device`` for the current stream (kernels
    on one stream run one after another; another stream gets its own buffer)."""
    index = device.index if device.type == "cuda" else -1
    key = (index, torch.cuda.current_stream(device).stream_id if device.type == "cuda" else 0)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < tiles:
        buf = torch.zeros(max(tiles, 1024), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf
