"""Triton compiles after start-up, made visible.

A Triton kernel compiles the first time it meets a new specialisation (a new constexpr, or an
integer argument newly equal to 1 or divisible by 16): about a second of host time, during
which every request in flight waits. Start-up (warm-up, CUDA-graph capture) should compile
everything serving needs; the worker arms this watch when start-up ends, and each later compile
is logged as a warning with the kernel, its specialisation and how long it took, and counted.

Hooks: ``triton.knobs.runtime.jit_cache_hook`` (called before a compile; its answer must be
falsy or Triton skips the compile) and ``jit_post_compile_hook`` (after). Triton versions
without ``knobs`` are not watched.
"""

from __future__ import annotations

import logging
import time
from typing import Any

logger = logging.getLogger(__name__)


class CompileWatch:
    def __init__(self) -> None:
        self.armed = False
        self.startup_compiles = 0
        self.mid_run: list[tuple[str, float]] = []  # (kernel, seconds) compiled once armed
        self._started: dict[Any, float] = {}
        self._prev: tuple[Any, Any] = (None, None)
        self._active = False  # False: the hooks only pass calls on (after uninstall)

    def install(self) -> bool:
        """Chain our hooks in front of any already set; False where Triton has no knobs."""
        try:
            from triton import knobs
        except ImportError:
            return False
        rt = knobs.runtime
        if not hasattr(rt, "jit_cache_hook") or not hasattr(rt, "jit_post_compile_hook"):
            return False
        if rt.jit_cache_hook == self._before:  # already on top: chaining to itself would loop
            self._active = True
            return True
        self._prev = (rt.jit_cache_hook, rt.jit_post_compile_hook)
        rt.jit_cache_hook = self._before
        rt.jit_post_compile_hook = self._after
        self._active = True
        return True

    def uninstall(self) -> None:
        """Stop watching. Where another hook was chained in front of ours since, ours stay in
        that chain but only pass calls on (unhooking them would cut the later one's chain)."""
        self._active = False
        self._started.clear()
        try:
            from triton import knobs
        except ImportError:
            return
        if knobs.runtime.jit_cache_hook == self._before:
            knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = self._prev

    def arm(self) -> None:
        """Start-up is over: from now on every compile is a warning."""
        self.armed = True
        self._started.clear()  # a compile that failed mid-way left its start time behind

    def _before(self, **kw: Any) -> Any:
        if self._active:
            self._started[_key(kw)] = time.perf_counter()
        prev = self._prev[0]
        return prev(**kw) if prev else None  # falsy: Triton compiles

    def _after(self, **kw: Any) -> Any:
        prev = self._prev[1]
        if not self._active:
            return prev(**kw) if prev else None
        t0 = self._started.pop(_key(kw), None)
        seconds = time.perf_counter() - t0 if t0 is not None else 0.0
        if self.armed:
            name = getattr(kw.get("fn"), "name", None) or str(kw.get("fn"))
            self.mid_run.append((name, seconds))
            logger.warning(
                "Triton compiled %s after start-up (%.2f s, a stall for every request in "
                "flight): %s",
                name,
                seconds,
                describe(kw),
            )
        else:
            self.startup_compiles += 1
        return prev(**kw) if prev else None


def describe(kw: dict) -> str:
    """The specialisation that was compiled: constexpr values (integers Triton specialised to
    a constant included) and the arguments it took as 16-divisible (pointers: 16-byte
    aligned), by name."""
    try:
        names = kw["fn"].jit_function.arg_names
        comp = kw.get("compile", {})

        def name(path: Any) -> str:
            i = path[0] if isinstance(path, tuple) else path
            return names[i] if isinstance(i, int) and i < len(names) else str(path)

        consts = ", ".join(f"{name(p)}={v}" for p, v in comp.get("constants", {}).items())
        attrs = (comp.get("configs") or [{}])[0] or {}
        div16 = ", ".join(name(p) for p, a in attrs.items() if "tt.divisibility" in str(a))
        return f"constexprs {consts or '-'}; divisible by 16: {div16 or '-'}"
    except Exception:  # a Triton whose hook arguments differ: its own summary
        return str(kw.get("repr", ""))


def _key(kw: dict) -> Any:
    fn = kw.get("fn")
    return (id(getattr(fn, "jit_function", fn)), repr(kw.get("key")))
