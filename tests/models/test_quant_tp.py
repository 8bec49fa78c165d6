"""Quantized checkpoints under tensor parallelism (2 CPU processes over gloo): packed weights,
scales, zero points and g_idx sharded by column- and row-parallel layers (act-order groups kept
whole on row-parallel ranks, per-tensor scales per q/k/v shard, 16x16 fp8 blocks), compared with
HF transformers running the dequantized weights (and the emulated fp8 activations)."""

from __future__ import annotations

import torch

from tests.models.test_quant_formats import W8A8, WEIGHT_ONLY, build, with_input_quant
from tests.models.test_tensor_parallel import PROMPTS, _free_port, _run_rank
from tests.models.tiny import hf_logits, rel_err

KEYS = ["gptq_4b_g32_asym_actorder", "awq_4b_g32"]
FP8_KEYS = ["ct_fp8_static_tensor", "hf_fp8_block16"]


def test_tp2_quantized_formats_match_hf(tmp_path):
    import torch.multiprocessing as mp

    torch.set_num_threads(1)
    hf_models, folders, tols = {}, {}, {}
    for key in KEYS + FP8_KEYS:
        quant_config, make = WEIGHT_ONLY[key] if key in WEIGHT_ONLY else W8A8[key][:2]
        hf_models[key], folders[key] = build(tmp_path, key, quant_config, make, seed=7)
        tols[key] = 1e-4
        if key in W8A8:
            with_input_quant(hf_models[key], W8A8[key][3])
            tols[key] = 2e-3
    out = str(tmp_path / "results.pt")
    mp.spawn(_run_rank, args=(2, _free_port(), folders, out), nprocs=2, join=True)
    results = torch.load(out)
    for key, hf in hf_models.items():
        prefill, seqs, steps, _ = results[key]
        for p, lg in zip(PROMPTS, prefill):
            assert rel_err(lg, hf_logits(hf, p)) < tols[key], key
        for p, s, st in zip(PROMPTS, seqs, steps):
            assert rel_err(st, hf_logits(hf, s)[len(p) - 1 :]) < tols[key], key
