"""SiLU-and-multiply, the gated MLP activation: ``silu(x[:, :I]) * x[:, I:]``, fp32 inside."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # [T, 2 * I]
    out_ptr,  # [T, I]
    stride_x,
    stride_out,
    INTER: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < INTER
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + INTER + offs, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_out + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(
    x: torch.Tensor,  # [T, 2 * I]
    out: torch.Tensor | None = None,  # [T, I]
) -> torch.Tensor:  # [T, I]
    if x.dim() != 2 or x.shape[1] % 2 or x.stride(1) != 1:
        raise ValueError(f"want x [T, 2*I] with a contiguous last dim; got {tuple(x.shape)}")
    num_tokens, inter = x.shape[0], x.shape[1] // 2
    if out is None:
        out = torch.empty((num_tokens, inter), dtype=x.dtype, device=x.device)
    elif out.shape != (num_tokens, inter) or out.stride(1) != 1:
        raise ValueError(f"out must be [{num_tokens}, {inter}] with a contiguous last dim")
    if num_tokens == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    grid = (num_tokens, triton.cdiv(inter, block))
    _silu_and_mul_kernel[grid](
        x, out, x.stride(0), out.stride(0), INTER=inter, BLOCK=block, num_warps=4
    )
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:  # [T, 2 * I] -> [T, I]
    gate, up = x.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)
