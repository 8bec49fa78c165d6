"""Mixture-of-experts MLP for a few tokens (decode): one GEMV program per (pair, rows), no sort.

    out[t] = sum_j w[t, j] * W2[e_tj] @ (silu(W1[e_tj] @ x[t]) * W3[e_tj] @ x[t])

With a handful of (token, choice) pairs the grouped GEMM of kernels/fused_moe.py spends its time
in the sort and padding launches and in ``tl.dot`` over mostly padded rows. Here each program
reads its pair's expert id straight from ``ids`` and streams that expert's rows on the CUDA
cores, in the style of kernels/gemv.py: ``BLOCK_K``-wide contiguous loads, an fp32
``[BLOCK_N, BLOCK_K]`` accumulator reduced once after the loop, the loop's loads unmasked when
``BLOCK_K`` divides the reduced size (rows past the end re-read the last row and store
nothing).

- ``_moe_gemv_gate_up``: one program per (pair, BLOCK_N rows): the gate and up rows of the
  pair's expert against the token's x, ``silu(gate) * up`` -> ``act`` [T * (k + S), I] in x's
  dtype. The shared experts' programs come first (tokens fastest): launched with PDL they load
  their first K tile before waiting, under the router kernel (which lets them start before
  its own wait), as their expert needs no router. The routed pairs' programs follow, pairs
  fastest, so pairs sharing an expert read the same rows at about the same time, where L2 can
  serve all but the first read.
- ``_moe_gemv_down``: grid (T, cdiv(H, BLOCK_N)): one program loops over its token's k pairs,
  each pair's W2 rows against its ``act`` row times its router weight, summed in fp32 in a
  fixed order (no atomics: deterministic) -> [T, H] in x's dtype. For one or two tokens of
  many pairs each (``use_split``), ``_moe_gemv_down_split``: one program per (token, rows,
  pair), each pair's weighted rows stored as an fp32 partial, the last program of a row block
  to finish (kernels/split_counters.py) adding them in pair order (deterministic too): many
  small programs keep more of the weight stream in flight than a program per row block.
  ``_moe_gemv_down_pairs`` (the pairs a dimension of one program's tile) is the benchmark's
  baseline (benchmarks/kernels/moe_down.py), not the default anywhere.

Shared experts (``num_shared`` S: DeepSeek's, split into experts of the routed size) are the
last S of the stack: every token takes them after its k routed ones, with weight 1 (pairs are
then ``k + S`` a token; ``ids`` holds only the routed ones). Expert ids outside ``[0, E)``
(another rank's experts under expert parallelism) are skipped: their weights are never read.
Two launches, no host sync, shapes fixed by T: CUDA-graph safe, once the split down kernel
has run outside a capture (its counters are allocated on first use: kernels/split_counters.py;
the runner's warm-up forwards and ``MoEBlock.compile_kernel_variants`` make that call).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lightwell.kernels import pdl as _pdl
from lightwell.kernels.pdl_sync import wait_then_signal
from lightwell.kernels.split_counters import last_to_arrive, split_counters

# (BLOCK_N, BLOCK_K, num_warps, num_stages)
Config = tuple[int, int, int, int]


@triton.jit
def _pair_expert(ids_ptr, token, j, top_k, num_experts, num_shared):
    """The expert of choice ``j`` of ``token``: a routed one from ``ids`` (j < k), else shared
    expert ``j - k``, stored after the routed ones."""
    # (.cg: L2, never a stale L1 line; the down kernel reads ids before its PDL wait)
    routed = tl.load(ids_ptr + token * top_k + tl.minimum(j, top_k - 1), cache_modifier=".cg")
    routed = routed.to(tl.int64)
    shared = (num_experts - num_shared + j - top_k).to(tl.int64)
    return tl.where(j < top_k, routed, shared)


@triton.jit
def _pair_weight(weight_ptr, token, j, top_k):
    """The router weight of choice ``j`` of ``token``: from ``weight_ptr`` (j < k), else 1 (a
    shared expert)."""
    scale = tl.load(weight_ptr + token * top_k + tl.minimum(j, top_k - 1))
    return tl.where(j < top_k, scale, 1.0)


@triton.jit(do_not_specialize=["num_tokens", "top_k", "num_experts", "num_shared"])
def _moe_gemv_gate_up(
    x_ptr,  # [T, H]
    w_ptr,  # [E, 2 * I, H]: gate rows, then up rows
    ids_ptr,  # [T * k] expert ids
    out_ptr,  # [T * (k + S), I]
    num_tokens, top_k, num_experts, num_shared, hidden, inter,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    EARLY: tl.constexpr,  # the shared experts' programs load their first K tile first
    GDC: tl.constexpr,  # with EARLY: then wait for the router (kernels/pdl.py), then signal
):  # fmt: skip
    # programs: the shared experts' (tokens fastest, then experts, then row blocks) first, so
    # they are the ones resident early; then the routed pairs' (pairs fastest, then row blocks)
    prog = tl.program_id(0)
    row_blocks = tl.cdiv(inter, BLOCK_N)
    shared_progs = num_tokens * num_shared * row_blocks
    is_shared = prog < shared_progs
    group = tl.where(is_shared, num_tokens * num_shared, num_tokens * top_k)
    index = tl.where(is_shared, prog, prog - shared_progs)
    in_group, row_block = index % group, index // group
    token = tl.where(is_shared, in_group % num_tokens, in_group // top_k)
    j = tl.where(is_shared, top_k + in_group // num_tokens, in_group % top_k)
    pair = token * (top_k + num_shared) + j
    rn = row_block * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(rn, inter - 1).to(tl.int64)  # past I: re-read the last row
    rk = tl.arange(0, BLOCK_K)
    if EARLY:  # a shared expert's rows need no router: read before the wait
        shared = w_ptr + (num_experts - num_shared + j - top_k).to(tl.int64) * 2 * inter * hidden
        early = rk[None, :] < tl.where(is_shared, hidden, 0)  # [1, BK] (none if routed)
        gate0 = tl.load(shared + rows[:, None] * hidden + rk[None, :], mask=early, other=0.0)
        up0 = tl.load(shared + (rows + inter)[:, None] * hidden + rk[None, :], mask=early,
                      other=0.0)  # fmt: skip
    wait_then_signal(GDC)
    expert = _pair_expert(ids_ptr, token, j, top_k, num_experts, num_shared)
    if (expert < 0) | (expert >= num_experts):
        return  # another rank's expert
    base = w_ptr + expert * 2 * inter * hidden
    gate_rows = base + rows[:, None] * hidden  # [BN, 1]
    up_rows = base + (rows + inter)[:, None] * hidden  # [BN, 1]
    x_row = x_ptr + token.to(tl.int64) * hidden
    if EARLY:  # the routed programs' first tile (the shared ones hold theirs)
        late = rk[None, :] < tl.where(is_shared, 0, hidden)  # [1, BK]
        gate = gate0 + tl.load(gate_rows + rk[None, :], mask=late, other=0.0)
        up = up0 + tl.load(up_rows + rk[None, :], mask=late, other=0.0)
    elif EVEN_K:
        gate = tl.load(gate_rows + rk[None, :])
        up = tl.load(up_rows + rk[None, :])
    else:
        gate = tl.load(gate_rows + rk[None, :], mask=rk[None, :] < hidden, other=0.0)
        up = tl.load(up_rows + rk[None, :], mask=rk[None, :] < hidden, other=0.0)
    if EVEN_K:
        x = tl.load(x_row + rk)
    else:
        x = tl.load(x_row + rk, mask=rk < hidden, other=0.0)
    x = x.to(tl.float32)[None, :]
    acc_gate = gate.to(tl.float32) * x
    acc_up = up.to(tl.float32) * x
    for k0 in range(BLOCK_K, hidden, BLOCK_K):
        k = k0 + rk
        if EVEN_K:
            gate = tl.load(gate_rows + k[None, :])
            up = tl.load(up_rows + k[None, :])
            x = tl.load(x_row + k)
        else:
            gate = tl.load(gate_rows + k[None, :], mask=k[None, :] < hidden, other=0.0)
            up = tl.load(up_rows + k[None, :], mask=k[None, :] < hidden, other=0.0)
            x = tl.load(x_row + k, mask=k < hidden, other=0.0)
        x = x.to(tl.float32)[None, :]
        acc_gate += gate.to(tl.float32) * x
        acc_up += up.to(tl.float32) * x
    g = tl.sum(acc_gate, axis=1)  # [BN]
    act = g / (1.0 + tl.exp(-g)) * tl.sum(acc_up, axis=1)
    out = out_ptr + pair.to(tl.int64) * inter + rn
    tl.store(out, act.to(out_ptr.dtype.element_ty), mask=rn < inter)


@triton.jit(do_not_specialize=["top_k", "num_experts", "num_shared"])
def _moe_gemv_down(
    a_ptr,  # [T * (k + S), I]
    w_ptr,  # [E, H, I]
    ids_ptr,  # [T * k] expert ids
    weight_ptr,  # [T * k] fp32 router weights
    out_ptr,  # [T, H]
    top_k, num_experts, num_shared, hidden, inter,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    GDC: tl.constexpr,  # launched with PDL: wait for the gate/up kernel, then signal
):  # fmt: skip
    wait_then_signal(GDC)
    token = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(rn, hidden - 1).to(tl.int64)  # past H: re-read the last row
    rk = tl.arange(0, BLOCK_K)
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in range(top_k + num_shared):
        pair = token * (top_k + num_shared) + j
        expert = _pair_expert(ids_ptr, token, j, top_k, num_experts, num_shared)
        scale = _pair_weight(weight_ptr, token, j, top_k)
        if (expert >= 0) & (expert < num_experts):  # else: another rank's expert
            w_rows = w_ptr + expert * hidden * inter + rows[:, None] * inter  # [BN, 1]
            a_row = a_ptr + pair.to(tl.int64) * inter
            acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
            for k0 in range(0, inter, BLOCK_K):
                k = k0 + rk
                if EVEN_K:
                    w = tl.load(w_rows + k[None, :])
                    a = tl.load(a_row + k)
                else:
                    w = tl.load(w_rows + k[None, :], mask=k[None, :] < inter, other=0.0)
                    a = tl.load(a_row + k, mask=k < inter, other=0.0)
                acc += w.to(tl.float32) * a.to(tl.float32)[None, :]
            total += scale * tl.sum(acc, axis=1)
    out = out_ptr + token.to(tl.int64) * hidden + rn
    tl.store(out, total.to(out_ptr.dtype.element_ty), mask=rn < hidden)


@triton.jit(do_not_specialize=["top_k", "num_experts", "num_shared"])
def _moe_gemv_down_pairs(
    a_ptr,  # [T * (k + S), I]
    w_ptr,  # [E, H, I]
    ids_ptr,  # [T * k] expert ids
    weight_ptr,  # [T * k] fp32 router weights
    out_ptr,  # [T, H]
    top_k, num_experts, num_shared, hidden, inter,
    PAIRS: tl.constexpr,  # a power of two >= k + S
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    GDC: tl.constexpr,  # launched with PDL: the first weight tile loads before the wait
):  # fmt: skip
    """As ``_moe_gemv_down`` with the token's pairs a dimension of the tile ([PAIRS, BLOCK_N,
    BLOCK_K]) rather than a loop: every pair's rows are in flight at once. Pairs past k + S and
    other ranks' experts are masked off (never read); the pairs' sums are added as a tree in
    a fixed order. Launched with PDL (``GDC``), each program loads its pairs' first weight
    tile before waiting for the gate/up kernel: the expert ids it needs for that are the
    router's, which had finished before the gate/up kernel let this one start (that kernel
    signals only after its own wait)."""
    token = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(rn, hidden - 1).to(tl.int64)  # past H: re-read the last row
    j = tl.arange(0, PAIRS)
    expert = _pair_expert(ids_ptr, token, j, top_k, num_experts, num_shared)  # [P]
    mine = (j < top_k + num_shared) & (expert >= 0) & (expert < num_experts)
    expert = tl.where(mine, expert, 0)
    pair = token * (top_k + num_shared) + tl.minimum(j, top_k + num_shared - 1)
    w_rows = w_ptr + (expert * hidden)[:, None, None] * inter + rows[None, :, None] * inter
    a_rows = a_ptr + pair.to(tl.int64)[:, None] * inter  # [P, 1]
    rk = tl.arange(0, BLOCK_K)
    first = mine[:, None] & (rk < inter)[None, :]  # the first K tile
    w = tl.load(w_rows + rk[None, None, :], mask=first[:, None, :], other=0.0)
    wait_then_signal(GDC)
    scale = tl.where(mine, _pair_weight(weight_ptr, token, j, top_k), 0.0)
    a = tl.load(a_rows + rk[None, :], mask=first, other=0.0)
    acc = w.to(tl.float32) * a.to(tl.float32)[:, None, :]
    for k0 in range(BLOCK_K, inter, BLOCK_K):
        k = k0 + rk
        if EVEN_K:
            w = tl.load(w_rows + k[None, None, :], mask=mine[:, None, None], other=0.0)
            a = tl.load(a_rows + k[None, :], mask=mine[:, None], other=0.0)
        else:
            kin = k < inter
            w = tl.load(
                w_rows + k[None, None, :], mask=mine[:, None, None] & kin[None, None, :], other=0.0
            )
            a = tl.load(a_rows + k[None, :], mask=mine[:, None] & kin[None, :], other=0.0)
        acc += w.to(tl.float32) * a.to(tl.float32)[:, None, :]
    total = tl.sum(tl.sum(acc, axis=2) * scale[:, None], axis=0)  # [BN]
    out = out_ptr + token.to(tl.int64) * hidden + rn
    tl.store(out, total.to(out_ptr.dtype.element_ty), mask=rn < hidden)


@triton.jit(do_not_specialize=["top_k", "num_experts", "num_shared"])
def _moe_gemv_down_split(
    a_ptr,  # [T * (k + S), I]
    w_ptr,  # [E, H, I]
    ids_ptr,  # [T * k] expert ids
    weight_ptr,  # [T * k] fp32 router weights
    part_ptr,  # [T, k + S, H] fp32: each pair's weighted rows
    cnt_ptr,  # [T * cdiv(H, BLOCK_N)] zeroed int32 counters (kernels/split_counters.py)
    out_ptr,  # [T, H]
    top_k, num_experts, num_shared, hidden, inter,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    FENCE: tl.constexpr,  # compiled for a GPU: split_counters.last_to_arrive's fence
    GDC: tl.constexpr,  # launched with PDL: the first weight tile loads before the wait
):  # fmt: skip
    """One program per (token, BLOCK_N rows, pair), pairs fastest: the pair's rows of W2
    against its ``act`` row times its router weight, stored as an fp32 partial; the last of a
    row block's k + S programs to finish adds the partials in pair order (deterministic) and
    writes the output. The first weight tile loads before the PDL wait, as in
    ``_moe_gemv_down_pairs`` (the router's ids, read through L2, are two kernels back)."""
    pairs = top_k + num_shared
    pid = tl.program_id(0)
    row_blocks = tl.cdiv(hidden, BLOCK_N)
    j, rest = pid % pairs, pid // pairs
    row_block, token = rest % row_blocks, rest // row_blocks
    rn = row_block * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(rn, hidden - 1).to(tl.int64)  # past H: re-read the last row
    expert = _pair_expert(ids_ptr, token, j, top_k, num_experts, num_shared)
    mine = (expert >= 0) & (expert < num_experts)  # else: another rank's expert
    w_rows = w_ptr + tl.where(mine, expert, 0) * hidden * inter + rows[:, None] * inter
    rk = tl.arange(0, BLOCK_K)
    first = (rk < tl.where(mine, inter, 0))[None, :]
    w = tl.load(w_rows + rk[None, :], mask=first, other=0.0)
    wait_then_signal(GDC)
    pair = token * pairs + j
    a_row = a_ptr + pair.to(tl.int64) * inter
    a = tl.load(a_row + rk, mask=rk < inter, other=0.0)
    acc = w.to(tl.float32) * a.to(tl.float32)[None, :]
    for k0 in range(BLOCK_K, inter, BLOCK_K):
        k = k0 + rk
        if EVEN_K:
            w = tl.load(w_rows + k[None, :], mask=first, other=0.0)
            a = tl.load(a_row + k)
        else:
            w = tl.load(w_rows + k[None, :], mask=first & (k < inter)[None, :], other=0.0)
            a = tl.load(a_row + k, mask=k < inter, other=0.0)
        acc += w.to(tl.float32) * a.to(tl.float32)[None, :]
    scale = _pair_weight(weight_ptr, token, j, top_k)
    row_part = part_ptr + (token.to(tl.int64) * pairs) * hidden + rn  # [BN] pair 0's
    # (another rank's pair: its act row was never written, so its product may be NaN)
    partial = tl.where(mine, tl.sum(acc, axis=1) * scale, 0.0)
    tl.store(row_part + j * hidden, partial, mask=rn < hidden)
    counter = cnt_ptr + token * row_blocks + row_block
    if last_to_arrive(counter, pairs, rn, FENCE):
        total = tl.zeros([BLOCK_N], dtype=tl.float32)
        for i in range(pairs):
            total += tl.load(row_part + i * hidden, mask=rn < hidden, other=0.0,
                             cache_modifier=".cg")  # fmt: skip
        tl.atomic_xchg(counter, 0)
        out = out_ptr + token.to(tl.int64) * hidden + rn
        tl.store(out, total.to(out_ptr.dtype.element_ty), mask=rn < hidden)


def pick_config(k: int, mats: int = 1, num_tokens: int = 1) -> Config:
    """The tile of a kernel reducing over ``k`` (H for gate/up, I for down) that streams
    ``mats`` matrices at once (2 for gate/up), for a step of ``num_tokens`` tokens; the best
    of the decode benchmark's sweep (benchmarks/kernels/moe_decode.py) on Mixtral and
    DeepSeek-V2-Lite shapes. One token has few programs: one row each, long K steps, more
    warps. More tokens have programs enough: short K steps, one warp."""
    kp = triton.next_power_of_2(k)
    if mats == 2:  # gate/up
        if num_tokens > 1:
            return 2, min(256, kp), 1, 3
        return (1, min(2048, kp), 4, 3) if k >= 4096 else (1, min(1024, kp), 2, 1)
    if k >= 8192:  # down over a wide intermediate size
        return 2, min(2048, kp), 2, 3
    return (4, min(2048, kp), 4, 3) if num_tokens == 1 else (4, min(512, kp), 1, 1)


def moe_gemv_gate_up(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2 * I, H]: gate rows, then up rows
    ids: torch.Tensor,  # [T, k] expert ids (outside [0, E): skipped, their rows left unset)
    config: Config | None = None,  # default: pick_config(H, 2, T)
    num_shared: int = 0,  # the last S experts of w13 are every token's (after its k)
    pdl: bool | None = None,  # default kernels.pdl.use_pdl: the shared experts' first tile
    # loads before the router's output is waited for (with PDL launch on sm_90+)
) -> torch.Tensor:  # [T * (k + S), I] silu(gate) * up per pair, in x's dtype
    num_tokens, top_k = ids.shape
    num_experts, two_inter, hidden = w13.shape
    pairs = num_tokens * (top_k + num_shared)
    act = torch.empty(pairs, two_inter // 2, dtype=x.dtype, device=x.device)
    block_n, block_k, warps, stages = config or pick_config(hidden, 2, num_tokens)
    early = _pdl.use_pdl(x.device) if pdl is None else pdl
    gdc = early and _pdl.device_supports(x.device)
    _moe_gemv_gate_up[(pairs * triton.cdiv(act.shape[1], block_n),)](
        x, w13, ids.reshape(-1).contiguous(), act, num_tokens, top_k, num_experts, num_shared,
        hidden, act.shape[1], BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=hidden % block_k == 0,
        EARLY=early and num_shared > 0, GDC=gdc, num_warps=warps, num_stages=stages,
        **_pdl.launch_options(gdc),
    )  # fmt: skip
    return act


def use_split(num_tokens: int, pairs_per_token: int) -> bool:
    """Whether ``moe_gemv_down`` takes ``_moe_gemv_down_split`` by default: many pairs a token
    (k + S >= 4) and at most 2 tokens, where the loop over pairs leaves the memory system idle
    between pairs. The rule the pairs-in-one-tile kernel's rows set against the loop
    (kernels_moe_down_h200.json: DeepSeek-V2-Lite's 8 pairs a token, Qwen3-MoE's 8, Qwen2-MoE's
    4 and Mixtral's 2, at 1, 2 and 4 tokens); the split kernel, faster than that one on
    V2-Lite's shapes at 1 and 2 tokens, took its place under it."""
    return pairs_per_token >= 4 and num_tokens <= 2


PAIRS_TILE_CONFIG: Config = (8, 256, 8, 1)  # _moe_gemv_down_pairs's tile (moe_down.py)


def split_config(num_tokens: int) -> Config:
    """``_moe_gemv_down_split``'s tile, the best of a sweep on DeepSeek-V2-Lite's shapes with
    benchmarks/kernels/moe_down.py's timing: one token, 16 rows and 256-wide K steps on one
    warp; two, 64 rows and 128-wide steps on two."""
    return (16, 256, 1, 3) if num_tokens == 1 else (64, 128, 2, 1)


def moe_gemv_down(
    act: torch.Tensor,  # [T * (k + S), I]
    w2: torch.Tensor,  # [E, H, I]
    weights: torch.Tensor,  # [T, k] router weights
    ids: torch.Tensor,  # [T, k] expert ids (outside [0, E): skipped)
    config: Config | None = None,  # the kernel's tile; default: the kernel's own rule
    num_shared: int = 0,  # the last S experts of w2 are every token's, weight 1
    kernel: str | None = None,  # "loop", "split" or "pairs"; default: "split" where
    # use_split and no config is given (a config given alone is the loop's tile), else "loop"
) -> torch.Tensor:  # [T, H] in act's dtype
    num_tokens, top_k = ids.shape
    num_experts, hidden, inter = w2.shape
    pairs = top_k + num_shared
    out = torch.empty(num_tokens, hidden, dtype=act.dtype, device=act.device)
    flat_weights = weights.reshape(-1).to(torch.float32).contiguous()  # [T * k]
    ids = ids.reshape(-1).contiguous()
    if kernel is None:
        kernel = "split" if config is None and use_split(num_tokens, pairs) else "loop"
    if kernel == "split":
        block_n, block_k, warps, stages = config or split_config(num_tokens)
        blocks = num_tokens * triton.cdiv(hidden, block_n)
        part = torch.empty(num_tokens, pairs, hidden, dtype=torch.float32, device=act.device)
        _moe_gemv_down_split[(blocks * pairs,)](
            act, w2, ids, flat_weights, part, split_counters(act.device, blocks), out, top_k,
            num_experts, num_shared, hidden, inter, BLOCK_N=block_n, BLOCK_K=block_k,
            EVEN_K=inter % block_k == 0, FENCE=act.is_cuda, num_warps=warps,
            num_stages=stages, **_pdl.kernel_args(act.device),
        )  # fmt: skip
        return out
    if kernel == "pairs":
        fn, tile = _moe_gemv_down_pairs, config or PAIRS_TILE_CONFIG
        extra = {"PAIRS": triton.next_power_of_2(pairs)}
    elif kernel == "loop":
        fn, tile, extra = _moe_gemv_down, config or pick_config(inter, 1, num_tokens), {}
    else:
        raise ValueError(f"moe_gemv_down: kernel {kernel!r} (loop, split or pairs)")
    block_n, block_k, warps, stages = tile
    fn[(num_tokens, triton.cdiv(hidden, block_n))](
        act, w2, ids, flat_weights, out, top_k, num_experts, num_shared, hidden, inter,
        BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=inter % block_k == 0,  num_warps=warps,
        num_stages=stages, **extra, **_pdl.kernel_args(act.device),
    )  # fmt: skip
    return out


def moe_gemv(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2 * I, H]: gate rows, then up rows
    w2: torch.Tensor,  # [E, H, I]
    weights: torch.Tensor,  # [T, k] router weights
    ids: torch.Tensor,  # [T, k] expert ids (outside [0, E): skipped)
    gate_up_config: Config | None = None,  # default: pick_config(H, 2, T)
    down_config: Config | None = None,  # default: see moe_gemv_down
    num_shared: int = 0,  # the last S experts: every token's, weight 1 (DeepSeek's shared)
    down_kernel: str | None = None,  # moe_gemv_down's kernel
) -> torch.Tensor:  # [T, H] in x's dtype
    """The MoE MLP of a few tokens in two launches; shapes as kernels/fused_moe.py's
    ``fused_moe``, which checks them and calls this for steps ``moe_gemv_rule.use_gemv``
    accepts (its torch reference is ``fused_moe_ref`` there). With ``num_shared`` S, each token
    also takes the last S experts of ``w13`` / ``w2`` with weight 1 (after its k routed ones)."""
    # one contiguous ids tensor for both launches: no copy may run between them (the down
    # kernel reads the ids before its PDL wait, kernels/pdl.py)
    ids = ids.contiguous()
    act = moe_gemv_gate_up(x, w13, ids, gate_up_config, num_shared)
    return moe_gemv_down(act, w2, weights, ids, down_config, num_shared, down_kernel)
