"""Worker.shutdown waits for the device before it frees anything: a step launched ahead by the
async loop may still be running, and freeing (then empty_cache) under it is an illegal address."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from lightwell.worker.worker import Worker


def test_shutdown_synchronizes_the_gpu_before_freeing(monkeypatch):
    events = []
    runner = object()
    w = SimpleNamespace(
        device=torch.device("cuda", 1), runner=runner, compile_watch=None, tp_size=1, world_size=1
    )

    def sync(device=None):
        events.append(("sync", device, w.runner is runner))  # the runner is still alive

    monkeypatch.setattr(torch.cuda, "synchronize", sync)
    Worker.shutdown(w)
    assert events == [("sync", torch.device("cuda", 1), True)] and w.runner is None


def test_shutdown_on_cpu_does_not_touch_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: (_ for _ in ()).throw(AssertionError))
    w = SimpleNamespace(
        device=torch.device("cpu"), runner=object(), compile_watch=None, tp_size=1, world_size=1
    )
    Worker.shutdown(w)
    assert w.runner is None


def test_shutdown_goes_on_when_the_device_is_already_in_error(monkeypatch, caplog):
    def broken(device=None):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch.cuda, "synchronize", broken)
    w = SimpleNamespace(
        device=torch.device("cuda", 0), runner=object(), compile_watch=None, tp_size=1, world_size=1
    )
    Worker.shutdown(w)
    assert w.runner is None and "illegal memory access" in caplog.text
