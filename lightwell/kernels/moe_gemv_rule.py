"""Which MoE steps take the few-token GEMV kernels (kernels/moe_gemv.py); no Triton.

``fused_moe`` routes by this rule, and ``FusedMoE`` (layers/moe.py) asks it whether a step runs
the shared experts in the routed experts' launches: the same rule on every device, so the CPU
path imports it without loading Triton.
"""

from __future__ import annotations

# The decode path serves steps of at most this many tokens and (token, choice) pairs.
MAX_TOKENS = 8


def use_gemv(num_tokens: int, top_k: int, num_experts: int) -> bool:
    """Whether a step of ``num_tokens`` tokens takes the GEMV path (fused_moe's default): at
    most ``MAX_TOKENS`` tokens and no more (token, expert) pairs than experts. Each pair streams
    its expert's rows, so with more pairs than experts the grouped kernels, which read an expert
    once for all its tokens, read fewer bytes (benchmarks/results/kernels_moe_decode_h200.json
    times both paths at 1-8 tokens)."""
    return 0 < num_tokens <= MAX_TOKENS and num_tokens * top_k <= num_experts
