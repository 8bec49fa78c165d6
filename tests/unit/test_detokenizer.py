from __future__ import annotations

import pytest

from lightwell.engine.detokenizer import IncrementalDetokenizer, find_stop_string
from lightwell.engine.tokenizer import Tokenizer
from lightwell.model_files import resolve_model
from lightwell.types import SamplingParams

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "  spaces   and\n\nnewlines\t\ttabs \r\n",
    "héllo naïve café — “quotes” ½",
    "日本語のテキスト、中文文本，한국어 🎉🚀👍🏽 👨‍👩‍👧 🇫🇷",
    "mixed: 2+2=4 → ✓; ümlaut; 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
]
SENTENCE = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.load(resolve_model(None))


@pytest.fixture(scope="module")
def prompt(tok) -> list[int]:
    return tok.apply_chat_template([{"role": "user", "content": "Say something."}])


def stream(tok, prompt, ids, **kwargs):
    """Feed ids one at a time; return the detokenizer, deltas and the stop string if any."""
    detok = IncrementalDetokenizer(tok, prompt, SamplingParams(**kwargs))
    deltas, seen, stop = [], "", None
    for token in ids:
        stop = detok.update([token])
        deltas.append(detok.get_delta(finished=stop is not None))
        seen += deltas[-1]
        assert detok.output_text.startswith(seen)  # nothing streamed is ever taken back
        if stop is not None:
            break
    if stop is None:
        deltas.append(detok.get_delta(finished=True))
    return detok, deltas, stop


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_decode_equals_one_shot(tok, prompt, text):
    ids = tok.encode(text, add_special_tokens=False)
    detok, deltas, stop = stream(tok, prompt, ids)
    assert stop is None
    assert detok.output_text == tok.decode(ids) == text
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


def test_split_characters_are_held_until_complete(tok):
    ids = tok.encode("🎉", add_special_tokens=False)
    assert len(ids) > 1  # the emoji's bytes span several tokens
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    for token in ids[:-1]:
        detok.update([token])
        assert detok.output_text == ""
    detok.update(ids[-1:])
    assert detok.output_text == "🎉"


@pytest.mark.parametrize("skip, expected", [(True, "hi"), (False, "hi<|im_end|>")])
def test_special_tokens_follow_skip_special_tokens(tok, prompt, skip, expected):
    ids = tok.encode("hi") + [2]
    detok, deltas, _ = stream(tok, prompt, ids, skip_special_tokens=skip)
    assert detok.output_text == "".join(deltas) == expected


def test_stop_terminated_token_text_is_left_out(tok, prompt):
    params = SamplingParams(skip_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt, params)
    assert detok.update(tok.encode("hi") + [2], stop_terminated=True) is None
    assert detok.output_text == "hi"


def test_stop_string_split_across_tokens(tok, prompt):
    ids = tok.encode(SENTENCE)
    stop = "n fox j"
    assert not any(stop in tok.decode([t]) for t in ids)  # no single token holds it
    detok, deltas, found = stream(tok, prompt, ids, stop=[stop])
    assert found == stop and detok.stop_string == stop
    assert detok.output_text == "The quick brow"
    assert "".join(deltas) == "The quick brow"
    assert all(stop not in d for d in deltas)


def test_stop_string_included_on_request(tok, prompt):
    ids = tok.encode(SENTENCE)
    detok, deltas, found = stream(
        tok, prompt, ids, stop=["n fox j"], include_stop_str_in_output=True
    )
    assert found == "n fox j"
    assert detok.output_text == "".join(deltas) == "The quick brown fox j"


@pytest.mark.parametrize("one_update", [True, False])
def test_earliest_of_several_stop_strings_wins(tok, prompt, one_update):
    ids = tok.encode(SENTENCE)
    stops = ["lazy", "quick brown fox jumps", "fox", "over"]
    if one_update:
        detok = IncrementalDetokenizer(tok, prompt, SamplingParams(stop=stops))
        found = detok.update(ids)
    else:
        detok, _, found = stream(tok, prompt, ids, stop=stops)
    assert found == "fox"
    assert detok.output_text == "The quick brown "


def test_first_completed_match_wins():
    assert find_stop_string("xabcd", 0, ["abcd", "bc"]) == (2, "bc")
    assert find_stop_string("xabcd", 0, ["cd", "abcd"]) == (1, "abcd")  # tie: the longer
    assert find_stop_string("abcabc", 3, ["abc"]) == (3, "abc")  # earlier text not searched
    assert find_stop_string("abcab", 4, ["cab"]) == (2, "cab")  # straddles old and new text
    assert find_stop_string("abc", 0, ["z"]) is None


def test_deltas_hold_back_a_possible_stop_prefix(tok, prompt):
    detok = IncrementalDetokenizer(tok, prompt, SamplingParams(stop=["<END>"]))
    assert detok.update(tok.encode("Hello world")) is None
    assert detok.get_delta(finished=False) == "Hello w"  # 4 = len("<END>") - 1 held back
    assert detok.get_delta(finished=False) == ""
    assert detok.get_delta(finished=True) == "orld"
    assert detok.output_text == "Hello world"


def test_no_stop_strings_means_no_holdback(tok, prompt):
    detok = IncrementalDetokenizer(tok, prompt, SamplingParams())
    detok.update(tok.encode("Hello world"))
    assert detok.get_delta(finished=False) == "Hello world"


def test_updates_after_a_stop_are_ignored(tok, prompt):
    detok = IncrementalDetokenizer(tok, prompt, SamplingParams(stop=["fox"]))
    assert detok.update(tok.encode(SENTENCE)) == "fox"
    assert detok.stopped
    assert detok.update(tok.encode(" more")) is None
    assert detok.output_text == "The quick brown "


def test_stop_strings_wait_for_min_tokens(tok, prompt):
    ids = tok.encode("stop here, then stop again")
    detok, _, found = stream(tok, prompt, ids, stop=["stop"], min_tokens=3, max_tokens=50)
    assert found == "stop"
    assert detok.output_text == "stop here, then "


def test_detokenize_false_gives_no_text(tok, prompt):
    detok = IncrementalDetokenizer(tok, prompt, SamplingParams(detokenize=False))
    assert detok.update(tok.encode(SENTENCE)) is None
    assert detok.output_text == "" and detok.get_delta(finished=True) == ""
    with pytest.raises(ValueError, match="detokenize"):
        IncrementalDetokenizer(tok, prompt, SamplingParams(detokenize=False, stop=["x"]))


def test_first_token_decodes_in_the_prompt_context(tok):
    prompt = tok.encode("Once upon a")
    ids = tok.encode(" time there was")
    detok, deltas, _ = stream(tok, prompt, ids)
    assert detok.output_text == " time there was" == "".join(deltas)
