"""The CPU K-quant kernels (``gguf_cpu.c`` through ``lightwell.kernels.cpu.gguf_cpu``, the
one entry point of every CPU block type) on random valid blocks:
dequantized rows bit-exact with gguf-py and the torch reference, products against float64
on those values (one and five activation rows, N and K not tiny multiples)."""

from __future__ import annotations

import pytest
import torch

from lightwell.kernels.cpu import gguf_cpu
from lightwell.kernels.gguf_blocks import Q4_K, Q5_K, Q6_K, gguf_dequantize_ref
from tests.kernels.gguf_random import gguf_py, random_blocks

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(not gguf_cpu.available(), reason="no C compiler with OpenMP")

TYPES = [Q4_K, Q5_K, Q6_K]


@pytest.mark.parametrize("qtype", TYPES)
def test_dequant_rows_bit_exact_with_gguf(qtype):
    w = random_blocks(23, 512, qtype, seed=qtype)
    expected = gguf_py(w, qtype)
    assert torch.equal(gguf_dequantize_ref(w, qtype), expected)
    ids = torch.tensor([4, 0, 22, 4, 13])
    assert torch.equal(gguf_cpu.gguf_dequant_rows(w, qtype, 512, ids), expected[ids])


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("rows", [1, 5])
def test_mm_matches_float64_on_dequantized_weights(qtype, rows):
    torch.set_num_threads(2)
    w = random_blocks(67, 768, qtype, seed=rows + qtype)  # N odd, K three super-blocks
    x = torch.randn(rows, 768, generator=torch.Generator().manual_seed(rows))
    expected = x.double() @ gguf_dequantize_ref(w, qtype).double().T
    out = gguf_cpu.gguf_mm(x, w, qtype)
    assert out.shape == (rows, 67)
    assert (out.double() - expected).abs().max().item() < 1e-5 * expected.abs().max().item()
    wide = torch.full((rows, 90), float("nan"))  # into columns of a fused layer's output
    gguf_cpu.gguf_mm(x, w, qtype, wide[:, 10:77])
    assert torch.equal(wide[:, 10:77], out)
    assert wide[:, :10].isnan().all() and wide[:, 77:].isnan().all()


def test_refuses_a_row_size_or_type_that_does_not_fit():
    w = random_blocks(3, 256, Q4_K)
    with pytest.raises(ValueError, match="bytes a row"):
        gguf_cpu.gguf_mm(torch.randn(1, 512), w, Q4_K)
    with pytest.raises(ValueError, match="bytes a row"):
        gguf_cpu.gguf_mm(torch.randn(1, 256), w, 8)  # Q8_0 rows are longer
    with pytest.raises(ValueError, match="not one of"):
        gguf_cpu.gguf_mm(torch.randn(1, 256), w, 10)  # Q2_K: no CPU kernel
    with pytest.raises(ValueError, match="not one of"):
        gguf_cpu.gguf_dequant_rows(w, 10, 256, torch.tensor([0]))
