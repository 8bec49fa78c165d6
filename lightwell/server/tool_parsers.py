"""Tool-call parsers: a model's text -> content and OpenAI tool calls, one per output format.

- ``hermes`` (Hermes, Qwen2.5, Qwen3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  once per call, after optional content.
- ``llama3_json`` (Llama 3.1+): the whole output is ``{"name": ..., "parameters": {...}}``
  (optionally after ``<|python_tag|>``; several calls separated by ``;``).
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``, or the newer
  ``[TOOL_CALLS]name[ARGS]{...}`` per call.

A parser never fails: text that does not hold well-formed calls is returned as content.
``choose_parser("auto", template)`` picks the format the chat template writes, if it names one.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ParsedToolCall:
    name: str
    arguments: str  # JSON text


@dataclass
class ParsedOutput:
    content: str | None
    tool_calls: list[ParsedToolCall] = field(default_factory=list)


def _call(obj: Any, args_keys: tuple[str, ...] = ("arguments",)) -> ParsedToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):  # already JSON text: keep it only if it parses
        try:
            json.loads(args)
        except ValueError:
            return None
        return ParsedToolCall(obj["name"], args)
    return ParsedToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _calls(objs: list[Any], args_keys: tuple[str, ...] = ("arguments",)) -> list[ParsedToolCall]:
    calls = [_call(o, args_keys) for o in objs]
    return [] if not calls or any(c is None for c in calls) else calls  # type: ignore[misc]


def _content(text: str) -> str | None:
    return text.strip() or None


class HermesParser:
    name = "hermes"
    start_markers = ("<tool_call>",)
    needs_special_tokens = False
    _pattern = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)

    def parse(self, text: str) -> ParsedOutput:
        start = text.find("<tool_call>")
        if start < 0:
            return ParsedOutput(text)
        try:
            objs = [json.loads(m.group(1)) for m in self._pattern.finditer(text, start)]
        except ValueError:
            return ParsedOutput(text)
        calls = _calls(objs)
        return ParsedOutput(_content(text[:start]), calls) if calls else ParsedOutput(text)


class Llama3JsonParser:
    name = "llama3_json"
    start_markers = ("<|python_tag|>", "{")
    needs_special_tokens = True

    def parse(self, text: str) -> ParsedOutput:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return ParsedOutput(text)
        decoder, objs, i = json.JSONDecoder(), [], 0
        try:
            while i < len(body):
                obj, i = decoder.raw_decode(body, i)
                objs.append(obj)
                i = len(body) - len(body[i:].lstrip().removeprefix(";").lstrip())
        except ValueError:
            return ParsedOutput(text)
        calls = _calls(objs, ("parameters", "arguments"))
        return ParsedOutput(None, calls) if calls else ParsedOutput(text)


class MistralParser:
    name = "mistral"
    start_markers = ("[TOOL_CALLS]",)
    needs_special_tokens = True
    _args = re.compile(r"\s*([A-Za-z0-9_.\-]+)\s*\[ARGS\]")

    def parse(self, text: str) -> ParsedOutput:
        start = text.find("[TOOL_CALLS]")
        if start < 0:
            return ParsedOutput(text)
        body = text[start + len("[TOOL_CALLS]") :].strip()
        try:
            calls = self._list(body) if body.startswith("[") else self._args_form(body)
        except ValueError:
            calls = []
        return ParsedOutput(_content(text[:start]), calls) if calls else ParsedOutput(text)

    @staticmethod
    def _list(body: str) -> list[ParsedToolCall]:
        objs, _ = json.JSONDecoder().raw_decode(body)
        return _calls(objs if isinstance(objs, list) else [objs])

    def _args_form(self, body: str) -> list[ParsedToolCall]:
        decoder, calls, i = json.JSONDecoder(), [], 0
        while i < len(body):
            m = self._args.match(body, i)
            if m is None:
                raise ValueError("not name[ARGS]{...}")
            args, i = decoder.raw_decode(body, m.end())
            calls += _calls([{"name": m.group(1), "arguments": args}])
            i = len(body) - len(body[i:].lstrip().removeprefix("[TOOL_CALLS]").lstrip())
        return calls


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
