"""All-reduce strategies over 2 CPU processes (gloo): each one available on CPU against the exact
sum of random tensors; int8's error within its bound; the selector's picks; and the two-micro-
batch forward of a TP=2 model (row-parallel partial sums + all-reduce, biases on rank 0) equal
to the plain forward."""

from __future__ import annotations

import contextlib
import dataclasses
from unittest import mock

import pytest
import torch

from tests.models.test_tensor_parallel import _free_port

WORLD = 2
# odd sizes: padding, uneven chunks; (40, 1000): above torch's intra-op grain (32,768 elements)
SHAPES = [(1, 576), (7, 576), (33, 1000), (5,), (40, 1000)]
EXACT = (
    "nccl", "gloo", "host", "hostmem", "hostmem-ll", "peermem", "hostmem-copy",
    "hostmem-copy-chunked",
)  # fmt: skip


def _inputs(shape: tuple[int, ...], dtype: torch.dtype, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + sum(shape))
    return torch.randn(shape, generator=g).to(dtype)


def _create(name: str, ctx, **options):
    """A product strategy by name, or an experimental one (peermem, int8, host)."""
    from lightwell.distributed.comm import create_strategy
    from lightwell.experimental.comm import EXPERIMENTAL, create_experimental

    make = create_experimental if name in EXPERIMENTAL else create_strategy
    return make(name, ctx, **options)


