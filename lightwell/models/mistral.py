"""Mistral (7B v0.1 with its 4096-token sliding window; v0.2/v0.3 and Mistral-Nemo without one).

A Llama with sliding-window attention: config ``sliding_window`` W (None: full attention) holds
for every layer, and a query at position i sees keys i - W < j <= i, HF transformers' masking
(``kv_idx > q_idx - sliding_window``). The window is applied by the attention backends; every
key stays in the paged cache (blocks wholly out of reach are not freed early).
"""

from __future__ import annotations

from lightwell.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    """Same modules and weight names as Llama; ``sliding_window_of`` reads the window."""
