"""Incremental detokenization of one sequence: streamed text deltas and stop strings. No torch here.

Text is decoded token by token with a prefix/read-offset window (``tokenizers``' ``DecodeStream``
for fast tokenizers), so a character split across tokens appears only once complete and the
output never holds a spurious U+FFFD. Stop strings are searched in the newly extended tail, so
they match across token boundaries; while unfinished, ``get_delta`` holds back the last
``len(longest stop) - 1`` characters so a streamed client never sees a partial stop string.
"""

from __future__ import annotations

from typing import Any

from lightwell.engine.tokenizer import Tokenizer
from lightwell.types import SamplingParams

_REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens primed into the decode window, so the first output token decodes in context.
_MIN_PRIME_TOKENS = 4
_MAX_PRIME_TOKENS = 24


class IncrementalDetokenizer:
    """Turns one sequence's output tokens into text as they arrive."""

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        if not params.detokenize and params.stop:
            raise ValueError("stop strings need detokenize=True")
        self._enabled = params.detokenize
        self._stop: list[str] = list(params.stop or [])
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        longest = max((len(s) for s in self._stop), default=0)
        self._holdback = 0 if self._include_stop else max(longest - 1, 0)
        self._text = ""
        self._num_sent = 0  # characters of _text already returned by get_delta
        self._num_tokens = 0  # output tokens seen
        self.stop_string: str | None = None  # the stop string that ended the text, if any
        self._stream: _DecodeWindow | None = None
        if self._enabled:
            self._stream = _DecodeWindow(tokenizer, params.skip_special_tokens)
            self._stream.prime(_prompt_suffix(tokenizer, prompt_token_ids))

    @property
    def output_text(self) -> str:
        """The text so far; after a stop string matched, cut before it (or kept through it)."""
        return self._text

    @property
    def stopped(self) -> bool:
        """True once a stop string matched: later updates are ignored."""
        return self.stop_string is not None

    def update(self, new_token_ids: list[int], stop_terminated: bool = False) -> str | None:
        """Append sampled tokens; return the stop string that matched, or None.

        ``stop_terminated``: the last of ``new_token_ids`` is the EOS or a stop token id that
        ends the sequence; its text is left out unless ``include_stop_str_in_output``.
        """
        self._num_tokens += len(new_token_ids)
        if self._stream is None or self.stopped:
            return None
        if stop_terminated and not self._include_stop:
            new_token_ids = new_token_ids[:-1]
        old_len = len(self._text)
        pieces = [self._stream.step(t) for t in new_token_ids]
        self._text += "".join(p for p in pieces if p)
        if not self._stop or self._num_tokens <= self._min_tokens or len(self._text) == old_len:
            return None
        return self._check_stop(old_len)

    def get_delta(self, finished: bool) -> str:
        """Text not returned yet; while unfinished the possible start of a stop string is held."""
        end = len(self._text)
        if not finished and not self.stopped:
            end = max(self._num_sent, end - self._holdback)
        delta = self._text[self._num_sent : end]
        self._num_sent = max(self._num_sent, end)
        return delta

    def _check_stop(self, old_len: int) -> str | None:
        match = find_stop_string(self._text, old_len, self._stop)
        if match is None:
            return None
        start, stop = match
        self._text = self._text[: start + len(stop) if self._include_stop else start]
        self.stop_string = stop
        return stop


def find_stop_string(text: str, old_len: int, stops: list[str]) -> tuple[int, str] | None:
    """The first stop string to complete in ``text[old_len:]``: (start index, stop string).

    Only matches that end in the new tail are found (earlier text was searched before), so a stop
    string split across tokens is caught. The match that completes first wins (the one a
    character-by-character stream would hit first); on a tie, the longer one.
    """
    best: tuple[int, int, str] | None = None  # (end, start, stop)
    for stop in stops:
        start = text.find(stop, max(0, old_len - len(stop) + 1))
        if start < 0:
            continue
        cand = (start + len(stop), start, stop)
        if best is None or cand[:2] < best[:2]:
            best = cand
    return None if best is None else (best[1], best[2])


def _prompt_suffix(tokenizer: Tokenizer, prompt_token_ids: list[int]) -> list[int]:
    """A short tail of the prompt that decodes cleanly (no partial character at its start)."""
    n = len(prompt_token_ids)
    if n <= _MIN_PRIME_TOKENS:
        return list(prompt_token_ids)
    for i in range(_MIN_PRIME_TOKENS, min(n, _MAX_PRIME_TOKENS) + 1):
        suffix = prompt_token_ids[-i:]
        if _REPLACEMENT_CHAR not in tokenizer.decode(suffix, skip_special_tokens=False):
            return list(suffix)
    return list(prompt_token_ids[-_MIN_PRIME_TOKENS:])


class _DecodeWindow:
    """Token-by-token decoding: returns each token's new text once it is complete UTF-8.

    Fast tokenizers use ``tokenizers.decoders.DecodeStream``; slow ones the same prefix/read
    offset algorithm over ``Tokenizer.decode``.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._backend = tokenizer.backend
        self._stream: Any = self._new_stream()
        self._ids: list[int] = []  # slow path: the window [prefix_offset:]
        self._prefix_len = 0  # slow path: tokens of the window already emitted

    def prime(self, token_ids: list[int]) -> None:
        """Feed context tokens whose text is not part of the output."""
        for t in token_ids:
            self.step(t)

    def step(self, token_id: int) -> str | None:
        if self._stream is None:
            return self._slow_step(token_id)
        try:
            return self._stream.step(self._backend, token_id)
        except Exception:
            # DecodeStream can reject a window whose text is not a prefix of the extended one
            # (non-monotonic decoders): restart the stream from this token.
            self._stream = self._new_stream()
            return self._stream.step(self._backend, token_id)

    def _new_stream(self) -> Any:
        if self._backend is None:
            return None
        from tokenizers.decoders import DecodeStream

        return DecodeStream(skip_special_tokens=self._skip)

    def _slow_step(self, token_id: int) -> str | None:
        self._ids.append(token_id)
        prefix = self._tokenizer.decode(self._ids[: self._prefix_len], self._skip)
        text = self._tokenizer.decode(self._ids, self._skip)
        if len(text) <= len(prefix) or text.endswith(_REPLACEMENT_CHAR):
            return None
        new_text = text[len(prefix) :]
        self._ids = self._ids[self._prefix_len :]
        self._prefix_len = len(self._ids)
        return new_text
