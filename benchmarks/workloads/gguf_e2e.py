"""``--quantization gguf`` end to end: synthetic llama GGUF files of random blocks (random bytes,
small fp16 scales) written with gguf-py's GGUFWriter (needs the ``gguf`` package: on the GPU
machine carry scripts/fetch_gpu_wheels.sh's .whl and install it, as the command below does).

1. check: a tiny llama (hidden 512, 4 layers, every layer a mix of Q4_0, Q4_1, Q8_0, Q4_K, Q5_K,
   Q6_K), fp32: greedy tokens of the blocks run by the kernels (CUDA graphs on) against the same
   file dequantized at load (``--quantization auto``), 4 prompts x 24 tokens.
2. decode: llama-3-8b's shapes, Q4_K linears with Q6_K attn_v and ffn_down (as llama.cpp's
   Q4_K_M), bf16: time per output token at batch 1 and 8 beside the same shapes with dense bf16
   weights (``--load-format dummy``); the file is ~5.6 GB, written in about a minute.

    run(command="python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/gguf-*.whl
        && PYTHONPATH=/tmp/site:$PYTHONPATH python3 -m benchmarks.workloads.gguf_e2e
        --out $OUT/gguf_e2e.json", carry=[".whl"])  # ~6 min; --skip-decode: the check only
On CPU (``--device cpu --skip-decode``) the check compares the CPU path the same way.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time

import numpy as np
import torch

from lightwell import LLM, SamplingParams
from lightwell.bench.results import record, write_json
from lightwell.kernels import gguf_dequant as gd

TINY = dict(hidden=512, inter=1536, layers=4, heads=8, kv_heads=4, vocab=4096)
LLAMA_8B = dict(hidden=4096, inter=14336, layers=32, heads=32, kv_heads=8, vocab=128256)
LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
ALL = (gd.Q4_0, gd.Q4_1, gd.Q8_0, gd.Q4_K, gd.Q5_K, gd.Q6_K)
Q4_K_M = {name: gd.Q4_K for name in LINEARS} | {"attn_v": gd.Q6_K, "ffn_down": gd.Q6_K}
# where each type keeps its fp16 scales (d, and m / dmin where it has one)
SCALES = {gd.Q4_0: (0,), gd.Q4_1: (0, 2), gd.Q8_0: (0,), gd.Q4_K: (0, 2), gd.Q5_K: (0, 2),
          gd.Q6_K: (208,)}  # fmt: skip


def mixed_types(layer: int) -> dict[str, int]:
    """Every linear of a layer a type, the types shifting a place a layer."""
    return {name: ALL[(i + layer) % len(ALL)] for i, name in enumerate(LINEARS)}


def random_blocks(rows: int, cols: int, qtype: int, rng, scale: float) -> np.ndarray:
    values, nbytes = gd.BLOCKS[qtype]
    blocks = rng.integers(0, 256, (rows, cols // values, nbytes), dtype=np.uint8)
    for off in SCALES[qtype]:
        s = rng.uniform(0.25 * scale, scale, (rows, cols // values)).astype(np.float16)
        blocks[:, :, off : off + 2] = s.view(np.uint8).reshape(rows, -1, 2)
    return blocks.reshape(rows, -1)


def write_gguf(path: str, shape: dict, types, seed: int = 0) -> None:
    """A llama GGUF of ``shape`` with random weights; ``types(layer)``: each linear's type."""
    import gguf

    h, heads, kv = shape["hidden"], shape["heads"], shape["kv_heads"]
    w = gguf.GGUFWriter(path, "llama")
    for add, value in ((w.add_block_count, shape["layers"]), (w.add_context_length, 4096),
                       (w.add_embedding_length, h), (w.add_feed_forward_length, shape["inter"]),
                       (w.add_head_count, heads), (w.add_head_count_kv, kv),
                       (w.add_rope_freq_base, 500000.0), (w.add_layer_norm_rms_eps, 1e-5),
                       (w.add_rope_dimension_count, h // heads),
                       (w.add_vocab_size, shape["vocab"]), (w.add_bos_token_id, 1),
                       (w.add_eos_token_id, 2)):  # fmt: skip
        add(value)
    rng = np.random.default_rng(seed)
    dims = {"attn_q": (h, h), "attn_k": (kv * h // heads, h), "attn_v": (kv * h // heads, h),
            "attn_output": (h, h), "ffn_gate": (shape["inter"], h),
            "ffn_up": (shape["inter"], h), "ffn_down": (h, shape["inter"])}  # fmt: skip
    w.add_tensor("token_embd.weight", _dense(rng, shape["vocab"], h))
    for i in range(shape["layers"]):
        for name, qtype in types(i).items():
            rows, cols = dims[name]
            per_q = 256 if gd.BLOCKS[qtype][0] == 256 else 8  # about sc * q, or q
            blocks = random_blocks(rows, cols, qtype, rng, 2 / cols**0.5 / per_q)
            w.add_tensor(
                f"blk.{i}.{name}.weight", blocks, raw_dtype=gguf.GGMLQuantizationType(qtype)
            )
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", np.ones(h, dtype=np.float32))
    w.add_tensor("output_norm.weight", np.ones(h, dtype=np.float32))
    w.add_tensor("output.weight", _dense(rng, shape["vocab"], h))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _dense(rng, rows: int, cols: int) -> np.ndarray:  # [rows, cols] fp16, std 1 / sqrt(cols)
    return (rng.standard_normal((rows, cols), dtype=np.float32) / cols**0.5).astype(np.float16)


def engine(path: str, device: str, dtype: str, **opts) -> LLM:
    return LLM(path, device=device, dtype=dtype, skip_tokenizer_init=True, max_num_seqs=8,
               num_kv_blocks=512, max_model_len=1024, **opts)  # fmt: skip


def release(llm: LLM) -> None:
    llm.shutdown()
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def prompts(n: int, length: int, vocab: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(3, vocab, (length,), generator=g).tolist()}
            for _ in range(n)]  # fmt: skip


def check(folder: str, device: str) -> dict:
    """Greedy tokens of the kernels' path against the file dequantized at load."""
    path = os.path.join(folder, "tiny.gguf")
    write_gguf(path, TINY, mixed_types)
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, detokenize=False)
    ps = prompts(4, 37, TINY["vocab"], 1)
    ps[1]["prompt_token_ids"] = ps[1]["prompt_token_ids"][:5]
    runs = {}
    for quant in ("gguf", "auto"):
        llm = engine(path, device, "float32", quantization=quant)
        outs = llm.generate(ps, sp, use_tqdm=False)
        runs[quant] = [o.outputs[0].token_ids for o in outs]
        release(llm)
    same = sum(a == b for a, b in zip(runs["gguf"], runs["auto"]))
    match = sum(x == y for a, b in zip(runs["gguf"], runs["auto"]) for x, y in zip(a, b)) / 96
    return dict(model="tiny-llama mixed types", device=device, dtype="float32",
                sequences_identical=f"{same}/4", token_match=match)  # fmt: skip


