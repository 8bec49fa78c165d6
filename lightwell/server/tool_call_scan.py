"""Incremental reading of tool calls out of a model's growing text, shared by the whole-text
parsers and the streamed ``tool_calls`` deltas (one code path, so a call's streamed argument
deltas add up to exactly the arguments of the parsed answer).

A ``JsonScan`` follows one JSON value as its characters arrive (strings, escapes, nesting) and
records where each top-level field of an object starts and ends. A ``Splitter`` (one per output
format, in ``tool_parsers``) finds where the content ends and where each call's JSON begins;
a ``Call`` reads its name and the raw text of its arguments from its scan. The arguments are
the model's own JSON text (a JSON string value: its decoded text), never re-serialized.
"""

from __future__ import annotations

import json
import re

_STRING_STOP = re.compile(r'["\\]')
_SCALAR = re.compile(r"[A-Za-z0-9.+\-]")
_OPEN, _CLOSE = "{[", "}]"


class JsonScan:
    """One JSON value from ``start`` (its first character), scanned as text arrives."""

    def __init__(self, start: int) -> None:
        self.start = self.pos = start
        self.end: int | None = None  # one past the value's last character, once complete
        self.fields: dict[str, list] = {}  # top-level object fields: key -> [start, end|None]
        self._depth = 0
        self._string: int | None = None  # where the open string began
        self._expect = "value"  # in the top-level object: key, colon, value, open, after
        self._key: str | None = None
        self._scalar = False  # a top-level field's scalar value is open

    def feed(self, text: str) -> None:
        i, n = self.pos, len(text)
        while i < n and self.end is None:
            if self._string is not None:
                m = _STRING_STOP.search(text, i)
                if m is None:
                    i = n
                    break
                i = m.start()
                if text[i] == "\\":
                    if i + 1 >= n:  # the escaped character has not arrived yet
                        break
                    i += 2
                    continue
                self._close_string(text, i)
            else:
                self._char(text, i)
            i += 1
        self.pos = i

    def _char(self, text: str, i: int) -> None:
        c, top = text[i], self._depth == 1 and text[self.start] == "{"
        if self._depth == 0:  # the value's first character (scalars: until a delimiter)
            if c == '"':
                self._string = i
            elif c in _OPEN:
                self._depth = 1
                self._expect = "key"
            elif not _SCALAR.match(c):
                self.end = i
            return
        if top and self._scalar and (c in ",}" or c.isspace()):
            self._field_end(i)
        if c == '"':
            self._string = i
            if top and self._expect == "value":
                self._field_start(i)
        elif c in _OPEN:
            if top and self._expect == "value":
                self._field_start(i)
            self._depth += 1
        elif c in _CLOSE:
            self._depth -= 1
            if self._depth == 0:
                self.end = i + 1
            elif self._depth == 1 and self._expect == "open":
                self._field_end(i + 1)
        elif top and c == ":" and self._expect == "colon":
            self._expect = "value"
        elif top and c == ",":
            self._expect = "key"
        elif top and self._expect == "value" and not c.isspace():
            self._field_start(i)
            self._scalar = True

    def _close_string(self, text: str, i: int) -> None:
        start, self._string = self._string, None
        if self._depth == 0:
            self.end = i + 1
        elif self._depth == 1 and text[self.start] == "{":
            if self._expect == "key":
                try:
                    self._key = json.loads(text[start : i + 1])
                except ValueError:
                    self._key = None
                self._expect = "colon"
            elif self._expect == "open":
                self._field_end(i + 1)

    def _field_start(self, i: int) -> None:
        self._expect = "open"
        if self._key in self.fields:  # a repeated key: the first one counts
            self._key = None
        elif self._key is not None:
            self.fields[self._key] = [i, None]

    def _field_end(self, i: int) -> None:
        self._expect, self._scalar = "after", False
        if self._key is not None and self.fields[self._key][1] is None:
            self.fields[self._key][1] = i
        self._key = None


class Call:
    """One tool call: its JSON object (``name`` and the first of ``args_keys`` in it), or, when
    the format writes the name outside the JSON (``name``), its arguments value alone."""

    def __init__(self, start: int, args_keys: tuple[str, ...], name: str | None = None) -> None:
        self.scan = JsonScan(start)
        self.args_keys = args_keys
        self.given_name = name

    @property
    def closed(self) -> bool:
        return self.scan.end is not None

    def name(self, text: str) -> str | None:
        if self.given_name is not None:
            return self.given_name
        span = self.scan.fields.get("name")
        if span is None or span[1] is None or text[span[0]] != '"':
            return None
        return _decoded(text[span[0] : span[1]]) or None

    def arguments(self, text: str) -> str:
        """The arguments' text known so far: all of it once the value is complete; a string
        value (arguments written as JSON text) only once complete."""
        if self.given_name is not None:
            start, end = self.scan.start, self.scan.end
        else:
            fields = self.scan.fields
            span = next((fields[k] for k in fields if k in self.args_keys), None)
            if span is None:
                return "{}" if self.closed else ""
            start, end = span
        if text[start] == '"':
            return _decoded(text[start:end]) if end is not None else ""
        return text[start : self.scan.pos if end is None else end]

    def valid(self, text: str) -> bool:
        """Complete, well-formed JSON, a string name, and arguments that parse."""
        if not self.closed or self.name(text) is None:
            return False
        try:
            obj = json.loads(text[self.scan.start : self.scan.end])
            if self.given_name is None and not isinstance(obj, dict):
                return False
            json.loads(self.arguments(text))
        except ValueError:
            return False
        return True


def _decoded(literal: str) -> str:
    try:
        value = json.loads(literal)
    except ValueError:
        return ""
    return value if isinstance(value, str) else ""


def skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def marker_hold(text: str, start: int, markers: tuple[str, ...]) -> int:
    """Where content may be sent up to, from ``start`` on: before the first marker, or before a
    tail that could begin one."""
    found = [p for p in (text.find(m, start) for m in markers) if p >= 0]
    if found:
        return min(found)
    for cut in range(min(max(map(len, markers)) - 1, len(text) - start), 0, -1):
        if any(m.startswith(text[-cut:]) for m in markers):
            return len(text) - cut
    return len(text)
