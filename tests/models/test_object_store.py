"""Models in object storage: loading over a real S3 API (moto's server on 127.0.0.1), parallel
ranged reads, the download cache (ETag reuse, resume) and the errors start-up stops with."""

from __future__ import annotations

import json
import os
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors.torch import load_file, save_file

from lightwell import LLM, SamplingParams
from lightwell.cli import main
from lightwell.models.safetensors_loader import tensors_from_buffer
from lightwell.storage import object_store
from lightwell.storage.object_store import ObjectStore, ObjectStoreError, StoreOptions
from lightwell.storage.remote import cache_folder, download_model
from tests.models import s3_server
from tests.models.tiny import hf_tiny_model, save_hf, tiny_config

BUCKET = "models"
URI = f"s3://{BUCKET}/tiny/llama"
PROMPTS = ["w5 w17 w42 w7 w99", "w1 w2 w3"]
ENGINE = dict(dtype="float32", device="cpu", num_kv_blocks=32)


def save_word_tokenizer(folder: str, vocab_size: int) -> None:
    """A word-level tokenizer (``w0`` ... ``wN``) in the HF files an s3:// load must fetch."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{f"w{i}": i for i in range(1, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(folder, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "[UNK]"}
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)


@pytest.fixture(scope="module")
def endpoint():
    with s3_server.s3_environment(), s3_server.moto_server() as url:
        yield url


@pytest.fixture(scope="module")
def s3(endpoint):
    return s3_server.client(endpoint)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, s3) -> str:
    """A sharded tiny Llama (index + several shards), uploaded under URI."""
    torch.set_num_threads(1)
    config = tiny_config()
    folder = save_hf(hf_tiny_model(config), str(tmp_path_factory.mktemp("tiny")), "150KB")
    save_word_tokenizer(folder, config.vocab_size)
    assert os.path.isfile(os.path.join(folder, "model.safetensors.index.json"))
    s3.create_bucket(Bucket=BUCKET)
    s3_server.upload_folder(s3, folder, BUCKET, "tiny/llama")
    return folder


@pytest.fixture(scope="module")
def local_tokens(tiny_folder) -> list[list[int]]:
    return _greedy(LLM(tiny_folder, **ENGINE))


def _greedy(llm: LLM) -> list[tuple[list[int], str]]:
    """Token ids and text: the text needs the tokenizer files that came with the model."""
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    return [(o.outputs[0].token_ids, o.outputs[0].text) for o in outs]


def _shards(folder: str) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))


def test_tensors_from_buffer_matches_safetensors(tmp_path):
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "a_bf16": torch.randn(3, generator=gen).to(torch.bfloat16),  # 6 bytes: the next is
        "b_f32": torch.randn(2, 5, generator=gen),  # misaligned, copied
        "c_i64": torch.arange(7),
        "d_f16": torch.randn(4, 1, generator=gen).half(),
        "e_scalar": torch.tensor(2.5),
        "f_empty": torch.zeros(0, 3),
    }
    save_file(tensors, str(tmp_path / "x.safetensors"))
    raw = torch.frombuffer(bytearray((tmp_path / "x.safetensors").read_bytes()), dtype=torch.uint8)
    got = dict(tensors_from_buffer(raw))
    ref = load_file(str(tmp_path / "x.safetensors"))
    assert sorted(got) == sorted(ref)
    for name, t in ref.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    with pytest.raises(ValueError, match="past the file"):
        list(tensors_from_buffer(raw[: raw.numel() - 3]))


def test_s3_load_matches_local(endpoint, tiny_folder, local_tokens, monkeypatch):
    monkeypatch.setattr(object_store, "CHUNK_BYTES", 16 << 10)  # many ranged GETs per shard
    llm = LLM(URI, s3_endpoint_url=endpoint, s3_max_connections=4, **ENGINE)
    files = llm.engine.files
    assert files.remote is not None and _shards(files.path) == []  # weights never on disk
    assert all(re.fullmatch(r"(\s*w\d+)+", text) for _, text in local_tokens)
    assert _greedy(llm) == local_tokens


def test_download_cache_reuse_and_resume(endpoint, tiny_folder, s3, tmp_path, monkeypatch):
    monkeypatch.setattr(object_store, "CHUNK_BYTES", 8 << 10)
    store = ObjectStore(URI, StoreOptions(endpoint, 3, str(tmp_path)))
    obj = store.list()[_shards(tiny_folder)[0]]
    dest = str(tmp_path / obj.name)
    expected = open(os.path.join(tiny_folder, obj.name), "rb").read()

    class Interrupt:  # a download stopped after three chunks (Ctrl-C, a killed pod)
        n = 0

        def update(self, _):
            self.n += 1
            if self.n == 3:
                raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        store.download(obj, dest, Interrupt())
    kept = os.path.getsize(dest + ".partial")
    assert 0 < kept < obj.size and not os.path.exists(dest)
    assert store.download(obj, dest) == obj.size - kept  # resumed from the partial file
    assert open(dest, "rb").read() == expected
    assert store.download(obj, dest) == 0  # cached: ETag and size match
    s3.put_object(Bucket=BUCKET, Key="tiny/llama/other.bin", Body=b"x")  # another object
    with open(dest, "r+b") as f:  # same size, but the object changed: its ETag moves
        f.write(b"\0")
    s3.put_object(Bucket=BUCKET, Key=obj.key, Body=expected[:-1] + b"!")
    changed = store.list()[obj.name]
    assert changed.etag != obj.etag and store.download(changed, dest) == obj.size
    assert open(dest, "rb").read() == expected[:-1] + b"!"
    s3.put_object(Bucket=BUCKET, Key=obj.key, Body=expected)  # restore for the other tests
    s3.delete_object(Bucket=BUCKET, Key="tiny/llama/other.bin")


def test_concurrent_downloads_take_turns(endpoint, tiny_folder, tmp_path, monkeypatch):
    monkeypatch.setattr(object_store, "CHUNK_BYTES", 8 << 10)
    store = ObjectStore(URI, StoreOptions(endpoint, 2, str(tmp_path)))
    obj = store.list()[_shards(tiny_folder)[0]]
    dest = str(tmp_path / obj.name)
    with ThreadPoolExecutor(3) as pool:  # three "pods" sharing one download dir
        moved = list(pool.map(lambda _: store.download(obj, dest), range(3)))
    assert sorted(moved) == [0, 0, obj.size]
    assert open(dest, "rb").read() == open(os.path.join(tiny_folder, obj.name), "rb").read()


def test_lightwell_download_then_load(endpoint, tiny_folder, local_tokens, tmp_path, capsys):
    rc = main(["download", URI, "--download-dir", str(tmp_path), "--s3-endpoint-url", endpoint])
    assert rc == 0
    folder = capsys.readouterr().out.strip()
    assert folder == cache_folder(str(tmp_path), URI)
    for name in os.listdir(tiny_folder):
        with open(os.path.join(tiny_folder, name), "rb") as a, open(f"{folder}/{name}", "rb") as b:
            assert a.read() == b.read(), name
    mtimes = {n: os.path.getmtime(f"{folder}/{n}") for n in _shards(folder)}
    llm = LLM(URI, s3_endpoint_url=endpoint, download_dir=str(tmp_path), **ENGINE)
    assert llm.engine.files.path == folder and llm.engine.files.remote is None
    assert {n: os.path.getmtime(f"{folder}/{n}") for n in _shards(folder)} == mtimes  # reused
    assert _greedy(llm) == local_tokens


def _cli_error(capsys, *args: str) -> str:
    assert main(["download", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    return err


def test_missing_bucket_prefix_and_shard(endpoint, tiny_folder, s3, tmp_path, capsys):
    opts = ["--download-dir", str(tmp_path), "--s3-endpoint-url", endpoint]
    err = _cli_error(capsys, "s3://no-such-bucket/m", *opts)
    assert err == "lightwell: error: s3://no-such-bucket/m: bucket 'no-such-bucket' does not exist"
    assert "no objects under this prefix" in _cli_error(capsys, f"s3://{BUCKET}/nothing", *opts)
    s3_server.upload_folder(s3, tiny_folder, BUCKET, "broken/missing")
    s3.delete_object(Bucket=BUCKET, Key=f"broken/missing/{_shards(tiny_folder)[1]}")
    with pytest.raises(ObjectStoreError, match="names missing shard"):
        LLM(f"s3://{BUCKET}/broken/missing", s3_endpoint_url=endpoint, **ENGINE)


def test_bad_credentials(endpoint, tiny_folder, capsys, tmp_path):
    with s3_server.authentication_on():
        err = _cli_error(
            capsys, URI, "--download-dir", str(tmp_path), "--s3-endpoint-url", endpoint
        )
    assert "access key is not valid" in err, err
    assert s3_server.ENV["AWS_SECRET_ACCESS_KEY"] not in err


@pytest.mark.parametrize("how", ["truncated", "garbage"])
def test_corrupt_shard(endpoint, tiny_folder, s3, tmp_path, how):
    prefix = f"broken/{how}"
    s3_server.upload_folder(s3, tiny_folder, BUCKET, prefix)
    shard = _shards(tiny_folder)[0]
    data = open(os.path.join(tiny_folder, shard), "rb").read()
    bad = data[: len(data) // 2] if how == "truncated" else os.urandom(len(data))
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}/{shard}", Body=bad)
    uri = f"s3://{BUCKET}/{prefix}"
    for extra in ({}, {"download_dir": str(tmp_path)}):  # from memory, and cached on disk
        with pytest.raises(ObjectStoreError, match=f"{uri}/{shard}: corrupt or truncated"):
            LLM(uri, s3_endpoint_url=endpoint, **ENGINE, **extra)


def test_download_needs_an_s3_address(tmp_path, capsys):
    assert "takes an s3://" in _cli_error(capsys, str(tmp_path), "--download-dir", str(tmp_path))
    with pytest.raises(ObjectStoreError, match="needs --download-dir"):
        download_model(URI, StoreOptions())
