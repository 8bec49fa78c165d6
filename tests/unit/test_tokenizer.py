from __future__ import annotations

import pytest

from lightwell.engine.tokenizer import Tokenizer
from lightwell.model_files import ModelFiles, resolve_model

TEXTS = [
    "Hello, world!",
    "  leading and trailing spaces  ",
    "line one\nline two\n\n\tindented\r\nwindows",
    "héllo naïve café — “quotes” ½ ∑ ∞",
    "日本語のテキスト、中文文本，한국어",
    "emoji 🎉🚀 skin 👍🏽 family 👨‍👩‍👧 flag 🇫🇷",
    "code: def f(x):\n    return x ** 2  # ok",
]

SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.load(resolve_model(None))


def test_special_ids_of_smollm2(tok):
    assert tok.eos_token_id == 2
    assert tok.id_to_piece(2) == "<|im_end|>"
    assert tok.bos_token_id == 1
    assert {0, 1, 2} <= set(tok.all_special_ids)
    assert tok.vocab_size == len(tok.hf) == len(tok) == 49152


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert ids and all(isinstance(i, int) for i in ids)
    assert tok.decode(ids) == text


def test_decode_skips_special_tokens_on_request(tok):
    ids = [1] + tok.encode("hi") + [2]
    assert tok.decode(ids) == "hi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>hi<|im_end|>"


def test_id_to_piece_is_one_token_text(tok):
    hello, world = tok.encode("hello world")
    assert tok.id_to_piece(hello) == "hello"
    assert tok.id_to_piece(world) == " world"


def test_chat_template_renders_smollm2_prompt(tok):
    messages = [{"role": "user", "content": "What is 2+2?"}]
    text = tok.render_chat_template(messages)
    assert text == (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tok.apply_chat_template(messages)
    assert isinstance(ids, list) and all(isinstance(i, int) for i in ids)
    assert ids == tok.encode(text, add_special_tokens=False)
    assert ids[0] == 1 and ids.count(1) == 3 and ids.count(2) == 2
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_chat_template_options(tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tok.render_chat_template(messages, add_generation_prompt=False)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    custom = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    ids = tok.apply_chat_template(messages, chat_template=custom)
    assert tok.decode(ids) == "[system] Be brief.\n[user] Hi\n"


class _NoTemplate:
    chat_template = None
    all_special_ids: list[int] = []

    def __len__(self) -> int:
        return 0


def test_missing_chat_template_is_a_clear_error():
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(_NoTemplate()).apply_chat_template([{"role": "user", "content": "hi"}])


def test_load_errors_are_clear(tmp_path):
    files = ModelFiles("gguf", "/nonexistent/model.gguf", "x")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Tokenizer.load(files, tokenizer_path=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="could not load a tokenizer"):
        Tokenizer.load(ModelFiles("hf", str(tmp_path), "empty"))


def test_loading_the_gguf_again_gives_an_equal_copy(tok):
    """The second load in a process copies the first (no re-parse): same behaviour, own object."""
    again = Tokenizer.load(resolve_model(None))
    assert again.hf is not tok.hf and again.backend is not tok.backend
    assert again.vocab_size == tok.vocab_size and again.all_special_ids == tok.all_special_ids
    assert (again.eos_token_id, again.bos_token_id) == (tok.eos_token_id, tok.bos_token_id)
    for text in TEXTS:
        assert again.encode(text) == tok.encode(text)
    chat = [{"role": "user", "content": TEXTS[3]}]
    assert again.apply_chat_template(chat) == tok.apply_chat_template(chat)
    assert again.render_chat_template(chat) == tok.render_chat_template(chat)
