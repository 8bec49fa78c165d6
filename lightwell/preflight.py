"""What `lightwell generate | chat | serve` check before loading a model (which takes seconds
to minutes): the device, the attention backend, the port and the sampling options. Each
failure is a ValueError of one line that says what is wrong and what to do."""

from __future__ import annotations

import os
import socket
from typing import Any

from lightwell import envs
from lightwell.config import EngineConfig
from lightwell.types import SamplingParams


def check_engine_config(cfg: EngineConfig) -> None:
    """The device and backend asked for exist on this machine."""
    import torch

    gen = cfg.model.generation_config
    if gen not in ("auto", "vllm") and not os.path.isfile(
        os.path.join(gen, "generation_config.json")
    ):
        raise ValueError(f"--generation-config {gen!r}: no generation_config.json there")
    d, tp = cfg.device, cfg.parallel.tensor_parallel_size
    has_cuda = torch.cuda.is_available()
    if d.device == "cuda" and not has_cuda:
        raise ValueError(
            "--device cuda: PyTorch sees no CUDA GPU here (no driver, no device, or a CPU-only "
            "torch build); use --device cpu or --device auto"
        )
    on_gpu = has_cuda and d.device != "cpu"
    if d.attention_backend == "triton" and not on_gpu and not envs.triton_interpret():
        raise ValueError(
            "--attention-backend triton needs a CUDA GPU (on a CPU, Triton runs only under "
            "its test interpreter, TRITON_INTERPRET=1); use --attention-backend torch or auto"
        )
    if on_gpu and tp > torch.cuda.device_count():
        raise ValueError(
            f"--tensor-parallel-size {tp} needs {tp} GPUs but {torch.cuda.device_count()} are "
            "visible; lower it or make more GPUs visible (CUDA_VISIBLE_DEVICES)"
        )


def check_sampling(overrides: dict[str, Any]) -> SamplingParams:
    """The sampling options as SamplingParams (ValueError on a bad one)."""
    return SamplingParams(**overrides)


def check_port(host: str, port: int) -> None:
    """ValueError if ``host:port`` cannot be listened on (in use, no permission, bad address)."""
    if not 0 <= port <= 65535:
        raise ValueError(f"--port {port}: must be in 0..65535")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"--host {host!r}: not an address this machine has ({e})") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
        try:
            sock.bind(addr)
        except OSError as e:
            hint = "another process is using it: stop it or pick another --port"
            if e.errno != 98:  # EADDRINUSE
                hint = "pick another --host / --port"
            raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}; {hint}") from None