def _exact(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:  # fp32 sum of all ranks
    return sum(_inputs(shape, dtype, r).float() for r in range(WORLD))


def int8_bound(
    shape: tuple[int, ...], exact: torch.Tensor, requantized: bool = True
) -> torch.Tensor:
    """Per element: half a quantization step of every rank's input group, plus (``requantized``:
    the NCCL int8 path) half a step of the reduced group (whose absmax is at most the exact one
    plus the first error). hostmem-int8 quantizes each input once and sums the dequantized
    values, so only the first term applies."""
    from lightwell.experimental.comm.int8_nccl import GROUP

    def group_amax(x: torch.Tensor) -> torch.Tensor:  # [N] -> [N]: absmax of x's group
        n = x.numel()
        padded = torch.nn.functional.pad(x.reshape(-1).abs(), (0, -n % GROUP))
        return padded.view(-1, GROUP).amax(-1).repeat_interleave(GROUP)[:n]

    first = sum(group_amax(_inputs(shape, torch.float32, r)) for r in range(WORLD)) / 254
    second = (group_amax(exact) + first) / 254 if requantized else 0.0
    return ((first + second) * 1.001 + 1e-6).view(shape)


def _check_strategies(rank: int, ctx) -> None:
    from lightwell.distributed.comm import is_available
    from lightwell.experimental.comm.int8_nccl import Int8AllReduce

    assert not is_available("oneshot", ctx)  # peer memory is CUDA-only: skipped on CPU

    threads = torch.get_num_threads()
    # hostmem(-int8): the Triton kernel through shared memory, interpreted, 2 processes
    for name in (
        *EXACT, "int8", "int8-fused", "hostmem-int8", "hostmem-int8-ll", "hostmem-copy-int8",
        "hostmem-copy-int8-chunked",
    ):  # fmt: skip
        # int8-fused: the Triton kernels (interpreted here) between the same collectives
        strategy = Int8AllReduce(ctx, fused=True) if name == "int8-fused" else None
        if name == "hostmem-int8":  # 3 persistent programs share the blocks (40 at most here)
            strategy = _create(name, ctx, max_programs=3, block=1024)
        elif name == "hostmem-ll":  # the low-latency protocol: the epoch in every word
            strategy = _create("hostmem", ctx, protocol="ll")
        elif name == "peermem":  # the same kernel, each rank's words in the other's buffer
            strategy = _create(name, ctx, max_bytes=1 << 20)
            # a peer that never writes: a failure in seconds, not an hour of polls
            strategy.bufs = dataclasses.replace(strategy.bufs, max_spin=1 << 15)
        elif name == "hostmem-int8-ll":
            strategy = _create("hostmem-int8", ctx, max_programs=3, protocol="ll")
        elif name.endswith("-chunked"):  # 8 pieces of >= 256 bytes: (40, 1000) has 8,
            # taking turns on 3 lanes (streams on a GPU)
            strategy = _create(name.removesuffix("-chunked"), ctx, chunks=8, lanes=3)
        strategy = strategy or _create(name, ctx)
        # host: runs single-threaded whatever torch's pool is, and leaves the pool as it was
        torch.set_num_threads(2 if name == "host" else threads)
        with _min_chunk_bytes(256 if name.endswith("-chunked") else None):
            _check_sums(name, strategy, rank, ctx, threads)
        if hasattr(strategy, "timed_out"):
            assert not strategy.timed_out(), name
        strategy.close()
    torch.set_num_threads(threads)
    _check_fused_norm(rank, ctx)
    _check_peermem_pushes(rank, ctx)
    _check_hostmem_gives_up(rank, ctx)
    _check_copy_slot_reuse(rank, ctx)


def _min_chunk_bytes(value: int | None):
    """hostmem_copy.MIN_CHUNK_BYTES set to ``value`` for a while (None: left as it is)."""
    from lightwell.distributed.comm import hostmem_copy

    if value is None:
        return contextlib.nullcontext()
    return mock.patch.object(hostmem_copy, "MIN_CHUNK_BYTES", value)


def _check_sums(name: str, strategy, rank: int, ctx, threads: int) -> None:
    for shape in SHAPES:
        for dtype in (torch.float32, torch.bfloat16):
            exact = _exact(shape, dtype)
            got = strategy.all_reduce(_inputs(shape, dtype, rank))
            assert torch.get_num_threads() == (2 if name == "host" else threads)
            seen = [torch.empty(shape) for _ in range(WORLD)]
            torch.distributed.all_gather(seen, got.float(), group=ctx.group)
            assert all(torch.equal(seen[0], t) for t in seen), (name, shape)  # every rank
            assert got.shape == shape and got.dtype == dtype, (name, shape)
            if name in EXACT and dtype == torch.float32:
                assert torch.equal(got, exact), (name, shape)
            elif name in (
                "hostmem",
                "hostmem-ll",
                "peermem",
            ):  # the interpreter rounds fp32 -> bf16 its own way
                ulp = exact.abs() * 2.0**-7 + 1e-30
                assert ((got.float() - exact).abs() <= ulp).all(), (name, shape)
            elif name in EXACT:
                assert torch.equal(got, exact.to(dtype)), (name, shape)
            elif dtype == torch.float32:
                err = (got - exact).abs()
                bound = int8_bound(shape, exact, requantized=name in ("int8", "int8-fused"))
                assert (err <= bound).all(), (name, shape, err.max())
                assert err.norm() / exact.norm() < 0.015, shape
            else:
                assert (got.float() - exact).norm() / exact.norm() < 0.02, shape


def _check_copy_slot_reuse(rank: int, ctx) -> None:
    """hostmem-copy: two calls in a row on the same slot (a CUDA-graph replay does not advance
    the host's parity counter), cut into chunks differently (4 KB, then 16 KB), while rank 1 is
    slow to copy out the first message's later chunks: rank 0 must not overwrite them."""
    import time

    from lightwell.distributed.comm import create_strategy

    with _min_chunk_bytes(256):
        strategy = create_strategy("hostmem-copy", ctx, chunks=4)
        if rank == 1:
            h2d = strategy.ops.h2d

            def slow_h2d(dst, a, b, src, stream):
                if b - a == 4096 and a > 0 and strategy.calls == 1:
                    time.sleep(0.3)  # the first message's chunks 1-3 copied out late
                h2d(dst, a, b, src, stream)

            strategy.ops.h2d = slow_h2d
        small = [_inputs((4096,), torch.float32, r) for r in range(WORLD)]  # 4 chunks of 4 KB
        large = [_inputs((16384,), torch.float32, r) for r in range(WORLD)]  # 4 of 16 KB
        got = strategy.all_reduce(small[rank].clone())
        strategy.calls += 1  # the next call takes the same slot
        got_large = strategy.all_reduce(large[rank].clone())
        assert torch.equal(got, small[0] + small[1])
        assert torch.equal(got_large, large[0] + large[1])
        strategy.close()


def _check_fused_norm(rank: int, ctx) -> None:
    """hostmem's all-reduce fused with the residual add + RMSNorm after it, both protocols and
    int8: the same values as the all-reduce followed by the fused_add_rmsnorm kernel (the new
    residual bit for bit), interleaved with plain calls on the same buffers (the epochs stay in
    step); None where the hidden size does not divide the block or the dtypes differ."""
    from lightwell.distributed.comm import hostmem
    from lightwell.kernels.rmsnorm import fused_add_rmsnorm

    for name, options in (
        ("hostmem", {"block": 512}),
        ("hostmem", {"block": 512, "protocol": "ll"}),
        ("peermem", {"block": 512}),
        ("hostmem-int8", {"block": 1024, "max_programs": 2, "fuse_norm": "1"}),
    ):
        strategy = _create(name, ctx, max_bytes=1 << 16, **options)
        for shape in ((5, 128), (3, 512), (9, 256)):  # 4, 1 and 2 rows a block (int8: 8, 2, 4)
            for dtype in (torch.float32, torch.float16):
                x = _inputs(shape, dtype, rank)
                residual = _inputs(shape, dtype, 7)  # the same on both ranks
                weight = (1 + 0.1 * _inputs(shape[1:], torch.float32, 9)).to(dtype)
                want_sum = strategy.all_reduce(x.clone())
                want = fused_add_rmsnorm(want_sum, residual, weight, 1e-5)
                got = strategy.all_reduce_add_rmsnorm(x, residual, weight, 1e-5)
                assert got is not None, (name, options, shape)
                assert torch.equal(got[1], want[1]), (name, shape, dtype)  # sum + residual
                tol = 1e-5 if dtype == torch.float32 else 1e-3
                torch.testing.assert_close(got[0], want[0], rtol=tol, atol=tol)
                seen = [torch.empty(shape) for _ in range(WORLD)]
                torch.distributed.all_gather(seen, got[0].float(), group=ctx.group)
                assert torch.equal(seen[0], seen[1]), (name, shape)  # every rank alike
        x = torch.ones(2, 96)  # 96 does not divide the block: not fusable, nothing launched
        assert strategy.all_reduce_add_rmsnorm(x, x, torch.ones(96), 1e-5) is None
        x = torch.ones(2, 128)
        assert strategy.all_reduce_add_rmsnorm(x, x, torch.ones(128).half(), 1e-5) is None
        assert torch.equal(strategy.all_reduce(x), 2 * x)  # still in step after the refusals
        strategy.close()
    # the default rule (auto): messages up to FUSE_NORM_MAX_BYTES; 0: never; 1: always
    x, w = torch.ones(4, 128), torch.ones(128)
    for name, fuse, small, big in (
        ("hostmem", "auto", True, False),
        ("hostmem-int8", "auto", True, False),
        ("hostmem", "0", False, False),
        ("hostmem-int8", "1", True, True),
    ):
        strategy = _create(name, ctx, max_bytes=1 << 16, block=512, fuse_norm=fuse)
        if fuse == "auto":  # auto is the measured limit; lowered to 4 KB: x fits, y does not
            assert strategy.fuse_norm_max_bytes == hostmem.FUSE_NORM_MAX_BYTES
            strategy.fuse_norm_max_bytes = 4 << 10
        assert (strategy.all_reduce_add_rmsnorm(x, x, w, 1e-5) is not None) == small, name
        y = torch.ones(16, 128)  # 8 KB: above the (lowered) limit
        assert (strategy.all_reduce_add_rmsnorm(y, y, w, 1e-5) is not None) == big, name
        strategy.close()


def _check_greedy_tokens(rank: int, device: str = "cpu") -> None:
    """The vocab-sharded argmax (no logits gathered) equals the argmax of the gathered logits,
    on both ranks: a vocabulary of 150 padded to 256 (rank 1 holds 22 real rows + padding
    whose zero logits would win when every real one is negative), ties across and within
    shards (the first wins), a bias, NaN logits, and a vocabulary that leaves rank 1's shard
    all padding."""
    from lightwell.layers.embedding import ParallelLMHead

    def head(table: torch.Tensor, bias: torch.Tensor) -> ParallelLMHead:
        h = ParallelLMHead(table.shape[0], table.shape[1], bias=True)
        h.weight_loader(h.weight, table)
        h.weight_loader(h.bias, bias)
        return h.to(device)

    def check(h: ParallelLMHead, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden.to(device)
        want = h.compute_logits(hidden).argmax(-1)
        assert torch.equal(h.greedy_tokens(hidden), want), (rank, want)
        return want.cpu()

    g = torch.Generator().manual_seed(5)
    table, bias = torch.randn(150, 16, generator=g), -5 - torch.rand(150, generator=g)
    table[[40, 140, 141]] = table[7].clone()  # ties: 7 (rank 0) with 40, 140 and 141
    bias[[40, 140, 141]] = bias[7].clone()
    hidden = torch.randn(6, 16, generator=g)
    hidden[2] = 50 * table[7]  # token 7 ties with 40, 140 and 141: the first, 7, wins
    hidden[3] = 0  # every logit the (negative) bias: the padding's zero logits must not win
    hidden[4] = 50 * table[145]  # a row of rank 1's shard
    want = check(head(table, bias), hidden)
    assert want[2] == 7 and want[4] == 145 and want[3] == bias.argmax()
    nan = bias.clone()
    nan[[20, 145]] = float("nan")  # one NaN logit in each shard: argmax's pick, the first
    assert (check(head(table, nan), hidden) == 20).all()
    small = ParallelLMHead(40, 16)  # padded to 128: rank 1's 64 rows are all padding
    assert small.vocab_start_index >= 40 or rank == 0
    small.weight_loader(small.weight, table[:40])
    small, hidden = small.to(device), hidden.to(device)
    want = small.compute_logits(hidden).argmax(-1)
    assert torch.equal(small.greedy_tokens(hidden), want) and (want < 40).all()


def _check_peermem_pushes(rank: int, ctx) -> None:
    """peermem writes its words into the peer's buffer and reads the peer's from its own: after
    one call (epoch 1, parity buffer 1) this rank's slot holds epoch-1 words in the peer's
    buffer and nothing in its own, where the peer's slot holds the peer's words."""
    strategy = _create("peermem", ctx, max_bytes=1 << 16)
    x = torch.ones(4, 576)  # 2,304 fp32 words
    assert torch.equal(strategy.all_reduce(x), 2 * x) and not strategy.timed_out()
    own = strategy.bufs.view(torch.int64).view(2, WORLD, -1)[1, :, :2304]
    theirs = strategy.bufs.view(torch.int64, dst=True).view(2, WORLD, -1)[1, :, :2304]
    assert strategy.bufs.dst.data_ptr() != strategy.bufs.data.data_ptr()
    assert ((theirs[rank] >> 32) == 1).all() and not own[rank].any()
    assert ((own[1 - rank] >> 32) == 1).all()
    torch.distributed.barrier(group=ctx.group)  # (the peer is done reading before the close)
    strategy.close()


def _check_hostmem_gives_up(rank: int, ctx) -> None:
    """A peer that never arrives: the kernel stops polling, flags it, returns (no hang)."""
    from lightwell.distributed.comm import create_strategy

    strategy = create_strategy("hostmem", ctx, max_bytes=1 << 16)
    strategy.bufs = dataclasses.replace(strategy.bufs, max_spin=50)
    if rank == 0:
        strategy.all_reduce(torch.ones(8))
        assert strategy.timed_out()
    torch.distributed.barrier(group=ctx.group)
    assert strategy.timed_out() == (rank == 0)
    strategy.close()


def _check_selector(rank: int, ctx) -> None:
    from lightwell.distributed.comm.selector import AllReduceSelector

    x = torch.ones(4, 576)
    for choice, picked in (
        ("auto", "nccl"),
        ("hostmem", "hostmem"),
        ("hostmem-int8", "hostmem-int8"),
        ("oneshot", "nccl"),  # (not available on CPU: skipped)
        ("gloo", "gloo"),
    ):
        sel = AllReduceSelector(ctx, choice, max_bytes=1 << 16)
        assert sel.pick(x).name == picked, (choice, sel.describe())
        assert torch.equal(sel.all_reduce(x.clone()), 2 * x), choice
        sel.close()
    small = AllReduceSelector(ctx, "hostmem-int8", max_bytes=1 << 10)
    assert small.pick(x).name == "nccl"  # larger than its buffer: the fallback
    small.close()
    lanes = AllReduceSelector(ctx, "hostmem", max_bytes=1 << 20)  # 64 KB: the ll lane's limit
    big = torch.ones(40, 1000)  # 160 KB
    assert [lanes.pick(t).protocol for t in (x, big)] == ["ll", "flag"]
    assert torch.equal(lanes.all_reduce(big.clone()), 2 * big)
    lanes.close()
    from lightwell.distributed.comm import hostmem

    large_min = hostmem.INT8_LARGE_MIN_BYTES
    hostmem.INT8_LARGE_MIN_BYTES = 64 << 10  # (1 MiB in use) so that big is "large" here
    try:
        int8 = AllReduceSelector(ctx, "hostmem-int8", max_bytes=1 << 20)
    finally:
        hostmem.INT8_LARGE_MIN_BYTES = large_min
    assert [int8.pick(t).bufs.block for t in (x, big)] == [4096, hostmem.INT8_LARGE_BLOCK]
    assert torch.equal(int8.all_reduce(big.clone()), 2 * big)  # ones: exact in int8
    int8.close()
    # hostmem-copy: all-reduces issued beside compute from COPY_MIN_BYTES through the copy
    # path; smaller ones, and every one issued plainly, through hostmem's lanes
    from lightwell.distributed.comm.base import beside_compute

    copy = AllReduceSelector(ctx, "hostmem-copy", max_bytes=2 << 20)
    large = torch.ones(300, 1000)  # 1.2 MB
    assert [copy.pick(t).name for t in (x, big, large)] == ["hostmem"] * 3
    assert [copy.pick(t).protocol for t in (x, big, large)] == ["ll", "flag", "flag"]
    with beside_compute():
        picks = [copy.pick(t).name for t in (x, big, large)]
        assert picks == ["hostmem", "hostmem", "hostmem-copy"], picks
        assert torch.equal(copy.all_reduce(large.clone()), 2 * large)
    assert torch.equal(copy.all_reduce(large.clone()), 2 * large)
    copy.close()
    copy8 = AllReduceSelector(ctx, "hostmem-copy-int8", max_bytes=2 << 20)
    assert copy8.pick(large).name == "hostmem-int8"
    with beside_compute():
        assert [copy8.pick(t).name for t in (x, large)] == ["hostmem-int8", "hostmem-copy-int8"]
        assert torch.equal(copy8.all_reduce(large.clone()), 2 * large)  # ones: exact in int8
    copy8.close()


def _check_exact_sum(rank: int, ctx) -> None:
    """Under comm.base.exact_sum the int8 strategies sum exactly (the vocab-parallel
    embedding's all-reduce): the same bits as the fp32 sum in rank order, where the int8
    payload is off; int8 calls before and after on the same buffers stay int8; the embedding
    of a sharded vocabulary under hostmem-int8 equals the unsharded table's rows."""
    from lightwell.distributed.comm import selector
    from lightwell.distributed.comm.base import beside_compute, exact_sum
    from lightwell.distributed.comm.selector import AllReduceSelector
    from lightwell.layers.embedding import VocabParallelEmbedding

    g = torch.Generator().manual_seed(11)
    xs = [torch.randn(6, 512, generator=g) for _ in range(2)]
    want = xs[0] + xs[1]
    with mock.patch.object(selector, "COPY_MIN_BYTES", 0):  # the copy path takes x
        sels = [AllReduceSelector(ctx, c, max_bytes=1 << 16)
                for c in ("hostmem-int8", "hostmem-copy-int8")]  # fmt: skip
    sels.insert(1, _create("int8", ctx))  # (experimental: built directly)
    with beside_compute():
        assert sels[2].pick(xs[rank]).name == "hostmem-copy-int8"
        with exact_sum():
            assert sels[2].pick(xs[rank]).name == "hostmem-int8"
    for choice, sel in zip(("hostmem-int8", "int8", "hostmem-copy-int8"), sels):
        lossy = sel.all_reduce(xs[rank].clone())
        assert not torch.equal(lossy, want) and (lossy - want).abs().max() < 0.1, choice
        with exact_sum(), beside_compute():
            if choice == "int8":  # (a strategy alone: it leaves exact sums to the selector)
                assert not sel.supports(xs[rank])
            else:
                assert torch.equal(sel.all_reduce(xs[rank].clone()), want), choice
        assert torch.equal(sel.all_reduce(xs[rank].clone()), lossy), choice
        sel.close()
    table = torch.randn(100, 256, generator=g)
    emb = VocabParallelEmbedding(100, 256)
    emb.weight_loader(emb.weight, table)
    ids = torch.tensor([0, 99, 50, 63, 64, 7])  # rows of both shards
    sel = AllReduceSelector(ctx, "hostmem-int8", max_bytes=1 << 16)
    with _through(sel):
        assert torch.equal(emb(ids), table[ids])
    sel.close()


def _check_setup_failures(rank: int, ctx) -> None:
    """auto's optional strategies: a failure on one rank makes every rank fall back; a shared
    segment that does not fit /dev/shm fails on every rank, before anything is mapped."""
    from unittest import mock

    from lightwell.distributed.comm import hostmem, shm
    from lightwell.distributed.comm.selector import _build_on_every_rank

    options = {"max_bytes": 1 << 10}
    ok = _build_on_every_rank("hostmem", ctx, options)
    assert ok is not None
    ok.close()
    built = hostmem.HostMemAllReduce.__init__

    def fails_after_mapping(self, *args, **kwargs):  # like a refused cudaHostRegister
        built(self, *args, **kwargs)
        raise RuntimeError("pinning refused")

    with mock.patch.object(hostmem.HostMemAllReduce, "__init__", fails_after_mapping):
        if rank == 0:
            assert _build_on_every_rank("hostmem", ctx, options) is None
    if rank == 1:  # built here, then closed: rank 0 failed
        assert _build_on_every_rank("hostmem", ctx, options) is None
    full = mock.Mock(f_bavail=1, f_frsize=4096)
    with mock.patch.object(shm.os, "statvfs", return_value=full):
        try:
            shm.map_shared(ctx, 1 << 20)
        except RuntimeError as e:
            assert "free" in str(e)
        else:
            raise AssertionError("map_shared should have refused")


# (query_lens, seq_lens) per step for requests a, b, c (blocks of 4 tokens, tables below):
# prefill a + b (the split, token 8, falls inside a), decode a + b (split between requests),
# then decode a + b with a prefill of c (split inside c).
STEPS = [([11, 6], [11, 6]), ([1, 1], [12, 7]), ([1, 1, 9], [13, 8, 9])]
TABLES = [[3, 9, 1, 12], [7, 2], [5, 0, 14]]


def plain_and_split(folder: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The checkpoint loaded twice (the plain and the micro-batch forward), each with its own
    KV cache (16 blocks of 4)."""
    from tests.models.paged import bind_kv_caches
    from tests.models.tiny import load_ours

    plain, split = load_ours(folder), load_ours(folder)
    for model in (plain, split):
        bind_kv_caches(model, 16, 4, torch.float32, torch.device("cpu"))
    return plain, split


def micro_batch_steps():
    """(step, input ids, positions, metadata) of each of ``STEPS``."""
    from tests.models.paged import build_metadata

    for step, (query_lens, seq_lens) in enumerate(STEPS):
        tables = TABLES[: len(query_lens)]
        meta, pos = build_metadata(query_lens, seq_lens, tables, 4, torch.device("cpu"))
        yield step, torch.arange(sum(query_lens)) + 3 * step, pos, meta


def _check_micro_batches(rank: int, ctx, folder: str) -> None:
    from lightwell.attention.metadata import forward_context
    from lightwell.distributed.comm import selector
    from lightwell.distributed.comm.selector import AllReduceSelector
    from lightwell.dual_stream.comm import CommStream
    from lightwell.dual_stream.forward import micro_batch_forward, supports_micro_batches
    from lightwell.dual_stream.split import can_split, split_batch

    hostmem = AllReduceSelector(ctx, "hostmem", max_bytes=1 << 16)
    with mock.patch.object(selector, "COPY_MIN_BYTES", 0):  # every message through the copy path
        copy = AllReduceSelector(ctx, "hostmem-copy", max_bytes=1 << 16, phases=2)
        copy_int8 = AllReduceSelector(ctx, "hostmem-copy-int8", max_bytes=1 << 16, phases=2)
    plain, split = plain_and_split(folder)
    assert supports_micro_batches(split)
    for step, ids, pos, meta in micro_batch_steps():
        with torch.no_grad(), forward_context(meta):
            want = plain(ids, pos)  # [T, H]
        with torch.no_grad():
            got = micro_batch_forward(split, split_batch(ids, pos, meta), CommStream(None))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        # three micro-batches (prefills: a request cut twice; the decode-only step of two
        # requests cannot be cut in three); the same K/V are written again, the same slots
        if can_split(meta, 3):
            with torch.no_grad():
                parts = split_batch(ids, pos, meta, 3)
                assert [len(mb.input_ids) for mb in parts] == [
                    len(ids) * (j + 1) // 3 - len(ids) * j // 3 for j in range(3)
                ]
                got = micro_batch_forward(split, parts, CommStream(None))
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        else:
            assert step == 1
        # the plain forward through hostmem, whose kernel fuses every all-reduce that feeds a
        # norm with its residual add + RMSNorm: o_proj's and down_proj's of every layer (the
        # last one's feeds the final norm); the embedding's all-reduce stays plain
        with torch.no_grad(), forward_context(meta), _through(hostmem) as calls:
            got = plain(ids, pos)
        assert calls == {"fused": 2 * len(plain.model.layers), "plain": 1, "phased": 0}, calls
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        # the copy engines take only the two-micro-batch forward's layer all-reduces (issued
        # beside compute: 2 stages x 2 micro-batches a layer); the plain forward's, and the
        # embedding's, go to hostmem's lanes (fused with the norm where they feed one)
        copied = copy.preferred[0]
        assert copied.name == "hostmem-copy"
        before = copied.calls
        with torch.no_grad(), forward_context(meta), _through(copy) as calls:
            got = plain(ids, pos)
        assert calls == {"fused": 2 * len(plain.model.layers), "plain": 1, "phased": 0}, calls
        assert copied.calls == before
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        # in phases (begun by CommStream.launch, summed by its wait), the embedding's two
        # plain (the main stream's own, not launched)
        with torch.no_grad(), _through(copy) as calls:
            got = micro_batch_forward(split, split_batch(ids, pos, meta), CommStream(None))
        layers = len(plain.model.layers)
        assert calls == {"fused": 0, "plain": 2, "phased": 4 * layers}, calls
        assert copied.calls - before == 4 * layers
        assert not any(copied.in_use)  # every stage set given back
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        # hostmem-copy-int8 in phases: every layer all-reduce (2 a micro-batch a layer)
        # through the int8 copy path, within the int8 bound of the exact forward
        with torch.no_grad(), _through(copy_int8) as calls:
            lossy = micro_batch_forward(split, split_batch(ids, pos, meta), CommStream(None))
        assert calls["phased"] == 4 * layers, calls
        assert not any(copy_int8.preferred[0].in_use)
        assert 0 < (lossy - want).norm() < 0.05 * want.norm()
        with torch.no_grad():  # this step's K/V exact again, for the next steps
            micro_batch_forward(split, split_batch(ids, pos, meta), CommStream(None))
    hostmem.close()
    copy.close()
    copy_int8.close()


@contextlib.contextmanager
def _through(selector):
    """Route tp_all_reduce through ``selector`` for a while, counting its plain, fused and
    phased calls (fused: those that returned the fused result; phased: those begun in phases
    by ``start``)."""
    from lightwell.distributed.parallel_state import get_tp_all_reduce, set_tp_all_reduce

    calls = {"fused": 0, "plain": 0, "phased": 0}
    plain, fused, start = selector.all_reduce, selector.all_reduce_add_rmsnorm, selector.start

    def count_plain(x):
        calls["plain"] += 1
        return plain(x)

    def count_fused(*args):
        out = fused(*args)
        calls["fused"] += out is not None
        return out

    def count_phased(x):
        out = start(x)
        calls["phased"] += out is not None
        return out

    before = get_tp_all_reduce()
    selector.all_reduce, selector.all_reduce_add_rmsnorm = count_plain, count_fused
    selector.start = count_phased
    set_tp_all_reduce(selector)
    try:
        yield calls
    finally:
        set_tp_all_reduce(before)
        del selector.all_reduce, selector.all_reduce_add_rmsnorm, selector.start


def _run(rank: int, port: int, folder: str) -> None:
    import torch.distributed as dist

    from lightwell.distributed.comm import CommContext
    from lightwell.distributed.launch import shutdown_distributed
    from lightwell.distributed.parallel_state import init_tp_group

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
    )
    group = dist.group.WORLD
    init_tp_group(rank, WORLD, group)
    ctx = CommContext(rank, WORLD, group, group, torch.device("cpu"))
    _check_strategies(rank, ctx)
    _check_selector(rank, ctx)
    _check_greedy_tokens(rank)
    _check_setup_failures(rank, ctx)
    _check_exact_sum(rank, ctx)
    _check_micro_batches(rank, ctx, folder)
    # every reference to the gloo group must go before it is destroyed: one left for the
    # interpreter's exit aborts the process now and then ("terminate called ...")
    del ctx, group
    shutdown_distributed()


def test_all_reduce_strategies_and_micro_batches_tp2(tmp_path):

    from tests.models.tiny import hf_tiny_model, save_hf, tiny_config

    # hidden 128: a row of whole int8 groups (hostmem-copy-int8's rows)
    cfg = tiny_config(
        "base", num_key_value_heads=2, attention_bias=True, mlp_bias=True, hidden_size=128
    )
    folder = save_hf(hf_tiny_model(cfg, seed=3), str(tmp_path / "tiny"))
    torch.set_num_threads(1)
    _spawn(_run, WORLD, folder)


def _spawn(fn, nprocs: int, *args) -> None:
    """``fn(rank, port, *args)`` in ``nprocs`` processes, retried once if the free port was
    taken by another process before the group bound it."""
    import torch.multiprocessing as mp

    for attempt in range(2):
        try:
            mp.spawn(fn, args=(_free_port(), *args), nprocs=nprocs, join=True)
            return
        except mp.ProcessRaisedException as e:
            if attempt or "address already in use" not in str(e).lower():
                raise


def test_auto_rule_on_gpus(monkeypatch):
    """auto: peer memory for small messages when every GPU pair has peer access and the custom
    all-reduce is allowed (below it, on two GPUs, the host-memory low-latency lane for
    decode-sized messages), NCCL alone when it is not; without peer access the exact
    host-memory kernel for every message; never a lossy strategy."""
    from lightwell.distributed.comm import CommContext, selector

    ctx = CommContext(0, 2, None, None, torch.device("cuda", 0))
    # the low-latency lane for messages up to 64 KB, then the flag protocol
    hostmem = [
        ("hostmem", {"max_bytes": 64 << 10, "protocol": "ll"}),
        ("hostmem", {"max_bytes": 16 << 20}),
    ]
    for custom, peers, want in (
        (True, True, [hostmem[0], ("oneshot", {"max_bytes": selector.AUTO_PEER_MAX_BYTES})]),
        (False, True, []),  # NCCL
        (True, False, hostmem),
        (False, False, hostmem),
    ):
        monkeypatch.setattr(selector, "_all_ranks", lambda ctx, ok: ok)
        monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b, p=peers: p)
        assert selector._preferred(ctx, "auto", custom, 16 << 20) == want, (custom, peers)
    # more than two GPUs with peer access: peer memory only (the host lane measured on two)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: True)
    four = CommContext(0, 4, None, None, torch.device("cuda", 0))
    assert selector._preferred(four, "auto", True, 16 << 20) == [
        ("oneshot", {"max_bytes": selector.AUTO_PEER_MAX_BYTES})
    ]
    monkeypatch.setenv("NCCL_P2P_DISABLE", "1")  # the operator says: no peer-to-peer
    assert not selector.peer_access(ctx)
    assert selector._preferred(ctx, "auto", True, 16 << 20) == hostmem
    cpu = CommContext(0, 2, None, None, torch.device("cpu"))
    assert selector._preferred(cpu, "auto", False, 16 << 20) == []  # gloo
    assert selector._preferred(cpu, "hostmem-int8", False, 16 << 20) == [
        ("hostmem-int8", {"max_bytes": 1 << 20}),  # no ll lane: it measured slower
        ("hostmem-int8", {"max_bytes": 16 << 20, "block": 2048}),  # prefill sizes
    ]
    assert selector._preferred(cpu, "hostmem-int8", False, 1 << 20) == [
        ("hostmem-int8", {"max_bytes": 1 << 20})
    ]
    copy = {
        "max_bytes": 16 << 20,
        "min_bytes": selector.COPY_MIN_BYTES,
        "beside_compute_only": True,
        "phases": 3,
    }
    assert selector._preferred(cpu, "hostmem-copy", False, 16 << 20, 3) == [
        ("hostmem-copy", copy),
        *hostmem,
    ]
    assert selector._preferred(cpu, "hostmem-copy-int8", False, 16 << 20, 3) == [
        ("hostmem-copy-int8", copy),
        *selector._preferred(cpu, "hostmem-int8", False, 16 << 20),
    ]


def test_hostmem_copy_chunks():
    """A message's pieces: contiguous, covering it, multiples of 64 elements but the last, at
    most ``chunks`` of them and none under MIN_CHUNK_BYTES (but one piece at least)."""
    from lightwell.distributed.comm.hostmem_copy import MIN_CHUNK_BYTES, chunk_bounds

    for n, item, chunks, pieces in (
        (1, 2, 4, 1),
        (MIN_CHUNK_BYTES // 2 - 1, 2, 4, 1),
        (MIN_CHUNK_BYTES, 2, 4, 2),
        (2048 * 4096, 2, 4, 4),
        (2048 * 4096, 2, 1, 1),
        (1000 * 4096 + 3, 4, 16, 16),
    ):
        bounds = chunk_bounds(n, item, chunks)
        assert len(bounds) == pieces, (n, item, chunks, bounds)
        assert bounds[0][0] == 0 and bounds[-1][1] == n
        assert all(b == a2 for (_, b), (a2, _) in zip(bounds, bounds[1:]))
        assert all(a % 64 == 0 for a, _ in bounds)
        if pieces > 1:
            assert min((b - a) * item for a, b in bounds[:-1]) >= MIN_CHUNK_BYTES


def test_hostmem_copy_int8_layout():
    """int8 rows: whole 128-element groups, four at a time (packed rows 16-byte aligned),
    covering the message with less than a row to spare, at most ``chunks`` of them and none
    under MIN_CHUNK_BYTES (but one at least)."""
    from lightwell.distributed.comm.hostmem_copy import MIN_CHUNK_BYTES, int8_layout
    from lightwell.kernels.int8_pack import packed_row_bytes

    for n, chunks, want in ((5, 4, 1), (MIN_CHUNK_BYTES * 2, 4, 2), (2048 * 4096, 4, 4),
                            (1000 * 4096 + 3, 16, 15), (2048 * 4096, 1, 1)):  # fmt: skip
        rows, cols = int8_layout(n, chunks)
        assert rows == want and cols % 512 == 0 and rows * cols >= n > (rows - 1) * cols
        assert packed_row_bytes(cols) % 16 == 0
        if rows > 1:
            assert cols >= MIN_CHUNK_BYTES


def _run_three(rank: int, port: int) -> None:
    """hostmem-copy(-int8) over 3 processes: every reader's handshake, the rank-order sum."""
    import torch.distributed as dist

    from lightwell.distributed.comm import CommContext, create_strategy
    from lightwell.kernels.int8_pack import GROUP

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3)
    group = dist.group.WORLD
    ctx = CommContext(rank, 3, group, group, torch.device("cpu"))

    def inputs(n: int, dtype: torch.dtype, r: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(100 * r + n)
        return (torch.randn(n, generator=g) * (r + 1)).to(dtype)

    with _min_chunk_bytes(256):
        for name in ("hostmem-copy", "hostmem-copy-int8"):
            strategy = create_strategy(name, ctx, chunks=3, phases=2, max_bytes=16 << 10)
            for n, dtype in ((5, torch.float32), (3000, torch.float32), (3000, torch.bfloat16),
                             (700, torch.float32)):  # fmt: skip
                xs = [inputs(n, dtype, r) for r in range(3)]
                exact = (xs[0].float() + xs[1].float()) + xs[2].float()  # rank order, fp32
                got = strategy.all_reduce(xs[rank].clone())
                # in phases (two calls in flight, both slots claimed ahead of their copies as
                # CommStream does, finished in the other order): the same sums
                first = strategy.start(xs[rank].clone())
                second = strategy.start(xs[(rank + 1) % 3].clone())
                first.claim()
                second.claim()
                assert (first.parity, second.parity) in ((0, 1), (1, 0))
                first.transfer()
                second.transfer()
                shifted = strategy.all_reduce(xs[(rank + 1) % 3].clone())
                assert torch.equal(second.finish(), shifted), (name, n, dtype)
                assert torch.equal(first.finish(), got), (name, n, dtype)
                seen = [torch.empty(n) for _ in range(3)]
                dist.all_gather(seen, got.float(), group=group)
                assert all(torch.equal(seen[0], t) for t in seen), (name, n)  # every rank
                if name == "hostmem-copy":
                    assert torch.equal(got, exact.to(dtype)), (name, n, dtype)
                elif dtype == torch.float32:
                    pad = (0, -n % GROUP)
                    amax = sum(
                        torch.nn.functional.pad(x.abs(), pad).view(-1, GROUP).amax(-1) for x in xs
                    ).repeat_interleave(GROUP)[:n]
                    assert ((got - exact).abs() <= amax / 254 * 1.001 + 1e-6).all(), (name, n)
                    assert (got - exact).norm() < 0.02 * exact.norm()
            # every stage set in flight: start declines (the caller runs the call whole); a set
            # given back (finished, or released after a failed forward) is taken again
            x = xs[rank]
            held = [strategy.start(x.clone()) for _ in range(strategy.phases)]
            assert all(h is not None for h in held) and strategy.start(x) is None
            held[1].release()  # (a failed forward: never transferred)
            again = strategy.start(x.clone())
            assert again is not None and again.stage == held[1].stage
            assert strategy.start(x) is None
            for h in (held[0], again):  # every rank transfers the same calls in order
                h.transfer()
            assert torch.equal(again.finish(), held[0].finish())
            assert not any(strategy.in_use)
            # a message too large for a stage set in phases (it holds a micro-batch's, half a
            # step's) runs whole
            big = torch.ones(2 * strategy.stages[0].shape[1])  # (as int8 too)
            assert strategy.start(big) is None and not any(strategy.in_use)
            strategy.close()
    del ctx, group
    dist.destroy_process_group()


def test_hostmem_copy_three_ranks():
    _spawn(_run_three, 3)


def test_peermem_gpu_buffers_are_symmetric_memory(monkeypatch):
    """peermem's GPU set-up, with torch's symmetric memory stood in for: its own buffer is
    allocated there and zeroed, rendezvoused over the TP group, the peer's buffer (group
    rank 1 - rank) is what it writes, and both ranks are past the zeroing (device synchronized,
    CPU-group barrier) before it returns."""
    import sys
    import types

    from lightwell.experimental.comm import peermem

    calls = []
    own = torch.full((64,), 7, dtype=torch.uint8)
    peer_buffer = torch.zeros(64, dtype=torch.uint8)

    class Handle:
        def get_buffer(self, rank, sizes, dtype):
            calls.append(("get_buffer", rank, tuple(sizes), dtype))
            return peer_buffer

    def rendezvous(tensor, group_name):
        calls.append(("rendezvous", tensor is own, group_name, bool(own.any())))
        return Handle()

    fake = types.SimpleNamespace(empty=lambda n, dtype, device: own, rendezvous=rendezvous)
    monkeypatch.setitem(sys.modules, "torch.distributed._symmetric_memory", fake)
    monkeypatch.setattr(torch.distributed, "_symmetric_memory", fake, raising=False)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("sync"))
    barrier = lambda group=None: calls.append(("barrier", group))  # noqa: E731
    monkeypatch.setattr(peermem.dist, "barrier", barrier)
    for rank in (0, 1):
        calls.clear()
        group = types.SimpleNamespace(group_name="tp")
        ctx = peermem.CommContext(rank, 2, group, "cpu-group", torch.device("cuda", rank))
        strategy = peermem.PeerMemAllReduce.__new__(peermem.PeerMemAllReduce)
        strategy.on_gpu = True
        mine, theirs = strategy._segments(ctx, 64)
        assert mine is own and theirs is peer_buffer and not own.any()
        assert calls == [
            ("rendezvous", True, "tp", False),  # zeroed before
            ("get_buffer", 1 - rank, (64,), torch.uint8),
            "sync",
            ("barrier", "cpu-group"),
        ]
        assert strategy.registered is False and strategy._release() is None
        own.fill_(7)


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
        not torch.cuda.is_available(), reason="the kernels/argmax.py path: a GPU"))],
)  # fmt: skip
def test_greedy_tokens_on_one_rank(device):
    """One rank (no process group): ``greedy_tokens`` takes the argmax of the unpadded logits
    in their own dtype (on a GPU kernels/argmax.py over the rows cut from the padded
    vocabulary), the same checks as the sharded path's."""
    _check_greedy_tokens(0, device)
