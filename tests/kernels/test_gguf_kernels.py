"""GGUF block kernels (lightwell/kernels/gguf_dequant.py) against gguf-py's numpy dequantize on
random blocks (random bytes, sane fp16 scales): the torch reference and the dequantize kernel
bit-exact in fp32, the GEMV against torch's matmul of the dequantized weight. On CPU under
TRITON_INTERPRET=1 (tiny sizes), compiled on CUDA."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from lightwell.kernels import gguf_dequant as gd  # noqa: E402
from tests.kernels.gguf_random import gguf_py, random_blocks  # noqa: E402
from tests.kernels.interpreter import DEVICE  # noqa: E402

TYPES = list(gd.SUPPORTED)  # the Triton kernels' types (not Q5_0 / Q5_1: CPU only)


@pytest.mark.parametrize("qtype", TYPES)
def test_reference_and_kernel_bit_exact(qtype):
    values = gd.BLOCKS[qtype][0]
    w = random_blocks(5, 2 * max(values, 64), qtype, seed=qtype)  # 5 rows: N past a tile
    expected = gguf_py(w, qtype)
    assert expected.abs().max() > 0.01
    assert torch.equal(gd.gguf_dequantize_ref(w, qtype), expected)
    out = gd.gguf_dequantize(w.to(DEVICE), qtype, torch.float32).cpu()
    assert torch.equal(out, expected)
    half = gd.gguf_dequantize(w.to(DEVICE), qtype, torch.float16).cpu()
    assert torch.equal(half, expected.half())


@pytest.mark.parametrize(
    "qtype, m, n, k, dtype, config",
    [
        (gd.Q4_0, 1, 6, 96, torch.float32, None),  # K: 3 sub-blocks, one a step
        (gd.Q4_1, 3, 5, 128, torch.float16, (4, 2, 1)),  # 2 K steps, N past a tile
        (gd.Q8_0, 8, 4, 64, torch.float32, None),
        (gd.Q4_K, 2, 5, 512, torch.float32, (2, 4, 1)),  # 4 K steps across 2 super-blocks
        (gd.Q5_K, 1, 3, 256, torch.float16, None),
        (gd.Q6_K, 5, 4, 256, torch.float32, None),  # M 5 of a tile of 8
    ],
)
def test_gemv_matches_matmul(qtype, m, n, k, dtype, config):
    gen = torch.Generator().manual_seed(m * 31 + n)
    w = random_blocks(n, k, qtype, seed=k + qtype)
    x = torch.randn(m, k, generator=gen).to(dtype)
    expected = x.double() @ gguf_py(w, qtype).double().T
    out = gd.gguf_gemv(x.to(DEVICE), w.to(DEVICE), qtype, config=config).cpu()
    assert out.dtype == dtype and out.shape == (m, n)
    err = ((out.double() - expected).abs().max() / expected.abs().max()).item()
    assert err < (1e-5 if dtype == torch.float32 else 3e-3), err


def test_gemv_writes_a_column_slice_and_refuses_bad_input():
    w = random_blocks(4, 64, gd.Q8_0)
    x = torch.randn(2, 64)
    out = torch.zeros(2, 10)
    gd.gguf_gemv(x.to(DEVICE), w.to(DEVICE), gd.Q8_0, out=out[:, 3:7])
    torch.testing.assert_close(out[:, 3:7], x @ gguf_py(w, gd.Q8_0).T, rtol=1e-5, atol=1e-5)
    assert out[:, :3].abs().sum() == 0 and out[:, 7:].abs().sum() == 0
    with pytest.raises(ValueError, match="at most 8 rows"):
        gd.gguf_gemv(torch.randn(9, 64), w, gd.Q8_0)
    with pytest.raises(ValueError, match="types"):
        gd.gguf_dequantize(w, 6)  # Q5_0
    with pytest.raises(ValueError, match="34-byte blocks"):
        gd.gguf_dequantize(w[:, :30], gd.Q8_0)


@pytest.mark.parametrize("tokens", [2, 5])  # the GEMV, then dequantize + matmul
def test_cuda_linear_path_on_fused_shards(tokens):
    """quant/gguf_cuda.py's linear (run here on CPU tensors through the interpreted kernels): a
    fused layer of a Q4_K, a Q6_K and a float shard, with bias."""
    from lightwell.quant.gguf_cuda import GEMV_MAX_TOKENS, gguf_linear

    assert (tokens <= GEMV_MAX_TOKENS) == (tokens == 2)
    k = 256
    parts = [(gd.Q4_K, random_blocks(3, k, gd.Q4_K, 1)), (gd.Q6_K, random_blocks(2, k, gd.Q6_K, 2))]
    parts.append((None, torch.randn(4, k) * 0.01))
    w = torch.cat([p if q is None else gguf_py(p, q) for q, p in parts])  # [9, K]
    x, bias = torch.randn(tokens, k), torch.randn(9)
    dev = [(q, p.to(DEVICE)) for q, p in parts]
    out = gguf_linear(dev, x.to(DEVICE), bias.to(DEVICE)).cpu()
    torch.testing.assert_close(out, x @ w.T + bias, rtol=1e-4, atol=1e-4)


def test_cuda_load_keeps_kernel_types_and_dequantizes_others():
    from lightwell.quant.gguf_cuda import to_device

    param = torch.empty(0, dtype=torch.float16, device=DEVICE)
    q8 = random_blocks(2, 64, gd.Q8_0)
    assert to_device(gd.Q8_0, q8, param)[0] == gd.Q8_0
    values = np.random.default_rng(0).standard_normal((2, 64)).astype(np.float32)
    q5_0 = gguf.GGMLQuantizationType.Q5_0
    blocks = torch.from_numpy(gguf.quants.quantize(values, q5_0))
    qtype, part = to_device(int(q5_0), blocks, param)
    assert qtype is None and part.dtype == torch.float16
    assert torch.equal(part.cpu(), gguf_py(blocks, int(q5_0)).half())


def test_loader_takes_gguf_on_cuda_and_cpu_only():
    from lightwell.models.loader import _quant_method
    from lightwell.quant.gguf import GGUFLinearMethod

    for device in ("cpu", "cuda"):
        assert isinstance(
            _quant_method(None, "gguf", "gguf", torch.device(device)), GGUFLinearMethod
        )
    with pytest.raises(ValueError, match="on CPU or CUDA"):
        _quant_method(None, "gguf", "gguf", torch.device("meta"))
