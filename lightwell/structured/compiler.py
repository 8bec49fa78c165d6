"""Grammar compilation for structured output: one xgrammar compiler per engine, an LRU cache of
compiled grammars keyed by (kind, spec), and the counters the metrics export."""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from lightwell.types import StructuredOutputs

# xgrammar's errors start with "[hh:mm:ss] /path/file.cc:LINE: "; the reason follows.
_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


@dataclass
class CompileStats:
    compiles: int = 0  # grammars compiled (cache misses that compiled)
    compile_seconds: float = 0.0  # total time spent compiling
    cache_queries: int = 0
    cache_hits: int = 0


class GrammarCache:
    """Compiles ``StructuredOutputs`` into xgrammar grammars for one tokenizer; thread-safe (the
    server compiles on a worker thread before queueing, the engine thread reuses the result)."""

    def __init__(self, tokenizer_info: Any, capacity: int = 256) -> None:
        """``tokenizer_info``: an ``xgrammar.TokenizerInfo`` (see ``tokenizer_info``)."""
        import xgrammar as xgr  # heavy: imported when the first constrained request arrives

        if capacity < 1:
            raise ValueError(f"the grammar cache needs a capacity >= 1 (got {capacity})")
        self._compiler = xgr.GrammarCompiler(tokenizer_info, max_threads=2, cache_enabled=False)
        self.vocab_size = tokenizer_info.vocab_size
        self.capacity = capacity
        self.stats = CompileStats()
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, spec: StructuredOutputs) -> Any:
        """The compiled grammar of ``spec``; ``ValueError`` with the compiler's reason."""
        key = spec.key()
        with self._lock:
            self.stats.cache_queries += 1
            grammar = self._cache.get(key)
            if grammar is not None:
                self.stats.cache_hits += 1
                self._cache.move_to_end(key)
                return grammar
        t0 = time.perf_counter()
        grammar = self._compile(spec)
        with self._lock:
            self.stats.compiles += 1
            self.stats.compile_seconds += time.perf_counter() - t0
            self._cache[key] = grammar
            while len(self._cache) > self.capacity:
                self._cache.popitem(last=False)
        return grammar

    def __len__(self) -> int:
        return len(self._cache)

    def _compile(self, spec: StructuredOutputs) -> Any:
        kind = spec.kind
        c = self._compiler
        try:
            if kind == "json":
                return c.compile_json_schema(spec.json)
            if kind == "json_object":  # any JSON object (OpenAI's json_object), not any value
                return c.compile_json_schema('{"type": "object"}')
            if kind == "regex":
                return c.compile_regex(spec.regex)
            if kind == "choice":
                return c.compile_grammar(choice_grammar(spec.choice))
            return c.compile_grammar(spec.grammar)
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(f"invalid {_NAMES[kind]}: {compiler_reason(e)}") from None


_NAMES = {
    "json": "JSON schema",
    "json_object": "JSON object grammar",
    "regex": "regex",
    "choice": "choice list",
    "grammar": "grammar",
}


def tokenizer_info(hf_tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> Any:
    """xgrammar's view of an HF tokenizer, padded to the logits' width ``vocab_size``."""
    import xgrammar as xgr

    return xgr.TokenizerInfo.from_huggingface(
        hf_tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids
    )


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar matching exactly one of ``choices``."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def compiler_reason(error: BaseException) -> str:
    """xgrammar's message without its source location, on one line."""
    text = str(error).strip()
    first = _LOCATION.sub("", text.splitlines()[0] if text else type(error).__name__)
    return first.strip() or type(error).__name__
