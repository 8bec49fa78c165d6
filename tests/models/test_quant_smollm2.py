"""SmolLM2-135M (the real model, from its GGUF dequantized at load) under each 8-bit option:
the mean per-token log-likelihood of a fixed English text, prefilled in chunks of 8 tokens (so
every chunk reads the earlier ones back from the KV cache), stays within 1 % of the unquantized
model's with an fp8 or int8 KV cache and with int8 (weight-only) weights; fp8 W8A8 (weights
per channel, activations per token) within 4 %."""

from __future__ import annotations

import pytest
import torch

from tests.models.paged import PagedRunner

TEXT = (
    "The city council met on Tuesday evening to discuss the new library. After a long debate, "
    "the members agreed that the building should open next spring, and that the old reading "
    "room would become a space for children."
)
# TEXT as SmolLM2's tokenizer encodes it (loading that tokenizer from the GGUF takes ~20 s)
TEXT_IDS = [
    504, 2240, 11940, 1278, 335, 14801, 9053, 288, 1692, 260, 725, 4971, 30, 2550, 253, 986,
    6866, 28, 260, 2249, 6454, 338, 260, 2194, 868, 1440, 1867, 4921, 28, 284, 338, 260, 1573,
    2539, 3589, 736, 1438, 253, 1898, 327, 1122, 30,
]  # fmt: skip
CHUNK = 8
# |mean log-likelihood - unquantized| / |unquantized|: 1 % for the 8-bit KV caches and int8
# weights; fp8 W8A8 (activations quantized per token) costs more on this small model
BOUND = {"kv fp8": 0.01, "kv int8": 0.01, "weights int8": 0.01, "weights fp8": 0.04}


def _mean_log_likelihood(model, ids: list[int], kv: str = "auto") -> float:
    runner = PagedRunner(model, block_size=16, num_blocks=16, kv_cache_dtype=kv)
    logits = []
    for start in range(0, len(ids), CHUNK):
        logits += runner.step([("t", ids[start : start + CHUNK], start)])
    logp = torch.cat(logits).log_softmax(-1)[:-1]  # [L - 1, V]: predicts tokens 1..L-1
    return logp.gather(1, torch.tensor(ids[1:])[:, None]).mean().item()


def _as_safetensors(gguf: str, folder: str) -> str:
    """The GGUF's tensors, dequantized once, as an HF folder (each load below is then quick)."""
    from safetensors.torch import save_file

    from lightwell.model_files import resolve_model
    from lightwell.models.gguf_loader import GGUFCheckpoint
    from lightwell.models.hf_config import load_hf_config

    config = load_hf_config(resolve_model(gguf))
    tensors = {name: t.contiguous() for _, name, t in GGUFCheckpoint(gguf, config)}
    save_file(tensors, f"{folder}/model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(folder)
    return folder


@pytest.mark.slow
def test_8bit_options_keep_smollm2_log_likelihood_within_1_percent(smollm2_gguf, tmp_path):
    from lightwell.model_files import resolve_model
    from lightwell.models.hf_config import load_hf_config
    from lightwell.models.loader import load_model

    torch.set_num_threads(1)
    files = resolve_model(_as_safetensors(smollm2_gguf, str(tmp_path)))
    config = load_hf_config(files)
    model = load_model(files, config, torch.float32, "cpu")
    base = _mean_log_likelihood(model, TEXT_IDS)
    results = {f"kv {kv}": _mean_log_likelihood(model, TEXT_IDS, kv) for kv in ("fp8", "int8")}
    del model
    for quantization in ("int8", "fp8"):
        model = load_model(files, config, torch.float32, "cpu", quantization=quantization)
        results[f"weights {quantization}"] = _mean_log_likelihood(model, TEXT_IDS)
        del model
    assert -6 < base < -0.5  # real text under a real model
    for name, value in results.items():
        assert abs(value - base) / abs(base) < BOUND[name], (name, value, base)
