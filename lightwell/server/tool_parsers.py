"""Tool-call parsers: a model's text -> content and OpenAI tool calls, one per output format.

- ``hermes`` (Hermes, Qwen2.5, Qwen3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  once per call, after optional content.
- ``llama3_json`` (Llama 3.1+): the whole output is ``{"name": ..., "parameters": {...}}``
  (optionally after ``<|python_tag|>``; several calls separated by ``;``).
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``, or the newer
  ``[TOOL_CALLS]name[ARGS]{...}`` per call.

A parser never fails: text that does not hold well-formed calls is returned as content. A call's
``arguments`` are the JSON text the model wrote. Each format is a ``Splitter`` over the growing
text (``tool_call_scan``): the whole-text ``parse`` and the streamed deltas share it.
``choose_parser("auto", template)`` picks the format the chat template writes, if it names one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from lightwell.server.tool_call_scan import Call, marker_hold, skip_space


@dataclass
class ParsedToolCall:
    name: str
    arguments: str  # JSON text


@dataclass
class ParsedOutput:
    content: str | None
    tool_calls: list[ParsedToolCall] = field(default_factory=list)


class Splitter:
    """One choice's text, as it grows: content up to ``content_end``, then ``calls``. A format
    says where its first call starts (``_start``) and where each next one does (``_next``)."""

    markers: tuple[str, ...] = ()

    def __init__(self, args_keys: tuple[str, ...] = ("arguments",)) -> None:
        self.args_keys = args_keys
        self.calls: list[Call] = []
        self.content_end: int | None = None  # fixed once the first call's start is found
        self.state = "content"  # content, calls, done (no more calls), plain (never calls)
        self.bad = False  # what followed the calls is not the format: the text is content
        self.pos = 0

    def feed(self, text: str) -> None:
        if self.state == "content":
            self._start(text)
        while self.state == "calls":
            if self.calls and not self.calls[-1].closed:
                self.calls[-1].scan.feed(text)
                if not self.calls[-1].closed:
                    return
                self.pos = self.calls[-1].scan.end
            call = self._next(text, skip_space(text, self.pos))
            if call is None:
                return
            self.calls.append(call)

    def content_hold(self, text: str) -> int:
        """Where the content may be sent up to while the text grows."""
        if self.content_end is not None:
            return self.content_end
        return len(text) if self.state == "plain" else marker_hold(text, 0, self.markers)

    def finish(self, text: str) -> None:
        """The text is complete: what it ends with is checked."""

    def _start(self, text: str) -> None:
        found = [p for p in (text.find(m) for m in self.markers) if p >= 0]
        if found:
            self.content_end = self.pos = min(found)
            self.state = "calls"

    def _next(self, text: str, i: int) -> Call | None:
        raise NotImplementedError

    def _object(self, text: str, i: int) -> Call | None:
        """A call's JSON object at ``i`` (None: more text needed, or not an object: bad)."""
        if i < len(text) and text[i] == "{":
            return Call(i, self.args_keys)
        if i < len(text):
            self._stop(bad=True)
        return None

    def _stop(self, bad: bool = False) -> None:
        self.state, self.bad = "done", self.bad or bad


class HermesSplitter(Splitter):
    markers = ("<tool_call>",)

    def _next(self, text: str, i: int) -> Call | None:
        at = text.find("<tool_call>", i)  # anything between calls is left out
        return None if at < 0 else self._object(text, skip_space(text, at + len("<tool_call>")))


class Llama3Splitter(Splitter):
    """The whole output is calls: ``<|python_tag|>`` (optional), then objects, ``;`` between."""

    markers = ("<|python_tag|>",)

    def _start(self, text: str) -> None:
        head = skip_space(text, 0)
        if text.startswith("<|python_tag|>", head):
            head = skip_space(text, head + len("<|python_tag|>"))
        elif "<|python_tag|>".startswith(text[head:]):
            return  # all blank so far, or the tag's beginning
        if head == len(text):
            return
        if text[head] != "{":
            self.state = "plain"
            return
        self.content_end, self.pos, self.state = 0, head, "calls"

    def content_hold(self, text: str) -> int:
        return len(text) if self.state == "plain" else 0

    def _next(self, text: str, i: int) -> Call | None:
        if not self.calls:
            return self._object(text, i)
        if i < len(text) and text[i] == ";":
            i = skip_space(text, i + 1)
        return self._object(text, i)


