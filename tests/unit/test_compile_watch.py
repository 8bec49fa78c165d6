"""The compile watch: compiles before ``arm()`` are counted as start-up, later ones are logged as
warnings with the kernel's name and time, and hooks set before it are still called."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

knobs = pytest.importorskip("triton").knobs


class _Fn:
    def __init__(self, name: str) -> None:
        self.name = name
        self.jit_function = SimpleNamespace(arg_names=["x_ptr", "n", "BLOCK"])


def _compile(fn: _Fn, key: str) -> None:
    """What Triton's JITFunction does around a compile: the cache hook, then the post hook."""
    spec = {"constants": {(2,): 64}, "configs": [{(0,): [["tt.divisibility", 16]]}]}
    kw = dict(key=key, repr=f"{fn.name}(n: i32)", fn=fn, compile=spec, is_manual_warmup=False)
    assert not knobs.runtime.jit_cache_hook(**kw, already_compiled=False)  # falsy: compile
    knobs.runtime.jit_post_compile_hook(**kw, already_compiled=False)


def test_compiles_after_arm_are_warnings_and_chained_hooks_still_run(caplog):
    from lightwell.worker.compile_watch import CompileWatch

    seen = []
    before = (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook)
    knobs.runtime.jit_cache_hook = lambda **kw: seen.append(("cache", kw["key"]))
    knobs.runtime.jit_post_compile_hook = lambda **kw: seen.append(("post", kw["key"]))
    watch = CompileWatch()
    try:
        assert watch.install()
        with caplog.at_level(logging.WARNING, logger="lightwell.worker.compile_watch"):
            _compile(_Fn("_warm_kernel"), "k1")
            assert watch.startup_compiles == 1 and watch.mid_run == [] and not caplog.records
            watch.arm()
            _compile(_Fn("_late_kernel"), "k2")
        assert [name for name, _ in watch.mid_run] == ["_late_kernel"]
        assert watch.mid_run[0][1] >= 0.0
        (rec,) = caplog.records
        assert "_late_kernel" in rec.getMessage() and "after start-up" in rec.getMessage()
        assert "constexprs BLOCK=64; divisible by 16: x_ptr" in rec.getMessage()
        assert seen == [("cache", "k1"), ("post", "k1"), ("cache", "k2"), ("post", "k2")]
        watch.uninstall()
        assert knobs.runtime.jit_cache_hook != watch._before  # the earlier hooks are back
        assert knobs.runtime.jit_post_compile_hook != watch._after
    finally:
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = before


def test_two_watches_uninstalled_out_of_order_stop_counting_and_keep_the_chain():
    """Worker A installs, worker B installs over it, A shuts down first: A's hooks stay in B's
    chain but count nothing; once both are gone, compiles reach the original hooks only."""
    from lightwell.worker.compile_watch import CompileWatch

    seen = []
    before = (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook)
    knobs.runtime.jit_cache_hook = lambda **kw: seen.append(("cache", kw["key"]))
    knobs.runtime.jit_post_compile_hook = lambda **kw: seen.append(("post", kw["key"]))
    a, b = CompileWatch(), CompileWatch()
    try:
        assert a.install() and b.install()
        a.arm()
        b.arm()
        _compile(_Fn("_k"), "k1")
        assert len(a.mid_run) == 1 and len(b.mid_run) == 1
        a.uninstall()  # out of order: B's hooks are on top
        _compile(_Fn("_k"), "k2")
        assert len(a.mid_run) == 1 and len(b.mid_run) == 2
        b.uninstall()
        _compile(_Fn("_k"), "k3")
        assert len(a.mid_run) == 1 and len(b.mid_run) == 2
        assert [k for _, k in seen] == ["k1", "k1", "k2", "k2", "k3", "k3"]
    finally:
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = before


def test_installing_twice_does_not_chain_a_watch_to_itself():
    from lightwell.worker.compile_watch import CompileWatch

    before = (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook)
    watch = CompileWatch()
    try:
        assert watch.install() and watch.install()
        watch.arm()
        _compile(_Fn("_k"), "k1")  # would recurse without end if chained to itself
        assert len(watch.mid_run) == 1
        watch.uninstall()
        assert knobs.runtime.jit_cache_hook is before[0]
    finally:
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = before
