"""CUDA graphs, captured at start-up: one per padded decode batch size, and one per padded token
count for small steps that carry prefill tokens (``--cuda-graph-prefill-tokens``).

Decode graphs: a decode-only batch of R requests replays the graph of the smallest captured
size B >= R. Rows R..B-1 are padding: token 0 at position 0, slot -1 (nothing stored), seq_len 1
reading block 0 (finite garbage, discarded). The Triton attention wrapper picks its grid and
split-KV count from host-side metadata at capture (max_seq_len = the context length), and each
split's range is computed inside the kernel, so a replay is correct for any seq_lens up to that
length.

Mixed graphs: a step of T tokens from R requests with some query longer than one token (a
prefill chunk, alone or beside decodes) replays the graph captured for the smallest token count
P >= T, with room for Q = min(P, max_batch) + 1 requests. The attention kernel maps its programs
to (request, query tile) on the device, so its grid only depends on (P, Q): P // BLOCK_Q + Q
tiles, the surplus ones exiting at once. Padding: tokens T..P-1 form one extra request (token 0,
position 0, slot -1, attending only to itself through block 0), requests after it are empty.
Eager mixed steps cost ~300 kernel launches of host time each (16 ms for llama-3-8b), several
times the GPU time of a short prompt; a replay costs one launch.

Pipeline stages (lightwell/worker/pipeline_stage.py) capture the same sizes: a stage after the
first also copies the received ``(hidden, residual)`` into a static ``[2, T, H]`` buffer
(padding rows zero), and a stage before the last gets its ``(hidden, residual)`` back from
the graph's output buffers; the sends and receives stay outside the graphs. Every rank of a
stage picks a step's graph from the same SchedulerOutput with the same sizes, so they replay
graphs of one size (and their collectives match).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from lightwell import progress
from lightwell.attention.metadata import AttentionMetadata


def capture_sizes(max_batch: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch]
    sizes += list(range(16, max_batch, 16))
    return sorted(set(sizes + [max_batch]))


# Mixed-step graphs above this many tokens come every MIXED_STEP tokens (below: powers of two),
# so that a step pads by less than MIXED_STEP tokens: in serving, steps of a prompt chunk plus
# the running decodes (1,024 + a few dozen tokens) padded to the next power of two would do
# twice the work.
MIXED_POW2_MAX = 512
MIXED_STEP = 256
# A mixed step whose decode rows would get split-KV attention eagerly (few rows, long
# contexts) still replays its graph when it carries at least this many prefill tokens: then the
# prefill's GEMMs set the step's time, not the decode rows' unsplit attention, and an eager
# step under --dual-stream is bound by its launches (under serving load most mixed steps have
# such rows).
SPLIT_KV_EAGER_MAX_PREFILL = 256


def mixed_capture_sizes(max_tokens: int) -> list[int]:
    """Token counts for mixed-step graphs: powers of two from 16 to MIXED_POW2_MAX, then every
    multiple of MIXED_STEP, then ``max_tokens``."""
    if max_tokens <= 0:
        return []
    sizes = [s for s in (16 << i for i in range(20)) if s <= MIXED_POW2_MAX]
    sizes += range(MIXED_POW2_MAX + MIXED_STEP, max_tokens, MIXED_STEP)
    return [s for s in sizes if s < max_tokens] + [max_tokens]


def capture_all(
    keys: list[tuple[str, int]], capture_one: Callable[[tuple[str, int]], None]
) -> float:
    """``capture_one(key)`` for every graph key, as the start-up stage "Capturing CUDA graphs"
    (a bar over the graphs, then one INFO line with the sizes and seconds); returns the
    seconds taken."""
    decode = sorted(n for kind, n in keys if kind == "decode")
    mixed = [n for kind, n in keys if kind == "mixed"]
    with progress.stage("Capturing CUDA graphs", len(keys), "graph") as st:
        for key in st.iter(keys):
            capture_one(key)
        st.summary = (
            f"captured {len(keys)} CUDA graphs (decode batch sizes {decode}; steps with "
            f"prefill up to {max(mixed, default=0)} tokens)"
        )
    return st.seconds


class DecodeInputs(NamedTuple):
    """A decode step's device inputs (one token a request), or a decode graph's static ones."""

    input_ids: torch.Tensor  # [R] int64
    positions: torch.Tensor  # [R] int64
    slot_mapping: torch.Tensor  # [R] int64
    seq_lens: torch.Tensor  # [R] int32
    block_table: torch.Tensor  # [R, w] int32


def take_sampled(
    input_ids: torch.Tensor,  # [T] int64, in place
    token_src: torch.Tensor,  # [T] int64: a token's row in ``sampled``, -1 where known
    sampled: torch.Tensor,  # [S] int64
) -> None:
    """The input tokens still being sampled, from the previous step's ``sampled`` (async
    scheduling; torch ops: the steps outside decode graphs)."""
    pending = token_src >= 0
    input_ids.copy_(torch.where(pending, sampled[token_src.clamp(min=0)], input_ids))


def fill_decode_torch(
    graph: DecodeInputs,  # the graph's B rows
    step: DecodeInputs,  # R <= B rows
    deferred: tuple[torch.Tensor, torch.Tensor] | None = None,  # ([R] rows or -1, [S] tokens)
) -> None:
    """Rows 0..R-1 of a decode graph's inputs from the step's (the tokens still being sampled
    from the previous step's), rows R..B-1 padding: token 0 at position 0, slot -1 (nothing
    stored), one token of context through block 0. Table columns past the step's are left as
    they are (no row reads past its context). kernels/step_inputs.py does the same in one
    launch on CUDA."""
    size, reqs = graph.input_ids.shape[0], step.input_ids.shape[0]
    width = step.block_table.shape[1]
    for dst, value, pad in zip(graph[:4], step[:4], (0, 0, -1, 1)):
        dst[:reqs].copy_(value)
        dst[reqs:size].fill_(pad)
    if deferred is not None:
        take_sampled(graph.input_ids[:reqs], *deferred)
    graph.block_table[:reqs, :width].copy_(step.block_table)
    graph.block_table[reqs:size, :width].zero_()


class CudaGraphRunner:
    def __init__(
        self,
        max_batch: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
        forward_fn: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]],
        prefill_tokens: int = 0,
        num_kv_heads: int = 0,
        stage_input: tuple[int, torch.dtype] | None = None,
    ) -> None:
        """``forward_fn(input_ids, positions, meta) -> hidden``: what to capture (the runner's
        forward, which may split the batch for the dual-stream overlap). ``prefill_tokens``:
        the largest step with prefill tokens that gets a graph (0: decode graphs only).
        ``stage_input`` ``(hidden_size, dtype)``: a pipeline stage after the first, whose
        graphs read the previous stage's activations, ``forward_fn(input_ids, positions, meta,
        (hidden, residual))``; the output may be a tuple (a stage before the last)."""
        self.forward_fn = forward_fn
        self.replays = 0  # steps run through ``run`` (replayed, or eager without graphs)
        self.num_kv_heads = num_kv_heads  # per rank: sizes the attention grid of decode rows
        self.sizes = capture_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        self.mixed_sizes = mixed_capture_sizes(prefill_tokens)
        self.max_model_len = max_model_len
        self.device = device
        i32, i64 = torch.int32, torch.int64
        t = max(self.max_batch, self.mixed_sizes[-1] if self.mixed_sizes else 0)
        # Block-table rows: a request's context, or the padding request's P - T tokens (P may
        # exceed the context length: it reads that many keys through its all-zero row).
        width = -(-max(max_model_len, t) // block_size)
        r = max(self.max_batch, self._mixed_reqs(t))
        self.input_ids = torch.zeros(t, dtype=i64, device=device)  # [T]
        self.positions = torch.zeros(t, dtype=i64, device=device)  # [T]
        self.slot_mapping = torch.full((t,), -1, dtype=i64, device=device)  # [T]
        self.seq_lens = torch.ones(r, dtype=i32, device=device)  # [R]
        self.block_table = torch.zeros(r, width, dtype=i32, device=device)  # [R, W]
        self.query_start_loc = torch.arange(r + 1, dtype=i32, device=device)  # [R+1]
        # Decode graphs read query_start_loc[:B+1] = 0..B; mixed ones their own copy.
        self.mixed_qsl = torch.zeros(r + 1, dtype=i32, device=device)  # [R+1]
        self.stage_input: torch.Tensor | None = None  # [2, T, H]: received (hidden, residual)
        if stage_input is not None:
            hidden_size, dtype = stage_input
            self.stage_input = torch.zeros(2, t, hidden_size, dtype=dtype, device=device)
        # key: ("decode", B) or ("mixed", P)
        self.graphs: dict[tuple[str, int], torch.cuda.CUDAGraph] = {}
        # a graph's output buffers: [P, H], or ([P, H], [P, H]) on a stage before the last
        self.outputs: dict[tuple[str, int], torch.Tensor | tuple[torch.Tensor, ...]] = {}
        self.metas: dict[tuple[str, int], AttentionMetadata] = {}

    def _mixed_reqs(self, tokens: int) -> int:
        return min(tokens, self.max_batch) + 1  # + 1: the padding tokens' own request

    def _decode_meta(self, size: int) -> AttentionMetadata:
        self.seq_lens.fill_(1)  # (a mixed graph's capture layout may be there)
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_table=self.block_table[:size],
            slot_mapping=self.slot_mapping[:size],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            query_start_loc_cpu=list(range(size + 1)),
            seq_lens_cpu=[self.max_model_len] * size,
            num_decodes=size,
        )

    def _mixed_meta(self, tokens: int) -> AttentionMetadata:
        """Capture-time metadata of the ``tokens`` graph: only its shapes and host values (grid,
        tile shape) are baked in; the device tensors are rewritten before each replay."""
        reqs = self._mixed_reqs(tokens)
        # Host layout at capture: one long request then single tokens (any layout with these
        # totals gives the same launches). Device tensors hold the same until the first replay.
        first = tokens - (reqs - 2)
        qsl = [0, first] + [first + i for i in range(1, reqs - 1)] + [tokens]
        self.mixed_qsl[: reqs + 1].copy_(torch.tensor(qsl, dtype=torch.int32))
        self.seq_lens[:reqs].fill_(1)
        self.seq_lens[0] = first
        self.seq_lens[reqs - 1] = 0
        return AttentionMetadata(
            query_start_loc=self.mixed_qsl[: reqs + 1],
            seq_lens=self.seq_lens[:reqs],
            block_table=self.block_table[:reqs],
            slot_mapping=self.slot_mapping[:tokens],
            max_query_len=tokens,  # > 1: the prefill-shaped launch, tiles of BLOCK_Q queries
            max_seq_len=self.max_model_len,
            query_start_loc_cpu=qsl,
            seq_lens_cpu=[first] + [1] * (reqs - 2) + [0],
            num_decodes=0,  # one launch over every request (no separate decode launch)
            static_layout=True,
        )

    def _args(self, key: tuple[str, int]) -> tuple:
        n = key[1]  # tokens of the graph (a decode graph: one per request)
        args = (self.input_ids[:n], self.positions[:n], self.metas[key])
        if self.stage_input is None:
            return args
        return (*args, (self.stage_input[0, :n], self.stage_input[1, :n]))

    def _meta(self, key: tuple[str, int]) -> AttentionMetadata:
        return self._mixed_meta(key[1]) if key[0] == "mixed" else self._decode_meta(key[1])

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every graph (largest first, one memory pool); returns the seconds taken."""
        self._compile_decode_fill()
        pool = torch.cuda.graph_pool_handle()
        return capture_all(self._keys(largest_first=True), lambda key: self._capture(key, pool))

    def _capture(self, key: tuple[str, int], pool: tuple) -> None:
        self.metas[key] = self._meta(key)
        args = self._args(key)
        for _ in range(2):  # warm-up: Triton compiles, cuBLAS picks its kernels
            self.forward_fn(*args)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = self.forward_fn(*args)
        torch.cuda.synchronize()
        self.graphs[key] = graph
        self.outputs[key] = out

    def prepare_without_graphs(self) -> None:
        """Build the capture-time metadata without capturing (CPU tests): ``run`` then calls
        ``forward_fn`` on the padded static inputs, exactly what a replay computes."""
        for key in self._keys():
            self.metas[key] = self._meta(key)

    def _keys(self, largest_first: bool = False) -> list[tuple[str, int]]:
        """Every graph's key: the mixed token counts, then the decode batch sizes."""
        order = reversed if largest_first else list
        return [("mixed", p) for p in order(self.mixed_sizes)] + [
            ("decode", b) for b in order(self.sizes)
        ]

    def can_run(self, meta: AttentionMetadata) -> bool:
        return self.graph_for(meta) is not None

    def graph_for(self, meta: AttentionMetadata) -> tuple[str, int] | None:
        """The graph that serves this step (its key), or None: the step runs eagerly."""
        t = meta.num_tokens
        if meta.max_query_len == 1 and t == meta.num_reqs:
            return (
                ("decode", next(s for s in self.sizes if s >= t)) if t <= self.max_batch else None
            )
        if not self.mixed_sizes or t > self.mixed_sizes[-1]:
            return None
        size = next(s for s in self.mixed_sizes if s >= t)
        if meta.num_reqs >= self._mixed_reqs(size):
            return None  # (never, with <= max_batch requests)
        prefill = t - meta.num_decodes
        if prefill < SPLIT_KV_EAGER_MAX_PREFILL and self._decodes_want_split_kv(meta):
            return None
        return ("mixed", size)

    def _decodes_want_split_kv(self, meta: AttentionMetadata) -> bool:
        """A mixed graph runs decode rows in the prefill-shaped launch, one program per
        (request, KV head) over the whole context. The eager path gives leading decode rows a
        launch of their own (``paged_attention``), split-KV when ``auto_num_splits`` asks for it
        (few rows, long contexts): such steps run eagerly, unless they also carry at least
        SPLIT_KV_EAGER_MAX_PREFILL prefill tokens."""
        nd = meta.num_decodes
        if not nd or not self.num_kv_heads or meta.query_start_loc_cpu[nd] != nd:
            return False
        from lightwell.kernels.split_kv import auto_num_splits

        return auto_num_splits(nd * self.num_kv_heads, meta.max_seq_len, self.device) > 1

    def run(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        key: tuple[str, int] | None = None,  # graph_for(meta), when the caller has it
        stage_input: torch.Tensor | None = None,  # [2, T, H]: the previous stage's, if any
        # input tokens the previous step is still sampling: ([T] their rows in its sampled
        # tokens, -1 where known; [S] those tokens), taken on the device
        deferred: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:  # [T, H]; ([T, H], [T, H]) mid-pipeline
        t = meta.num_tokens
        key = key or self.graph_for(meta)
        n = key[1]
        if key[0] == "decode":
            self._fill_decode(input_ids, positions, meta, n, deferred)
        else:
            self._fill_mixed(meta, n)
            self.input_ids[:t].copy_(input_ids)
            self.positions[:t].copy_(positions)
            self.slot_mapping[:t].copy_(meta.slot_mapping)
            if n > t:
                self.input_ids[t:n].zero_()
                self.positions[t:n].zero_()
                self.slot_mapping[t:n].fill_(-1)
            if deferred is not None:
                take_sampled(self.input_ids[:t], *deferred)
        if self.stage_input is not None:
            self._fill_stage_input(stage_input, t, n)
        self.replays += 1
        if key in self.graphs:
            self.graphs[key].replay()
        else:  # prepare_without_graphs(): the same computation, run eagerly
            self.outputs[key] = self.forward_fn(*self._args(key))
        out = self.outputs[key]
        return out[:t] if isinstance(out, torch.Tensor) else tuple(o[:t] for o in out)

    def _fill_stage_input(self, received: torch.Tensor | None, t: int, n: int) -> None:
        """The previous stage's ``[2, T, H]`` activations into the static buffer; padding rows
        zero (finite through the norms; their outputs are discarded)."""
        if received is None:
            raise RuntimeError("a later pipeline stage's graph needs the received activations")
        self.stage_input[:, :t].copy_(received)
        if n > t:
            self.stage_input[:, t:n].zero_()

    def _fill_decode(
        self,
        input_ids: torch.Tensor,  # [R]
        positions: torch.Tensor,  # [R]
        meta: AttentionMetadata,
        size: int,
        deferred: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> None:
        """The graph's first ``size`` rows: the step's R, then padding (kernels/step_inputs.py:
        one launch on CUDA)."""
        graph = self._decode_buffers(size)
        step = DecodeInputs(input_ids, positions, meta.slot_mapping, meta.seq_lens,
                            meta.block_table)  # fmt: skip
        if self.device.type == "cuda":
            from lightwell.kernels.step_inputs import fill_decode_inputs

            fill_decode_inputs(graph, step, deferred)
        else:
            fill_decode_torch(graph, step, deferred)

    def _decode_buffers(self, size: int) -> DecodeInputs:
        """The static inputs of the decode graph of ``size`` rows."""
        return DecodeInputs(
            self.input_ids[:size],
            self.positions[:size],
            self.slot_mapping[:size],
            self.seq_lens[:size],
            self.block_table[:size],
        )

    def _compile_decode_fill(self) -> None:
        """Compile kernels/step_inputs.py's fill in both of its forms (with tokens still being
        sampled, and without) at start-up: a one-row step copied onto the buffers' own first
        row (every replay rewrites them)."""
        from lightwell.kernels.step_inputs import fill_decode_inputs

        graph = self._decode_buffers(1)
        step = graph._replace(block_table=graph.block_table[:, :1])
        known = torch.full((1,), -1, dtype=torch.int64, device=self.device)
        for deferred in (None, (known, graph.input_ids)):
            fill_decode_inputs(graph, step, deferred)

    def _fill_mixed(self, meta: AttentionMetadata, tokens: int) -> None:
        r, t, reqs = meta.num_reqs, meta.num_tokens, self._mixed_reqs(tokens)
        self.mixed_qsl[: r + 1].copy_(meta.query_start_loc)
        self.mixed_qsl[r + 1 : reqs + 1].fill_(tokens)  # request r: the padding tokens t..P-1
        self.seq_lens[:r].copy_(meta.seq_lens)
        self.seq_lens[r] = tokens - t
        self.seq_lens[r + 1 : reqs].zero_()
        self.block_table[:r, : meta.block_table.shape[1]].copy_(meta.block_table)
        self.block_table[r:reqs].zero_()
