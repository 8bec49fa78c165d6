"""kernels/argmax.py's ``argmax_rows`` against torch.argmax: ties across pieces, NaN, infinities,
signed zeros, strided rows; on CPU under TRITON_INTERPRET=1, compiled on CUDA."""

from __future__ import annotations

import pytest
import torch

from lightwell.kernels import argmax as am
from lightwell.kernels.split_counters import split_counters
from tests.kernels.interpreter import DEVICE


def _check(x: torch.Tensor) -> None:
    got = am.argmax_rows(x)
    assert got.dtype == torch.int64
    assert torch.equal(got.cpu(), am.argmax_rows_ref(x).cpu()), (got, am.argmax_rows_ref(x))
    assert not split_counters(x.device, x.shape[0]).any()  # every row's counter back at zero


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("cols", [7, am.PIECE, 2 * am.PIECE + 813])
def test_argmax_rows_matches_torch(dtype, cols):
    g = torch.Generator().manual_seed(cols)
    x = torch.randn(5, cols, generator=g).to(dtype)
    # ties: row 1's largest value at a late and an early index, in different pieces
    x[1] = -1.0
    x[1, cols - 1] = x[1, cols // 3] = 7.0
    x[2] = float("-inf")  # all -inf: index 0
    x[3, cols // 2] = float("inf")  # +inf wins over the numbers
    x[4, cols - 1] = float("nan")  # a NaN wins over +inf, the first NaN over later ones
    x[4, cols // 2] = float("inf")
    _check(x.to(DEVICE))
    x[4, cols // 4] = float("nan")
    _check(x.to(DEVICE))


def test_argmax_rows_signed_zeros_tie_by_index():
    x = torch.full((2, am.PIECE + 5), -1.0)
    x[0, 3], x[0, am.PIECE + 1] = -0.0, 0.0  # equal: the first
    x[1, 3], x[1, am.PIECE + 1] = 0.0, -0.0
    _check(x.to(DEVICE))
    assert am.argmax_rows(x.to(DEVICE)).tolist() == [3, 3]


def test_argmax_rows_reads_strided_rows_and_refuses_bad_input():
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(3, 2 * am.PIECE, generator=g).to(DEVICE)
    _check(wide[:, 5 : am.PIECE + 900])  # rows strided, not starting at a piece boundary
    _check(wide.t().contiguous().t()[:, :100])  # columns strided: made contiguous
    close = torch.tensor([[1.0, 1.0 + 1e-12, 0.5]], dtype=torch.float64, device=DEVICE)
    assert am.argmax_rows(close).tolist() == [1]  # float64: torch's (fp32 would tie them)
    with pytest.raises(ValueError, match="float x"):
        am.argmax_rows(torch.zeros(3, dtype=torch.int64, device=DEVICE))
    assert am.argmax_rows(torch.zeros(0, 9, device=DEVICE)).shape == (0,)
