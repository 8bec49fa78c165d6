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
