"""The all-reduce strategies on 2 GPUs: per strategy and message size (tokens x 4096 bf16),
eager and (up to 512 tokens) inside a CUDA graph, the median time per all-reduce with its error
against the exact fp32 sum; then a model-level check of every --all-reduce choice and of the
dual-stream forward. One device call of about a minute per mode:

    run(kind="nvidia-h200-x2",
        command="python3 -m benchmarks.comm.allreduce --mode nvlink --out $OUT/allreduce.json")

``--mode pcie-emulated`` sets NCCL_P2P_DISABLE=1 (NCCL through host memory, no peer-memory
strategies); ``--stages allreduce`` or ``check`` runs one part; ``--only nccl,hostmem`` limits
the table's rows; ``--experimental`` adds the strategies of lightwell.experimental.comm (int8
over NCCL, host) to the table (peermem is in it whenever the GPUs have peer access).
workloads/tp.py runs this first in each of its modes. Reference results:
benchmarks/results/allreduce_tp2_nvlink.json and allreduce_tp2_pcie-emulated.json.

Check: a small random Llama (fp32) at TP=2; each strategy's logits against NCCL's, and the
two- and three-micro-batch forward on a second CUDA stream against the plain forward.
Rank 0 appends rows to ``--out`` (a JSON list) as it goes; every part is time-boxed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch

from lightwell.bench.results import record
from lightwell.config import ParallelConfig

# NCCL reads its environment at init: each mode's, set before the ranks start
MODE_ENV = {"nvlink": {}, "pcie-emulated": {"NCCL_P2P_DISABLE": "1"}}
COMMON_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
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


@dataclass
class Sink:
    """Rank 0's rows, rewritten to ``out`` after each one; ``command`` is the run's."""

    out: str
    command: str
    rank: int
    rows: list = field(default_factory=list)

    def emit(self, metric: str, value: float, **fields) -> None:
        if self.rank != 0:
            return
        self.rows.append(record(metric, value, command=self.command, **fields))
        with open(self.out, "w") as f:
            json.dump(self.rows, f, indent=1)


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


def _strategies(ctx, mode: str, experimental: bool) -> dict:
    from lightwell.distributed.comm import create_strategy, is_available

    big = 8192 * HIDDEN * 2
    makers = {"nccl": lambda: create_strategy("nccl", ctx)}
    if mode == "nvlink" and is_available("oneshot", ctx):
        makers["oneshot"] = lambda: create_strategy("oneshot", ctx, max_bytes=big)
    if mode == "nvlink":  # hostmem-ll's kernel, its words pushed into the peer GPU's memory
        makers["peermem"] = lambda: _experimental("peermem", ctx, max_bytes=big, fuse_norm="1")
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
    if experimental:
        makers["int8-torch-ops"] = lambda: _experimental("int8", ctx, fused=False)
        makers["int8"] = lambda: _experimental("int8", ctx)  # fused kernels on GPUs
        makers["host"] = lambda: _experimental("host", ctx, max_bytes=big)
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


def pcie_probe(rank: int, mode: str, sink: Sink) -> None:
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
        sink.emit(f"pcie_{name}_gbps", gbps, workload="pcie-probe", mode=mode)


def allreduce_table(rank: int, ctx, args: argparse.Namespace, sink: Sink) -> None:
    mode, deadline = args.mode, args.deadline - 25
    pcie_probe(rank, mode, sink)
    for name, fn in _strategies(ctx, mode, args.experimental).items():
        if args.only and name not in args.only.split(","):
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
            max_abs_err = err.abs().max().item()
            for how, us in timings.items():
                sink.emit(
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
                    max_abs_err=max_abs_err,
                    correct=ok,
                )
            if rank == 0:
                print(
                    f"  {mode} {name:14s} {tokens:5d} tok  "
                    + "  ".join(f"{k} {v:8.1f} us" for k, v in timings.items())
                    + f"  rel_err {rel:.1e}",
                    flush=True,
                )


# --all-reduce choices checked (+dual: two micro-batches, +dual3: three, +graph: replayed from a
# mixed-step graph and split inside it), then lightwell.experimental.comm's strategies
CHECK_CHOICES = [
    "nccl",
    "auto",
    "oneshot",
    "hostmem",
    "hostmem-fused",  # every all-reduce fused with its norm (1,024 hidden: 4 rows a block)
    "hostmem-int8",
    "nccl+dual",
    "hostmem+dual",
    "hostmem-int8+dual",
    "hostmem-copy",  # plain: hostmem's lanes; +dual: the copy engines (2.8 / 1.4 MB)
    "hostmem-copy+dual",
    "hostmem-copy-int8+dual",
    "hostmem-copy+dual+graph",
    "hostmem-copy-int8+dual+graph",
    "hostmem-copy+dual3+graph",
    "hostmem-copy-int8+dual3+graph",
    "experimental:peermem",
    "experimental:int8",
    "experimental:host",
]
PEER_ONLY = ("auto", "oneshot", "experimental:peermem")  # the nvlink mode's only


def model_check(rank: int, ctx, args: argparse.Namespace, sink: Sink) -> None:
    """Logits of one prefill batch (3 requests, 700 tokens) per strategy, vs NCCL's."""
    from lightwell.distributed.parallel_state import get_tp_all_reduce, set_tp_all_reduce
    from lightwell.models.hf_config import load_hf_config
    from lightwell.models.loader import load_model
    from lightwell.worker.model_runner import ModelRunner

    mode = args.mode
    hf = load_hf_config(None, CHECK_MODEL)
    model = load_model(None, hf, torch.float32, ctx.device, load_format="dummy", seed=5)
    runner = ModelRunner(
        model, block_size=16, vocab_size=hf.vocab_size, device=ctx.device, dtype=torch.float32
    )
    runner.set_attention_backend("triton")
    runner.init_kv_cache(128)
    choices = [c for c in CHECK_CHOICES if mode == "nvlink" or c not in PEER_ONLY]
    if args.check_only:  # nccl, the reference, kept
        choices = ["nccl"] + [c for c in choices if c in args.check_only.split(",") and c != "nccl"]
    ref = None
    for step, choice in enumerate(choices):
        previous = get_tp_all_reduce()
        if previous is not None:
            previous.close()
        parts = (3 if "+dual3" in choice else 2) if "+dual" in choice else 0
        set_tp_all_reduce(_check_strategy(ctx, choice, mode, parts))
        runner.overlap = _dual_stream(model, parts, ctx.device) if parts else None
        runner.graphs = None
        if "graph" in choice.split("+")[1:]:  # every mixed graph (16..1,024 tokens) split in parts
            runner.capture_cuda_graphs(max_batch=4, max_model_len=2048, prefill_tokens=1024)
        logits = _prefill_logits(runner, step)  # [3, V]
        if ref is None:
            ref = logits
        rel = ((logits - ref).norm() / ref.norm()).item()
        same = bool((logits.argmax(-1) == ref.argmax(-1)).all())
        sink.emit(
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
        if rank == 0:
            print(f"  check {mode} {choice:10s} logits rel err vs nccl {rel:.2e}  "
                  f"argmax equal {same}", flush=True)  # fmt: skip


def _check_strategy(ctx, choice: str, mode: str, parts: int):
    """The all-reduce of check row ``choice``: the selector of an --all-reduce choice, or an
    experimental strategy with NCCL for the messages it does not take."""
    from lightwell.distributed.comm import create_strategy
    from lightwell.distributed.comm.selector import AllReduceSelector

    name = choice.split("+")[0]
    if name.startswith("experimental:"):
        return _WithFallback(
            _experimental(name.split(":", 1)[1], ctx), create_strategy("nccl", ctx)
        )
    selector = AllReduceSelector(ctx, name.removesuffix("-fused"), mode == "nvlink", 8 << 20, parts)
    if name.endswith("-fused"):  # fuse the residual add + RMSNorm at every size
        for strategy in selector.preferred:
            if hasattr(strategy, "fuse_norm_max_bytes"):
                strategy.fuse_norm_max_bytes = strategy.max_bytes
    return selector


def _experimental(name: str, ctx, **options):
    """A strategy of lightwell.experimental.comm (peermem, int8, host)."""
    from lightwell.experimental.comm import create_experimental

    return create_experimental(name, ctx, **options)


def _dual_stream(model, parts: int, device: torch.device):
    """The dual-stream forward in ``parts`` micro-batches from 2 tokens (a high-priority
    stream, as the engine's)."""
    from lightwell.dual_stream import DualStream

    parallel = ParallelConfig(
        tensor_parallel_size=2,
        dual_stream=True,
        dual_stream_min_tokens=2,
        dual_stream_micro_batches=parts,
    )
    return DualStream.create(model, parallel, device)


class _WithFallback:
    """``strategy`` for the messages it supports, ``fallback`` for the rest."""

    name = "with-fallback"
    graph_safe = False

    def __init__(self, strategy, fallback) -> None:
        self.strategy, self.fallback = strategy, fallback

    def supports(self, x: torch.Tensor) -> bool:
        return True

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        pick = self.strategy if self.strategy.supports(x) else self.fallback
        return pick.all_reduce(x)

    def close(self) -> None:
        for s in (self.strategy, self.fallback):
            getattr(s, "close", lambda: None)()


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


def run_rank(rank: int, port: int, args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from lightwell.distributed.comm import CommContext
    from lightwell.distributed.launch import init_distributed
    from lightwell.distributed.parallel_state import get_tp_cpu_group, get_tp_group

    device = torch.device("cuda", rank)
    init_distributed(rank, 2, f"tcp://127.0.0.1:{port}", device)
    ctx = CommContext(rank, 2, get_tp_group(), get_tp_cpu_group(), device)
    sink = Sink(args.out, args.command, rank)
    if "allreduce" in args.stages:
        allreduce_table(rank, ctx, args, sink)
    if "check" in args.stages and time.time() < args.deadline - 10:
        model_check(rank, ctx, args, sink)
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", required=True, help="JSON file for rank 0's rows")
    ap.add_argument("--mode", choices=sorted(MODE_ENV), default="nvlink")
    ap.add_argument("--stages", default="allreduce,check", help="allreduce, check")
    ap.add_argument("--budget-s", type=float, default=90.0, help="time box of the whole run")
    ap.add_argument("--only", default="", help="comma-separated table rows (strategies)")
    ap.add_argument("--check-only", default="", help="comma-separated check rows")
    ap.add_argument("--experimental", action="store_true", help="int8 and host in the table")
    ap.add_argument("--deadline", type=float, help=argparse.SUPPRESS)  # from workloads/tp.py
    ap.add_argument("--command", help=argparse.SUPPRESS)  # the driver's, from workloads/tp.py
    args = ap.parse_args()
    import torch.multiprocessing as mp

    from lightwell.bench.results import script_command
    from lightwell.executor.multiproc import free_port

    args.deadline = args.deadline or time.time() + args.budget_s
    args.command = args.command or script_command()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    os.environ.update({**COMMON_ENV, **MODE_ENV[args.mode]})  # before the ranks start
    mp.spawn(run_rank, args=(free_port(), args), nprocs=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
