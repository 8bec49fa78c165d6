"""One rank: picks the device, loads the model, sizes and allocates the KV cache, runs steps."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from lightwell import progress
from lightwell.config import EngineConfig, is_preset_dummy
from lightwell.layers.rotary import rope_table_length
from lightwell.model_files import ModelFiles, resolve_model
from lightwell.scheduler.output import ModelRunnerOutput, SchedulerOutput
from lightwell.storage.object_store import store_options

if TYPE_CHECKING:
    from lightwell.worker.pending_step import PendingStep

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_DEFAULT_KV_GB = 1.0


@dataclass
class ModelInfo:
    """What the control plane needs to know about the loaded model (plain data)."""

    name: str
    architecture: str
    vocab_size: int
    max_position_embeddings: int
    eos_token_id: int | None
    dtype: str
    device: str
    num_params: int
    load_seconds: float
    hidden_size: int = 0  # also the width of an embedding (--task embed)
    tie_word_embeddings: bool = False
    num_threads: int = 0  # torch's CPU threads in this process
    extra: dict = field(default_factory=dict)
    routed_experts: int = 0  # a MoE layer's routed experts (0: a dense model)


def pick_device(choice: str, index: int | None = None) -> torch.device:
    """``index``: the GPU to use (a tensor-parallel rank's own); default the current one."""
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda was asked for but no CUDA device is available")
        if index is not None and index >= torch.cuda.device_count():
            raise RuntimeError(
                f"tensor-parallel rank {index} needs GPU {index}, but only "
                f"{torch.cuda.device_count()} are visible"
            )
        return torch.device("cuda", torch.cuda.current_device() if index is None else index)
    return torch.device("cpu")


def pick_dtype(choice: str, hf_config: object, device: torch.device) -> torch.dtype:
    if choice != "auto":
        return _DTYPES[choice]
    if device.type == "cpu":
        return torch.float32
    ckpt = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(ckpt, str):
        ckpt = _DTYPES.get(ckpt)
    return ckpt if ckpt in (torch.float16, torch.bfloat16) else torch.bfloat16


def _max_positions(model: torch.nn.Module, hf_config: object) -> int:
    """Positions the model can take: its RoPE tables' length (scaling included)."""
    length = rope_table_length(model)
    return length if length is not None else getattr(hf_config, "max_position_embeddings", 2048)


def _graph_blockers(runner: object) -> str:
    """What keeps the model out of CUDA graphs (host-side work per step): an attention backend
    that says so, or a module with ``cuda_graph_safe = False`` (the MoE torch loop); "" if
    nothing. Layers with ``cuda_graph_mode = "decode"`` (MLA) allow decode-only graphs."""
    attn = [a for a in runner.attn_layers if getattr(a, "cuda_graph_mode", None) != "decode"]
    names = {type(a.backend).__name__ for a in attn if not a.backend.supports_cuda_graphs}
    names |= {
        type(m).__name__
        for m in runner.model.modules()
        if getattr(m, "cuda_graph_safe", True) is False
    }
    return ", ".join(sorted(names))


def _check_context_parallel(runner: object) -> None:
    """Context parallelism stores every chunk's K/V in ``Attention.forward``: layers with a
    forward of their own (the latent cache of MLA) are refused."""
    from lightwell.layers.attention import Attention

    own = {type(a).__name__ for a in runner.attn_layers if type(a).forward is not Attention.forward}
    if own:
        raise ValueError(
            f"context_parallel_size > 1 does not support {', '.join(sorted(own))} layers"
        )


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0, init_method: str | None = None):
        """``init_method`` (``tcp://host:port``): join the tensor-parallel group as ``rank``
        (needed when tensor_parallel_size > 1; every rank constructs its Worker at once)."""
        self.config = config
        self.rank = rank
        self.tp_size = tp = config.parallel.tensor_parallel_size
        self.pp_size = pp = config.parallel.pipeline_parallel_size
        self.world_size = world = config.parallel.world_size
        self.tp_rank, self.stage = rank % tp, (rank // tp) % pp
        self.cp_rank = rank // (tp * pp)  # context parallel: only rank 0 samples
        progress.set_enabled(rank == 0)  # start-up progress: rank 0's alone
        m = config.model
        self.files: ModelFiles | None = (
            None if is_preset_dummy(m) else resolve_model(m.model, m.load_format, store_options(m))
        )
        # Under TP rank r owns cuda:r (decided before any CUDA call, so no context on cuda:0);
        # --stages-share-gpu (testing): every rank on cuda:0.
        local = rank % (world // config.parallel.nnodes)  # this rank's GPU on its host
        local = 0 if config.parallel.stages_share_gpu else local
        self.device = pick_device(config.device.device, local if world > 1 else None)
        threads = config.device.num_threads
        if threads is None and self.device.type == "cpu":
            threads = 1  # OpenMP threads spin-wait on each other on busy cores (--num-threads)
        if threads:
            torch.set_num_threads(threads)
        if self.device.type == "cuda":
            from lightwell.kernels import pdl

            pdl.set_enabled(config.device.pdl)
        if world > 1:
            if init_method is None:
                raise ValueError("more than one rank needs an init_method for the group")
            from lightwell.distributed.launch import init_distributed

            p = config.parallel
            init_distributed(
                rank,
                world,
                init_method,
                self.device,
                pp,
                p.context_parallel_size,
                shared_gpu=p.stages_share_gpu,
            )
        self.runner = None
        self.hf_config = None
        self.compile_watch = None
        if self.device.type == "cuda":  # the interpreter (CPU) compiles nothing
            from lightwell.worker.compile_watch import CompileWatch

            watch = CompileWatch()
            self.compile_watch = watch if watch.install() else None

    def load_model(self) -> ModelInfo:
        from lightwell.models.loader import load_hf_config, load_model
        from lightwell.worker.model_runner import ModelRunner

        t0 = time.perf_counter()
        m = self.config.model
        overrides = m.hf_config_json
        # Dummy weights of a preset/JSON config need no model files at all.
        files = self.files
        with progress.stage("Reading the model config") as st:
            self.hf_config = hf = load_hf_config(files, overrides)
            st.summary = f"read the config of {(getattr(hf, 'architectures', None) or ['?'])[0]}"
        dtype = pick_dtype(m.dtype, hf, self.device)
        fmt = m.load_format
        from lightwell.distributed.parallel_state import set_expert_parallel

        set_expert_parallel(self.config.parallel.enable_expert_parallel)
        model = load_model(
            files, hf, dtype, self.device, load_format=fmt, seed=m.seed,
            quantization=m.quantization,
            cpu_int8_activations=self.config.device.cpu_int8_activations,
        )  # fmt: skip
        eos = getattr(hf, "eos_token_id", None)
        eos = eos[0] if isinstance(eos, list) and eos else eos
        self.runner = ModelRunner(
            model,
            block_size=self.config.cache.block_size,
            vocab_size=hf.vocab_size,
            device=self.device,
            dtype=dtype,
            seed=m.seed,
            is_driver=self.tp_rank == 0 and self.stage == self.pp_size - 1 and self.cp_rank == 0,
            pipeline=self.pp_size > 1,
            kv_cache_dtype=self.config.cache.kv_cache_dtype,
        )
        if self.config.parallel.context_parallel_size > 1:
            _check_context_parallel(self.runner)
        if self.pp_size > 1 and self.rank == 0:
            from lightwell.distributed.pipeline import describe_split

            logger.info(describe_split(hf.num_hidden_layers, self.pp_size))
        self.runner.set_attention_backend(self.config.device.attention_backend)
        from lightwell.dual_stream import DualStream

        self.runner.overlap = DualStream.create(model, self.config.parallel, self.device)
        return ModelInfo(
            name=self.files.name if files is not None else str(overrides),
            architecture=(getattr(hf, "architectures", None) or ["?"])[0],
            vocab_size=hf.vocab_size,
            max_position_embeddings=_max_positions(model, hf),
            eos_token_id=eos,
            dtype=str(dtype).removeprefix("torch."),
            device=str(self.device),
            num_params=sum(p.numel() for p in model.parameters()),
            load_seconds=time.perf_counter() - t0,
            hidden_size=hf.hidden_size,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            num_threads=torch.get_num_threads(),
            routed_experts=_routed_experts(hf),
        )

    def init_all_reduce(self, resolved: EngineConfig) -> None:
        """Set up the all-reduce strategies, their buffers sized for the largest step."""
        if self.tp_size == 1:
            return
        from lightwell.distributed.launch import init_all_reduce

        p = self.config.parallel
        elem = torch.tensor([], dtype=self.runner.dtype).element_size()
        max_bytes = resolved.scheduler.max_num_batched_tokens * self.hf_config.hidden_size * elem
        phases = p.dual_stream_micro_batches if p.dual_stream else 0  # all-reduces in flight
        init_all_reduce(self.device, p.all_reduce, p.custom_all_reduce, max_bytes, phases)

    def determine_num_blocks(self, resolved: EngineConfig) -> int:
        self.init_all_reduce(resolved)
        c = self.config.cache
        if c.num_kv_blocks is not None:
            return c.num_kv_blocks
        per_block = self.runner.kv_bytes_per_block()
        if self.device.type == "cpu" or c.kv_cache_memory_gb is not None:
            budget = (c.kv_cache_memory_gb or CPU_DEFAULT_KV_GB) * (1 << 30)
        else:
            budget = self._gpu_kv_budget(resolved)
        blocks = int(budget // per_block)
        if blocks < 1:
            raise RuntimeError(
                f"no memory left for the KV cache (budget {budget / 2**30:.2f} GiB, "
                f"{per_block} bytes per block): lower the model size or raise the budget"
            )
        return blocks

    def _gpu_kv_budget(self, resolved: EngineConfig) -> float:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        tokens = resolved.scheduler.max_num_batched_tokens
        # the first forward on the device: its Triton kernels compile here
        from lightwell.worker.runner_startup import profile_run

        with progress.stage("Profiling memory (first forward)") as st:
            profile_run(self.runner, tokens, resolved.model.max_model_len)
            torch.cuda.synchronize()
            st.summary = f"profiled the peak memory of a {tokens}-token step"
        peak = torch.cuda.max_memory_allocated()
        free, total = torch.cuda.mem_get_info()
        used_by_others = total - free - torch.cuda.memory_reserved()
        util = self.config.cache.gpu_memory_utilization
        from lightwell.kernels.kv_dequant import reserve_bytes  # (a CUDA path: Triton)

        p = self.config.parallel
        # the K/V dequantizing copies (latent caches make none: their prefill's gathered
        # entries stay inside attention/mla_prefill.py's pass budget)
        from lightwell.layers.mla import LatentAttention

        kv_layers = any(not isinstance(a, LatentAttention) for a in self.runner.attn_layers)
        peak += reserve_bytes(
            self.runner.kv_dtype if kv_layers else self.runner.dtype,
            p.dual_stream_micro_batches if p.dual_stream else 1,
        )
        if p.stages_share_gpu:  # each stage its share; the rest is theirs
            return total * util / self.world_size - peak
        return total * util - peak - max(used_by_others, 0)

    def init_kv_cache(self, num_blocks: int, resolved: EngineConfig) -> None:
        self.init_all_reduce(resolved)
        # Async scheduling ("auto" resolved by now): every rank feeds rank 0's tokens.
        self.runner.share_sampled_tokens = self.tp_size > 1 and bool(
            resolved.scheduler.async_scheduling
        )
        with progress.stage("Allocating the KV cache") as st:
            self.runner.init_kv_cache(num_blocks)
            gib = num_blocks * self.runner.kv_bytes_per_block() / 2**30
            st.summary = f"allocated the KV cache ({num_blocks} blocks, {gib:.2f} GiB)"
        if (
            self.device.type == "cpu"
            and self.config.device.fused_cpu_decode
            and self.world_size == 1
        ):
            from lightwell.worker.cpu_decode import CpuDecode

            self.runner.cpu_decode = CpuDecode.build(self.runner.model, self.runner.dtype)
        from lightwell.worker.runner_startup import warmup

        on_gpu = self.device.type == "cuda"
        with progress.stage(f"Warming up{' (compiling Triton kernels)' if on_gpu else ''}") as st:
            warmup(self.runner)
            st.summary = f"warmed up{' (Triton kernels compiled)' if on_gpu else ''}"
        self._capture_cuda_graphs(resolved)
        if self.compile_watch is not None:
            self.compile_watch.arm()  # start-up is over: later compiles stall serving

    def _capture_cuda_graphs(self, resolved: EngineConfig) -> None:
        if self.device.type == "cuda" and not self.config.device.enforce_eager:
            blockers = _graph_blockers(self.runner)
            if not blockers:
                s = resolved.scheduler
                decode_only = any(
                    getattr(a, "cuda_graph_mode", None) == "decode" for a in self.runner.attn_layers
                )
                if decode_only:
                    logger.info("latent attention: CUDA graphs for decode-only steps only")
                self.runner.capture_cuda_graphs(
                    s.max_num_seqs,
                    resolved.model.max_model_len,
                    0 if decode_only else resolved.device.cuda_graph_prefill_tokens,
                )
            else:
                logger.warning("%s cannot be captured: every step runs eagerly", blockers)

    @property
    def returns_output(self) -> bool:
        """This rank's step output is the engine's, sent back over its pipe: the last
        pipeline stage's tensor rank 0 (rank 0 itself without pipeline stages)."""
        return self.pp_size > 1 and self.rank == (self.pp_size - 1) * self.tp_size

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(sched)

    def launch(self, sched: SchedulerOutput) -> PendingStep:
        """Queue the step on the device; the handle's ``result()`` waits for its tokens."""
        return self.runner.launch(sched)

    def abort_collectives(self) -> None:
        """Make this rank's pending collectives fail now (a peer process died), so the engine
        raises instead of waiting in them: best effort, from the executor's monitor thread."""
        from lightwell.distributed.launch import abort_distributed

        abort_distributed()

    def shutdown(self) -> None:
        if self.device.type == "cuda":
            # A step the async loop launched ahead may still be running (the engine drops it
            # unread): let it finish before its model, KV cache and buffers are freed, or the
            # executor's empty_cache() unmaps memory under it (an illegal address, reported by
            # whatever next touches the device). A device already in error (the reason some
            # engines shut down) reports it here: logged, and the shutdown goes on.
            try:
                torch.cuda.synchronize(self.device)
            except RuntimeError as e:
                logger.warning("shutdown: the device reported an error: %s", e)
        self.runner = None
        if self.compile_watch is not None:
            self.compile_watch.uninstall()
        if self.world_size > 1:
            from lightwell.distributed.launch import shutdown_distributed

            shutdown_distributed()


def _routed_experts(hf: Any) -> int:
    """A MoE layer's routed experts from the HF config, 0 for a dense model."""
    from lightwell.models.moe_blocks import num_experts_of

    try:
        return num_experts_of(hf)
    except ValueError:  # no experts field: a dense model
        return 0
