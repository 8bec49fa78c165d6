from __future__ import annotations

import os

import pytest

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "List three prime numbers and explain why they are prime.",
    "Translate 'good morning' into Spanish and German.",
    "def fibonacci(n):\n    # complete this Python function",
    "Explain in two sentences why the sky is blue.",
    "What is 17 times 23?",
]


@pytest.fixture(scope="session")
def hf_reference(smollm2_gguf):
    """HF transformers' greedy outputs for CHAT_PROMPTS from the same GGUF (fp32, CPU)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(smollm2_gguf)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.eval()
    out = {}
    for p in CHAT_PROMPTS:
        text = tok.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
        )
        ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.inference_mode():
            gen = model.generate(ids, max_new_tokens=MAX_NEW, do_sample=False)
        out[p] = (ids[0].tolist(), gen[0, ids.shape[1] :].tolist())
    return out


MAX_NEW = 40