def tpot_ms(llm: LLM, batch: int, vocab: int, new: int = 128) -> float:
    """ms per output token of a batch of 32-token prompts: (t(new + 1) - t(1)) / new."""
    ps = prompts(batch, 32, vocab, batch)

    def run(n: int) -> float:
        sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
        t0 = time.perf_counter()
        llm.generate(ps, sp, use_tqdm=False)
        return time.perf_counter() - t0

    run(new + 1)  # warm
    return 1e3 * (min(run(new + 1) for _ in range(2)) - min(run(1) for _ in range(2))) / new


def decode(folder: str) -> list[dict]:
    path = os.path.join(folder, "llama-3-8b-q4_k_m.gguf")
    t0 = time.perf_counter()
    write_gguf(path, LLAMA_8B, lambda layer: Q4_K_M)
    size, written = os.path.getsize(path), time.perf_counter() - t0
    print(f"wrote {size / 2**30:.2f} GiB in {written:.0f} s", flush=True)
    rows = []
    for weights, opts in (("gguf Q4_K_M", dict(quantization="gguf")),
                          ("dense bf16", dict(load_format="dummy"))):  # fmt: skip
        llm = engine(path, "cuda", "bfloat16", **opts)
        for batch in (1, 8):
            ms = tpot_ms(llm, batch, LLAMA_8B["vocab"])
            row = dict(model="llama-3-8b shapes", weights=weights, batch=batch, file_bytes=size)
            print(json.dumps({**row, "tpot_ms": round(ms, 3)}), flush=True)
            rows.append(record("tpot_ms", ms, **row))
        release(llm)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write the rows as a JSON results file")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--skip-decode", action="store_true", help="only the tiny model's check")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="gguf_e2e") as folder:
        result = check(folder, args.device)
        print(json.dumps(result), flush=True)
        rows = [record("greedy_token_match", result["token_match"], **result)]
        if not args.skip_decode:
            rows += decode(folder)
    if args.out:
        write_json(args.out, rows)
    return 0 if result["sequences_identical"] == "4/4" else 1


if __name__ == "__main__":
    raise SystemExit(main())
