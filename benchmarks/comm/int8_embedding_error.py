"""How much of hostmem-int8's error the embedding's all-reduce carries: logits of a 4-layer
random Llama (hidden 128, fp32) over 2 CPU ranks (gloo, the hostmem kernels under the Triton
interpreter), NCCL's (gloo's) sum against hostmem-int8 with the embedding's all-reduce exact
(the default: ``comm.base.exact_sum``) and quantized like the rest. On the CPU, 1-3 minutes:

    TRITON_INTERPRET=1 OMP_NUM_THREADS=1 python3 -m benchmarks.comm.int8_embedding_error \
        --out benchmarks/results/comm_int8_embedding_error_cpu.json

Prints the relative logits error of each (60 prompt tokens); ``--out`` also writes them.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightwell.bench.results import record, script_command, write_json


def run(rank: int, port: int, folder: str, out: str | None, command: str) -> None:
    from lightwell.attention.metadata import forward_context
    from lightwell.distributed.comm import CommContext
    from lightwell.distributed.comm.selector import AllReduceSelector
    from lightwell.distributed.parallel_state import init_tp_group, set_tp_all_reduce
    from lightwell.layers import embedding
    from tests.models.paged import bind_kv_caches, build_metadata
    from tests.models.tiny import load_ours

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)  # fmt: skip
    group = dist.group.WORLD
    init_tp_group(rank, 2, group)
    ctx = CommContext(rank, 2, group, group, torch.device("cpu"))
    model = load_ours(folder)
    bind_kv_caches(model, 64, 4, torch.float32, torch.device("cpu"))
    tokens = 60
    meta, pos = build_metadata([tokens], [tokens], [list(range(1, 16))], 4, torch.device("cpu"))
    ids = torch.randint(0, 256, (tokens,), generator=torch.Generator().manual_seed(0))

    def logits() -> torch.Tensor:
        with torch.no_grad(), forward_context(meta):
            return model.compute_logits(model(ids, pos))

    ref = logits()
    selector = AllReduceSelector(ctx, "hostmem-int8", max_bytes=1 << 20)
    set_tp_all_reduce(selector)
    exact_embedding = logits()
    embedding.exact_sum = contextlib.nullcontext  # the embedding's all-reduce in int8 too
    quantized = logits()
    if rank == 0:
        rows = []
        for name, got in (("embedding exact", exact_embedding), ("all in int8", quantized)):
            err = ((got - ref).norm() / ref.norm()).item()
            print(f"hostmem-int8, {name:15s}: logits rel err {err:.3e}")
            rows.append(record("logits_rel_err", err, workload="check", strategy="hostmem-int8",
                               embedding_all_reduce=name, model="llama-128x4-random",
                               dtype="float32", tp=2, backend="gloo", command=command))  # fmt: skip
        if out:
            write_json(out, rows)
    set_tp_all_reduce(None)
    selector.close()
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the figures here (JSON records)")
    args = ap.parse_args()
    from lightwell.executor.multiproc import free_port
    from tests.models.tiny import hf_tiny_model, save_hf, tiny_config

    cfg = tiny_config("base", num_key_value_heads=2, hidden_size=128, num_hidden_layers=4)
    with tempfile.TemporaryDirectory() as tmp:
        folder = save_hf(hf_tiny_model(cfg, seed=3), os.path.join(tmp, "tiny"))
        mp.spawn(run, args=(free_port(), folder, args.out, script_command()), nprocs=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
