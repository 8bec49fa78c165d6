"""Loading a checkpoint from object storage: sequential (one connection) against parallel ranged
GETs, over a local S3 API server (moto's, in its own process, on 127.0.0.1), and the greedy
tokens of each load against a local load of the same files.

    python3 -m benchmarks.workloads.load_s3 --size-gb 2 --out benchmarks/results/load_s3.json

The checkpoint is a random bf16 Llama of about --size-gb (layers scaled to fit) in shards of
--shard-mb. Two timings per connection count: the transfer alone (every shard read into host
memory) and the whole `LLM(...)` start-up (model built, weights loaded). moto reads the whole
object for every ranged GET, so on this server small shards keep the range overhead down; a
real store (S3, MinIO) serves ranges directly.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
import urllib.request

import torch

from lightwell.bench.results import make_record, provenance, write_json

HIDDEN, INTER, VOCAB, HEADS, KV_HEADS = 2048, 5632, 32000, 16, 4
PROMPT = [{"prompt_token_ids": [11, 523, 88, 9041, 17, 250, 3]}]


def layer_tensors(i: int) -> dict[str, tuple[int, ...]]:
    kv = HIDDEN // HEADS * KV_HEADS
    p = f"model.layers.{i}."
    return {
        p + "self_attn.q_proj.weight": (HIDDEN, HIDDEN),
        p + "self_attn.k_proj.weight": (kv, HIDDEN),
        p + "self_attn.v_proj.weight": (kv, HIDDEN),
        p + "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
        p + "mlp.gate_proj.weight": (INTER, HIDDEN),
        p + "mlp.up_proj.weight": (INTER, HIDDEN),
        p + "mlp.down_proj.weight": (HIDDEN, INTER),
        p + "input_layernorm.weight": (HIDDEN,),
        p + "post_attention_layernorm.weight": (HIDDEN,),
    }


def make_checkpoint(folder: str, size_gb: float, shard_mb: int) -> int:
    """A random bf16 Llama of about ``size_gb`` in ``shard_mb`` shards; returns its bytes."""
    from safetensors.torch import save_file

    per_layer = sum(torch.Size(s).numel() for s in layer_tensors(0).values()) * 2
    layers = max(1, round((size_gb * 1e9 - 2 * VOCAB * HIDDEN * 2) / per_layer))
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "lm_head.weight": (VOCAB, HIDDEN)}
    for i in range(layers):
        shapes.update(layer_tensors(i))
    shapes["model.norm.weight"] = (HIDDEN,)
    gen = torch.Generator().manual_seed(0)
    shards, current, size, total = [], {}, 0, 0
    for name, shape in shapes.items():
        t = (1.0 if name.endswith("norm.weight") else 0.02) * torch.randn(shape, generator=gen)
        current[name] = t.to(torch.bfloat16)
        size += current[name].numel() * 2
        if size >= shard_mb << 20:
            shards.append(current)
            current, total, size = {}, total + size, 0
    shards.append(current)
    total += size
    weight_map = {}
    for k, tensors in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, os.path.join(folder, fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, fname))
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    config = dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=HIDDEN,
        intermediate_size=INTER, num_hidden_layers=layers, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, vocab_size=VOCAB, max_position_embeddings=2048,
        rms_norm_eps=1e-5, rope_theta=10000.0, torch_dtype="bfloat16",
        tie_word_embeddings=False,
    )  # fmt: skip
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return total


def start_moto(port: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    for _ in range(300):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/moto-api/", timeout=1)
            return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("the moto server did not start")


def greedy(llm) -> list[int]:
    from lightwell import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    return llm.generate(PROMPT, sp, use_tqdm=False)[0].outputs[0].token_ids


def timed_load(model: str, **kw) -> tuple[float, list[int]]:
    from lightwell import LLM

    engine = dict(dtype="float32", device="cpu", skip_tokenizer_init=True, num_kv_blocks=8)
    t0 = time.perf_counter()
    llm = LLM(model, **engine, **kw)
    seconds = time.perf_counter() - t0
    tokens = greedy(llm)
    del llm
    gc.collect()
    return seconds, tokens


def transfer_seconds(uri: str, endpoint: str, connections: int) -> float:
    from lightwell.storage.object_store import ObjectStore, StoreOptions

    store = ObjectStore(uri, StoreOptions(endpoint, connections))
    objs = [o for n, o in sorted(store.list().items()) if n.endswith(".safetensors")]
    t0 = time.perf_counter()
    for obj in objs:
        store.read(obj)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-gb", type=float, default=2.0)
    ap.add_argument("--shard-mb", type=int, default=128)
    ap.add_argument("--connections", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--out", default="benchmarks/results/load_s3.json")
    args = ap.parse_args()
    for k, v in {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench"}.items():
        os.environ.setdefault(k, v)
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    from tests.models.s3_server import client, free_port, upload_folder

    port = free_port()
    endpoint, uri = f"http://127.0.0.1:{port}", "s3://bench/llama"
    proc = start_moto(port)
    try:
        with tempfile.TemporaryDirectory() as folder:
            nbytes = make_checkpoint(folder, args.size_gb, args.shard_mb)
            s3 = client(endpoint)
            s3.create_bucket(Bucket="bench")
            upload_folder(s3, folder, "bench", "llama")
            rows = run(args, folder, uri, endpoint, nbytes)
    finally:
        proc.terminate()
        proc.wait()
    write_json(args.out, rows)


def run(args: argparse.Namespace, folder: str, uri: str, endpoint: str, nbytes: int) -> list:
    common = {**provenance("cpu"), "checkpoint_bytes": nbytes, "shard_mb": args.shard_mb}
    common["command"] = shlex.join(["python3", "-m", "benchmarks.workloads.load_s3", *sys.argv[1:]])
    local_s, local_tokens = timed_load(folder)
    rows = [make_record("load_local_s", local_s, common, tokens=local_tokens)]
    print(f"local load {local_s:.1f}s tokens {local_tokens}")
    for c in args.connections:
        xfer = transfer_seconds(uri, endpoint, c)
        load_s, tokens = timed_load(uri, s3_endpoint_url=endpoint, s3_max_connections=c)
        same = tokens == local_tokens
        print(f"{c} connection(s): transfer {xfer:.1f}s ({nbytes / xfer / 1e9:.2f} GB/s), "
              f"load {load_s:.1f}s, tokens identical to local: {same}")  # fmt: skip
        extra = dict(connections=c, tokens=tokens, tokens_match_local=same)
        rows.append(make_record("s3_transfer_s", xfer, common, **extra))
        rows.append(make_record("s3_transfer_gb_per_s", nbytes / xfer / 1e9, common, **extra))
        rows.append(make_record("load_s3_s", load_s, common, **extra))
    for row in rows:  # the machine's load while it ran (shared machines skew the timings)
        row["load_average_1m_end"] = round(os.getloadavg()[0], 2)
    return rows


if __name__ == "__main__":
    main()
