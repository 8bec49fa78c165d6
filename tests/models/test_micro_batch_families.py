"""The dual-stream micro-batch forward for the families beyond Llama: MiniCPM (each all-reduced
output scaled before it joins the residual), Command-R (one all-reduce a layer, over the
parallel block's attention + MLP partial sums) and Qwen3 / Mistral (Llama's stages). Their
micro-batch forward must give the plain forward's hidden states, at TP=1 and at TP=2 over gloo,
for a prefill cut inside a request, a decode-only step and a mixed step."""

from __future__ import annotations

import os

import torch
from torch import nn

from tests.models.families import cohere, minicpm, mistral, qwen3
from tests.models.test_tensor_parallel import _free_port
from tests.models.test_tensor_parallel_comm import micro_batch_steps, plain_and_split

BUILDS = {"minicpm": minicpm, "cohere": cohere, "qwen3": qwen3, "mistral": mistral}


def _compare(folders: dict[str, str]) -> dict[str, float]:
    """Largest difference, per family, between the micro-batch forward (two and three
    micro-batches) and the plain forward over ``STEPS``."""
    from lightwell.attention.metadata import forward_context
    from lightwell.dual_stream.comm import CommStream
    from lightwell.dual_stream.forward import micro_batch_forward, supports_micro_batches
    from lightwell.dual_stream.split import can_split, split_batch

    worst = {}
    for key, folder in folders.items():
        plain, split = plain_and_split(folder)
        assert supports_micro_batches(split), key
        worst[key] = 0.0
        for _, ids, pos, meta in micro_batch_steps():
            with torch.no_grad(), forward_context(meta):
                want = plain(ids, pos)  # [T, H]
            assert want.abs().max() > 0.1  # real signal, not a vanishing output
            for parts in (2, 3):
                if not can_split(meta, parts):
                    continue
                with torch.no_grad():
                    got = micro_batch_forward(
                        split, split_batch(ids, pos, meta, parts), CommStream(None)
                    )
                err = ((got - want).abs().max() / want.abs().max()).item()
                worst[key] = max(worst[key], err)
    return worst


def _saved(tmp_path) -> dict[str, str]:
    folders = {}
    for key, build in BUILDS.items():
        folders[key] = str(tmp_path / key)
        os.makedirs(folders[key], exist_ok=True)
        build(folders[key], 7)
    return folders


def test_micro_batches_match_the_plain_forward_tp1(tmp_path):
    worst = _compare(_saved(tmp_path))
    assert max(worst.values()) < 1e-5, worst


def _run_rank(rank: int, port: int, folders: dict[str, str], out: str) -> None:
    import torch.distributed as dist

    from lightwell.distributed.launch import shutdown_distributed
    from lightwell.distributed.parallel_state import init_tp_group

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    init_tp_group(rank, 2, dist.group.WORLD)
    worst = _compare(folders)
    if rank == 0:
        torch.save(worst, out)
    shutdown_distributed()


def test_micro_batches_match_the_plain_forward_tp2(tmp_path):
    import torch.multiprocessing as mp

    torch.set_num_threads(1)
    folders = _saved(tmp_path)
    folders = {k: folders[k] for k in ("minicpm", "cohere")}  # (Llama's stages: elsewhere)
    out = str(tmp_path / "worst.pt")
    mp.spawn(_run_rank, args=(_free_port(), folders, out), nprocs=2, join=True)
    worst = torch.load(out)
    assert set(worst) == {"minicpm", "cohere"} and max(worst.values()) < 1e-5, worst


def test_a_layer_whose_forward_its_stages_do_not_describe_runs_plain(tmp_path):
    """A layer class whose ``forward`` the dual-stream stages do not know (a subclass that
    overrides it, or a layer whose MLP has no partial-sum form) makes the model run plain,
    not wrong."""
    from lightwell.dual_stream.forward import supports_micro_batches
    from lightwell.models.llama import LlamaDecoderLayer
    from tests.models.tiny import load_ours

    folder = str(tmp_path / "mistral")
    mistral(folder, 7)
    model = load_ours(folder)
    assert supports_micro_batches(model)

    class Scaled(LlamaDecoderLayer):
        def forward(self, positions, hidden, residual):
            out, residual = super().forward(positions, hidden, residual)
            return out * 2, residual

    layer = model.model.layers[1]
    layer.__class__ = Scaled
    assert not supports_micro_batches(model)
    layer.__class__ = LlamaDecoderLayer
    layer.mlp = nn.Identity()  # no partial-sum form
    assert not supports_micro_batches(model)
