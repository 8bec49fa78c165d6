"""What a kernel test module imports: ``DEVICE``, where its kernels run (compiled on CUDA; on
CPU through Triton's interpreter, which tests/conftest.py selects before triton is first
imported), and on CPU a skip of the importing module if triton was imported without it."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(tl.sum, InterpretedFunction):
        pytest.skip("triton was imported without TRITON_INTERPRET=1", allow_module_level=True)
