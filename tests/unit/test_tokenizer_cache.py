"""engine/tokenizer_cache.py: GGUF tokenizers saved once, loaded from disk after, the same."""

from __future__ import annotations

import os

import pytest

from lightwell.engine import tokenizer_cache as tc
from lightwell.engine.tokenizer import Tokenizer, _load_hf_tokenizer
from lightwell.model_files import resolve_model

TEXTS = [
    "Hello, world!",
    "  spaces\tand\nlines ",
    "émoji 🌊 日本語",
    "<|im_start|>user\nHi<|im_end|>",
]


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path


@pytest.fixture(scope="module")
def smollm2():
    files = resolve_model(None)
    st = os.stat(files.path)
    built = Tokenizer.load(files).hf  # the process's GGUF build (shared with other tests)
    return files.path, st.st_mtime_ns, st.st_size, built


def test_gguf_tokenizer_saved_once_then_loaded_the_same(cache, smollm2):
    path, mtime, size, built = smollm2
    first = tc.cached_tokenizer(path, mtime, size, lambda: built)
    assert first is built
    entry = tc.entry(path, mtime, size)
    assert entry.startswith(str(cache)) and os.path.isfile(os.path.join(entry, "tokenizer.json"))
    loaded = tc.cached_tokenizer(path, mtime, size, lambda: pytest.fail("built again"))
    a, b = Tokenizer(built), Tokenizer(loaded)
    for text in TEXTS:
        assert a.encode(text) == b.encode(text)
    ids = list(range(0, len(built), 53))
    assert a.decode(ids) == b.decode(ids)
    assert (a.eos_token_id, a.bos_token_id, a.all_special_ids, a.vocab_size) == (
        b.eos_token_id, b.bos_token_id, b.all_special_ids, b.vocab_size)  # fmt: skip
    chat = [{"role": "user", "content": "Hi"}]
    assert a.apply_chat_template(chat) == b.apply_chat_template(chat)
    assert tc.entry(path, mtime + 1, size) != entry  # a changed file: another entry


def test_damaged_entry_is_built_again(cache, smollm2):
    path, mtime, size, built = smollm2
    entry = tc.entry(path, mtime, size)
    os.makedirs(entry)
    with open(os.path.join(entry, "tokenizer.json"), "w") as f:
        f.write("{not json")
    calls = []
    tok = tc.cached_tokenizer(path, mtime, size, lambda: calls.append(1) or built)
    assert calls == [1] and tok is built
    assert tc.cached_tokenizer(path, mtime, size, lambda: pytest.fail("built again")) is not None


def test_unwritable_cache_still_gives_the_tokenizer(tmp_path, monkeypatch, smollm2):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # a file: no folder under it
    path, mtime, size, built = smollm2
    assert tc.cached_tokenizer(path, mtime, size, lambda: built) is built


def test_prune_keeps_the_newest(cache):
    root = tc.cache_root()
    for i in range(tc.KEEP + 3):
        os.makedirs(os.path.join(root, f"e{i:02d}"))
        os.utime(os.path.join(root, f"e{i:02d}"), (1000 + i, 1000 + i))
    os.makedirs(os.path.join(root, "e99.tmp123"))  # a partial entry from long ago
    os.utime(os.path.join(root, "e99.tmp123"), (1, 1))
    tc._prune(root)
    assert sorted(os.listdir(root)) == [f"e{i:02d}" for i in range(3, tc.KEEP + 3)]


def test_the_engine_loads_gguf_tokenizers_through_the_cache(cache, monkeypatch, smollm2):
    """_load_hf_tokenizer's GGUF path goes through the cache (as a fresh process would)."""
    from lightwell.engine import tokenizer as tk

    path, mtime, size, built = smollm2
    tc.cached_tokenizer(path, mtime, size, lambda: built)  # the entry, without a second build
    files = resolve_model(None)
    seen = []
    real = tc.cached_tokenizer
    monkeypatch.setattr(tc, "cached_tokenizer", lambda *a: seen.append(a[0]) or real(*a))
    tk._gguf_tokenizer.cache_clear()
    try:
        assert _load_hf_tokenizer(files) is not None
    finally:
        tk._gguf_tokenizer.cache_clear()
    assert seen == [os.path.abspath(files.path)]
