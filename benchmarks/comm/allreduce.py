"""Stage of benchmarks/gpu_tp.py run in 2 spawned processes (one per GPU): the all-reduce table
and a model-level check of every strategy and of the dual-stream forward.

Table: per strategy and message size (tokens x 4096 bf16), eager and (up to 512 tokens) inside
a CUDA graph, the median time per all-reduce, with the error against the exact fp32 sum.
Check: a small random Llama (fp32) at TP=2; each strategy's logits against NCCL's, and the
two-micro-batch forward on a second CUDA stream against the plain forward.
Rank 0 appends rows to ``out`` (a JSON list) as it goes; every part is time-boxed.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from results_io import record  # noqa: E402

HIDDEN = 4096
TOKENS = [1, 8, 32, 64, 128, 512, 2048, 8192]
GRAPH_MAX_TOKENS = 512
# the all-reduce + residual add + RMSNorm rows (fused in hostmem's kernel, or the all-reduce then
# the fused_add_rmsnorm kernel): the sizes of decode and of a 2,048-token prefill
NORM_TOKENS = [1, 8, 64, 128, 512, 2048]
CHECK_MODEL = json.dumps(  # llama-3-8b's config with small shapes
    {
        "preset": "llama-3-8b",
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "num_hidden_layers": 4,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "vocab_size": 32000,
    }
)


def emit(out: str, rows: list, metric: str, value: float, **fields) -> None:
    rows.append(record(metric, value, **fields))
    with open(out, "w") as f:
        json.dump(rows, f, indent=1)


def _inputs(tokens: int, rank: int) -> torch.Tensor:  # [tokens, HIDDEN] bf16 on this GPU
    g = torch.Generator(device="cuda").manual_seed(17 + 1000 * rank + tokens)
    return torch.randn(tokens, HIDDEN, device="cuda", generator=g).to(torch.bfloat16)


def _time_eager(fn, x: torch.Tensor, iters: int) -> float:  # us per call
    import torch.distributed as dist

    for _ in range(3):
        fn(x.clone())
    samples = []
    for _ in range(3):
        xs = [x.clone() for _ in range(iters)]
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for xi in xs:
            fn(xi)
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / iters)
    return statistics.median(samples)


def _time_graph(fn, x: torch.Tensor, per_graph: int = 8) -> float:  # us per call, replayed
    xs = [x.clone() for _ in range(per_graph)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for xi in xs:  # warm-up outside the capture (lazy init, NCCL registration)
            fn(xi)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for xi in xs:
            fn(xi)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (10 * per_graph)


def _strategies(ctx, mode: str) -> dict:
    from lightwell.distributed.comm import create_strategy, is_available
    from lightwell.distributed.comm.int8 import Int8AllReduce

    big = 8192 * HIDDEN * 2
    makers = {"nccl": lambda: create_strategy("nccl", ctx)}
    if mode == "nvlink" and is_available("oneshot", ctx):
        makers["oneshot"] = lambda: create_strategy("oneshot", ctx, max_bytes=big)
    if mode == "nvlink" and is_available("peermem", ctx):  # hostmem-ll's kernel, peer memory
        makers["peermem"] = lambda: create_strategy("peermem", ctx, max_bytes=big, fuse_norm="1")
    # fuse_norm "1": the +norm rows fuse at every size (the default rule would refuse some)
    makers["hostmem"] = lambda: create_strategy("hostmem", ctx, max_bytes=big, fuse_norm="1")
    makers["hostmem-int8"] = lambda: create_strategy(
        "hostmem-int8", ctx, max_bytes=big, fuse_norm="1"
    )
    for kind in ("hostmem", "hostmem-int8"):  # the low-latency protocol (decode sizes)
        makers[f"{kind}-ll"] = lambda kind=kind: create_strategy(
            kind, ctx, max_bytes=big, protocol="ll", fuse_norm="1"
        )
    makers["hostmem-int8-ll-b2048"] = lambda: create_strategy(
        "hostmem-int8", ctx, max_bytes=big, protocol="ll", block=2048
    )
    # the copy engines (eager only), the message in 1 / 4 (default) / 8 pieces
    makers["hostmem-copy"] = lambda: create_strategy("hostmem-copy", ctx, max_bytes=big)
    makers["hostmem-copy-int8"] = lambda: create_strategy("hostmem-copy-int8", ctx, max_bytes=big)
    for chunks in (1, 8):
        makers[f"hostmem-copy-c{chunks}"] = lambda chunks=chunks: create_strategy(
            "hostmem-copy", ctx, max_bytes=big, chunks=chunks
        )
    for kind in ("hostmem-copy", "hostmem-copy-int8"):  # each direction's chunks on 2 streams
        makers[f"{kind}-l2"] = lambda kind=kind: create_strategy(kind, ctx, max_bytes=big, lanes=2)
    if os.environ.get("TP_TABLE_ALL"):  # measured in tp_run4 calls 1-2
        makers["int8-torch-ops"] = lambda: Int8AllReduce(ctx, fused=False)
        makers["int8"] = lambda: create_strategy("int8", ctx)  # fused kernels on GPUs
        makers["host"] = lambda: create_strategy("host", ctx, max_bytes=big)
    out = {}
    for name, make in makers.items():
        try:
            strategy = make()
        except Exception as e:  # noqa: BLE001 - report and go on with the others
            print(f"  {mode} {name}: could not be built: {e!r}", flush=True)
            continue
        if name == "oneshot":
            out["oneshot-1shot"], out["oneshot-2shot"] = strategy.one_shot, strategy.two_shot
        else:
            out[name] = strategy.all_reduce
        if name in ("nccl", "hostmem", "hostmem-int8", "hostmem-ll", "peermem"):
            out.update(_with_norm(name, strategy))
    return out


def _with_norm(name: str, strategy) -> dict:
    """``name+norm`` (the all-reduce fused with the residual add + RMSNorm, hostmem's) and
    ``name+sep-norm`` (the all-reduce, then the fused_add_rmsnorm kernel). The residual is
    zero, so the new residual they return is the sum (checked like the others)."""
    from lightwell.kernels.rmsnorm import fused_add_rmsnorm

    weight = torch.ones(HIDDEN, dtype=torch.bfloat16, device="cuda")
    zeros = torch.zeros(max(TOKENS), HIDDEN, dtype=torch.bfloat16, device="cuda")
    fns = {
        f"{name}+sep-norm": lambda x: fused_add_rmsnorm(
            strategy.all_reduce(x), zeros[: len(x)], weight, 1e-5
        )[1]
    }
    if hasattr(strategy, "all_reduce_add_rmsnorm"):
        fns[f"{name}+norm"] = lambda x: strategy.all_reduce_add_rmsnorm(
            x, zeros[: len(x)], weight, 1e-5
        )[1]
    return fns


def pcie_probe(rank: int, mode: str, out: str, rows: list) -> None:
    """Copy-engine bandwidth to and from pinned host memory, both ranks at once (16 MiB)."""
    import torch.distributed as dist

    dev = torch.empty(16 << 20, dtype=torch.uint8, device="cuda")
    host = torch.empty(16 << 20, dtype=torch.uint8, pin_memory=True)
    for name, (dst, src) in {"d2h": (host, dev), "h2d": (dev, host)}.items():
        for _ in range(3):
            dst.copy_(src, non_blocking=True)
        dist.barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        gbps = 10 * dev.numel() / (time.perf_counter() - t0) / 1e9
        print(f"  {mode} rank {rank} {name} {gbps:.1f} GB/s (both ranks copying)", flush=True)
        if rank == 0:
            emit(out, rows, f"pcie_{name}_gbps", gbps, workload="pcie-probe", mode=mode)


def allreduce_table(rank: int, ctx, mode: str, out: str, rows: list, deadline: float) -> None:
    pcie_probe(rank, mode, out, rows)
    only = os.environ.get("TP_TABLE_ONLY")  # comma-separated strategy rows, for short runs
    for name, fn in _strategies(ctx, mode).items():
        if only and name not in only.split(","):
            continue
        for tokens in NORM_TOKENS if "norm" in name else TOKENS:
            if time.time() > deadline:
                return
            x = _inputs(tokens, rank)
            exact = _inputs(tokens, 0).float() + _inputs(tokens, 1).float()
            err = fn(x.clone()).float() - exact
            rel = (err.norm() / exact.norm()).item()
            ok = rel < (0.03 if "int8" in name else 5e-3)
            iters = 50 if tokens <= 512 else 10
            timings = {"eager": _time_eager(fn, x, iters)}
            if tokens <= GRAPH_MAX_TOKENS and name != "host":
                timings["graph"] = _time_graph(fn, x)
            if rank == 0:
                for how, us in timings.items():
                    emit(
                        out,
                        rows,
                        "allreduce_us",
                        us,
                        workload="allreduce",
                        mode=mode,
                        tp=2,
                        strategy=name,
                        launch=how,
                        tokens=tokens,
                        bytes=tokens * HIDDEN * 2,
                        dtype="bfloat16",
                        rel_err=rel,
                        max_abs_err=err.abs().max().item(),
                        correct=ok,
                    )
                print(
                    f"  {mode} {name:14s} {tokens:5d} tok  "
                    + "  ".join(f"{k} {v:8.1f} us" for k, v in timings.items())
                    + f"  rel_err {rel:.1e}",
                    flush=True,
                )


def model_check(rank: int, ctx, mode: str, out: str, rows: list) -> None:
    """Logits of one prefill batch (3 requests, 700 tokens) per strategy, vs NCCL's."""
    from lightwell.distributed.comm.hostmem import FUSE_NORM_ENV
    from lightwell.distributed.comm.hostmem_copy import LANES_ENV
    from lightwell.distributed.comm.selector import AllReduceSelector
    from lightwell.distributed.parallel_state import get_tp_all_reduce, set_tp_all_reduce
    from lightwell.models.hf_config import load_hf_config
    from lightwell.models.loader import load_model
    from lightwell.worker.model_runner import ModelRunner
    from lightwell.worker.overlap import MicroBatchOverlap

    hf = load_hf_config(None, CHECK_MODEL)
    model = load_model(None, hf, torch.float32, ctx.device, load_format="dummy", seed=5)
    runner = ModelRunner(
        model,
        block_size=16,
        vocab_size=hf.vocab_size,
        device=ctx.device,
        dtype=torch.float32,
    )
    runner.set_attention_backend("triton")
    runner.init_kv_cache(128)
    choices = [
        "nccl",
        "auto",
        "oneshot",
        "peermem",
        "int8",
        "host",
        "hostmem",
        "hostmem-fused",  # every all-reduce fused with its norm (1,024 hidden: 4 rows a block)
        "hostmem-int8",
        "nccl+dual",
        "hostmem+dual",
        "hostmem-int8+dual",
        "hostmem-copy",  # plain: hostmem's lanes; +dual: the copy engines (2.8 / 1.4 MB)
        "hostmem-copy+dual",
        "hostmem-copy-int8+dual",
        "hostmem-copy+dual+graph",  # replayed from a mixed-step graph, split inside it
        "hostmem-copy-int8+dual+graph",
        "hostmem-copy+dual3+graph",  # the same in three micro-batches
        "hostmem-copy-int8+dual3+graph",
        "hostmem-copy+dual+graph+l2",  # the copies of each direction on two streams
        "hostmem-copy-int8+dual+graph+l2",
    ]
    if mode != "nvlink":
        choices = [c for c in choices if c not in ("auto", "oneshot", "peermem")]
    only = os.environ.get("TP_CHECK_ONLY")  # comma-separated choices (nccl, the reference, kept)
    if only:
        choices = ["nccl"] + [c for c in choices if c in only.split(",") and c != "nccl"]
    ref, fuse_env = None, os.environ.get(FUSE_NORM_ENV)
    for step, choice in enumerate(choices):
        name = choice.split("+")[0].removesuffix("-fused")
        previous = get_tp_all_reduce()
        if previous is not None:
            previous.close()
        os.environ[FUSE_NORM_ENV] = "1" if choice.endswith("-fused") else "auto"
        parts = (3 if "+dual3" in choice else 2) if "+dual" in choice else 0
        lanes = next((w[1:] for w in choice.split("+") if w[:1] == "l"), "1")  # +lN: N lanes
        with mock.patch.dict(os.environ, {LANES_ENV: lanes}):
            selector = AllReduceSelector(ctx, name, mode == "nvlink", 8 << 20, parts)
        set_tp_all_reduce(selector)
        runner.overlap = MicroBatchOverlap(model, 2, torch.cuda.Stream(), parts) if parts else None
        runner.graphs = None
        if "graph" in choice.split("+")[1:]:  # every mixed graph (16..1,024 tokens) split in parts
            runner.capture_cuda_graphs(max_batch=4, max_model_len=2048, prefill_tokens=1024)
        logits = _prefill_logits(runner, step)  # [3, V]
        if ref is None:
            ref = logits
        rel = ((logits - ref).norm() / ref.norm()).item()
        same = bool((logits.argmax(-1) == ref.argmax(-1)).all())
        if rank == 0:
            emit(
                out,
                rows,
                "logits_rel_err",
                rel,
                workload="check",
                mode=mode,
                tp=2,
                strategy=choice,
                argmax_equal=same,
                model="llama-1024x4-random",
                dtype="float32",
            )
            print(
                f"  check {mode} {choice:10s} logits rel err vs nccl {rel:.2e}  "
                f"argmax equal {same}",
                flush=True,
            )
    if fuse_env is None:  # as it was: the strategies built later follow their default rule
        os.environ.pop(FUSE_NORM_ENV, None)
    else:
        os.environ[FUSE_NORM_ENV] = fuse_env


def _prefill_logits(runner, step: int) -> torch.Tensor:
    from lightwell.scheduler.output import NewRequestData, SchedulerOutput
    from lightwell.types import SamplingParams

    lens, reqs, blocks = [300, 150, 250], [], 0
    g = torch.Generator().manual_seed(3)
    for i, n in enumerate(lens):
        ids = torch.randint(0, 32000, (n,), generator=g).tolist()
        need = -(-n // 16)
        reqs.append(
            NewRequestData(
                f"s{step}r{i}",
                ids,
                n,
                SamplingParams(max_tokens=1),
                list(range(blocks, blocks + need)),
                0,
            )
        )
        blocks += need
    done = {f"s{step - 1}r{i}" for i in range(3)} if step else set()
    sched = SchedulerOutput(reqs, [], {r.req_id: len(r.token_ids) for r in reqs}, sum(lens), done)
    with torch.inference_mode():
        runner.batch.apply(sched)
        inp = runner.batch.prepare(sched)
        if runner.graphs is not None:  # the 700 tokens padded into the 1,024-token graph
            assert runner.graphs.graph_for(inp.meta) == ("mixed", 1024)
            hidden = runner.graphs.run(inp.input_ids, inp.positions, inp.meta)  # [T, H]
        else:
            hidden = runner.forward(inp.input_ids, inp.positions, inp.meta)  # [T, H]
        return runner.model.compute_logits(hidden[inp.logits_indices])  # [3, V]


def run_rank(rank: int, port: int, mode: str, out: str, deadline: float, stages: str) -> None:
    import torch.distributed as dist

    from lightwell.distributed.comm import CommContext
    from lightwell.distributed.launch import init_distributed
    from lightwell.distributed.parallel_state import get_tp_cpu_group, get_tp_group

    device = torch.device("cuda", rank)
    init_distributed(rank, 2, f"tcp://127.0.0.1:{port}", device)
    ctx = CommContext(rank, 2, get_tp_group(), get_tp_cpu_group(), device)
    rows: list = []
    if "allreduce" in stages:
        allreduce_table(rank, ctx, mode, out, rows, deadline - 25)
    if "check" in stages and time.time() < deadline - 10:
        model_check(rank, ctx, mode, out, rows)
    dist.barrier()
    dist.destroy_process_group()
