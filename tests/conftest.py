from __future__ import annotations

import os
import signal

import pytest

# Two cores shared with other processes: avoid OpenMP spin-wait collapse.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _cuda_visible() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


# A suite started in the background (`cmd &` in a script) inherits SIGINT ignored, and so would
# every process it starts; the Ctrl-C tests need Python's own handler (a Python handler is
# reset to the default at exec, where an ignored signal would stay ignored).
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Triton runs on CPU only as its interpreter, which must be chosen before triton is imported.
if not _cuda_visible():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if _cuda_visible():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    from lightwell.model_files import default_model_path

    return default_model_path()


# instruction sets the CPU GGUF kernels are also compiled for in the tests (this machine's own
# build runs everywhere else): AVX2 without AVX-512 (most x86 desktops), and portable C (ARM)
CPU_ISAS = {"avx2": ("-mavx2", "-mfma", "-mf16c"), "portable": ()}


@pytest.fixture(scope="session", params=list(CPU_ISAS))
def gguf_isa_lib(request, tmp_path_factory):
    """(name, the GGUF CPU kernels compiled for that instruction set): patch it in as
    ``gguf_cpu._lib`` to run a test through it."""
    import platform

    from lightwell.kernels.cpu import gguf_cpu

    if not gguf_cpu.available():
        pytest.skip("no C compiler with OpenMP")
    if request.param == "avx2" and platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("AVX2 is x86")
    target = str(tmp_path_factory.mktemp("isa") / f"gguf_cpu_{request.param}.so")
    return request.param, gguf_cpu.compile_for(CPU_ISAS[request.param], target)