class ListSplitter(Splitter):
    """A JSON list of call objects at ``pos``: ``[{...}, {...}]``."""

    def _next(self, text: str, i: int) -> Call | None:
        if i >= len(text):
            return None
        expected = "[" if not self.calls else ","
        if text[i] == "]" and self.calls:
            self._stop()
            return None
        if text[i] != expected:
            self._stop(bad=True)
            return None
        return self._object(text, skip_space(text, i + 1))

    def finish(self, text: str) -> None:
        if self.state != "done":  # the list never closed
            self.bad = True


class RequiredSplitter(ListSplitter):
    """``tool_choice: "required"``: the whole output is the list (constrained by its schema)."""

    def __init__(self) -> None:
        super().__init__(("parameters",))
        self.content_end, self.state = 0, "calls"


class MistralSplitter(Splitter):
    """``[TOOL_CALLS]`` then a JSON list of calls, or ``name[ARGS]{...}`` per call."""

    markers = ("[TOOL_CALLS]",)
    _args = re.compile(r"([A-Za-z0-9_.\-]+)\s*\[ARGS\]\s*")
    _args_prefix = re.compile(r"[A-Za-z0-9_.\-]*\s*(\[(A(R(G(S\]?)?)?)?)?)?")

    def __init__(self) -> None:
        super().__init__()
        self._list: ListSplitter | None = None  # the list form, once seen

    def _start(self, text: str) -> None:
        super()._start(text)
        if self.state == "calls":
            self.pos += len("[TOOL_CALLS]")

    def feed(self, text: str) -> None:
        if self._list is None:
            super().feed(text)
        if self._list is not None:
            self._list.feed(text)
            self.state, self.bad = self._list.state, self._list.bad

    def _next(self, text: str, i: int) -> Call | None:
        if not self.calls and text.startswith("[", i):
            self._list = ListSplitter()
            self._list.calls, self._list.pos, self._list.state = self.calls, i, "calls"
            return None
        if self.calls and text.startswith("[TOOL_CALLS]", i):
            i = skip_space(text, i + len("[TOOL_CALLS]"))
        m = self._args.match(text, i)
        if m is not None and m.end() < len(text):
            return Call(m.end(), self.args_keys, name=m.group(1))
        rest = text[i:]
        if m is None and not (
            "[TOOL_CALLS]".startswith(rest) or self._args_prefix.fullmatch(rest) is not None
        ):
            self._stop(bad=True)
        return None

    def finish(self, text: str) -> None:
        if self._list is not None:
            self._list.finish(text)
            self.bad = self._list.bad
        elif self.state == "calls" and skip_space(text, self.pos) < len(text):
            self.bad = True  # text after the last call that is not another call


def parse_with(splitter: Splitter, text: str) -> ParsedOutput:
    """The finished text through ``splitter``: its calls if every one is well formed, else
    all of it as content."""
    splitter.feed(text)
    splitter.finish(text)
    calls = splitter.calls
    if splitter.bad or not calls or not all(c.valid(text) for c in calls):
        return ParsedOutput(text)
    content = _content(text[: splitter.content_end]) if splitter.content_end else None
    return ParsedOutput(content, [ParsedToolCall(c.name(text), c.arguments(text)) for c in calls])


def _content(text: str) -> str | None:
    return text.strip() or None


class HermesParser:
    name = "hermes"
    needs_special_tokens = False

    @staticmethod
    def splitter() -> Splitter:
        return HermesSplitter()

    def parse(self, text: str) -> ParsedOutput:
        return parse_with(self.splitter(), text)


class Llama3JsonParser(HermesParser):
    name = "llama3_json"
    needs_special_tokens = True

    @staticmethod
    def splitter() -> Splitter:
        return Llama3Splitter(("parameters", "arguments"))


class MistralParser(HermesParser):
    name = "mistral"
    needs_special_tokens = True

    @staticmethod
    def splitter() -> Splitter:
        return MistralSplitter()


PARSERS = {p.name: p for p in (HermesParser(), Llama3JsonParser(), MistralParser())}
PARSER_CHOICES = ("auto", "none", *PARSERS)


def choose_parser(option: str, chat_template: str | None) -> Any | None:
    """The parser for ``--tool-call-parser``; ``auto`` reads the chat template (None if it
    names no known format), ``none`` turns parsing off."""
    if option == "none":
        return None
    if option != "auto":
        if option not in PARSERS:
            raise ValueError(f"unknown tool-call parser {option!r}: one of {PARSER_CHOICES}")
        return PARSERS[option]
    template = chat_template or ""
    if "<tool_call>" in template:
        return PARSERS["hermes"]
    if "[TOOL_CALLS]" in template:
        return PARSERS["mistral"]
    if "<|python_tag|>" in template or "ipython" in template:
        return PARSERS["llama3_json"]
    return None
