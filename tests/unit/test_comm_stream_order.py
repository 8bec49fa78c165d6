"""The order in which CommStream issues a call in phases onto its streams (no GPU: the CUDA
stream calls are recorded by fakes). Under CUDA-graph capture a side stream records nothing
until it has waited for the capturing stream, so the comm stream must join the main one
before the first claim of a forward (run 8 call 3 hung on a claim issued before that)."""

from __future__ import annotations

import contextlib

import torch

from lightwell.dual_stream import comm as overlap


class _Stream:
    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def wait_stream(self, other: _Stream) -> None:
        self.log.append(f"{self.name} waits {other.name}")

    def wait_event(self, event: object) -> None:
        self.log.append(f"{self.name} waits event")


class _Owner:
    def end_forward(self) -> None:
        pass


class _Phased:
    def __init__(self, log: list[str], owner: _Owner) -> None:
        self.log, self.owner = log, owner

    def claim(self) -> None:
        self.log.append(f"claim on {_current[-1]}")

    def transfer(self) -> None:
        self.log.append(f"transfer on {_current[-1]}")

    def finish(self) -> torch.Tensor:
        self.log.append(f"finish on {_current[-1]}")
        return torch.zeros(1)

    def join(self) -> None:
        self.log.append("join")


_current = ["main"]


def test_the_comm_stream_joins_before_the_first_claim(monkeypatch):
    log: list[str] = []
    main, comm = _Stream("main", log), _Stream("comm", log)
    owner = _Owner()

    @contextlib.contextmanager
    def on(stream):
        _current.append(stream.name)
        try:
            yield
        finally:
            _current.pop()

    class Event:
        def record(self, stream) -> None:
            log.append(f"event on {stream.name}")

    def start(x):
        log.append(f"quantize on {_current[-1]}")
        return _Phased(log, owner)

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: main)
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(overlap, "tp_all_reduce_start", start)
    cs = overlap.CommStream(comm)
    for forward in range(2):  # every forward forks anew (a capture each)
        log.clear()
        first = cs.launch(torch.ones(1))
        second = cs.launch(torch.ones(1))
        assert log == [
            "comm waits main",  # the fork, before anything on either stream
            "quantize on main", "claim on comm", "comm waits main", "transfer on comm",
            "event on comm",
            # the second call: no fork; its claim still goes before its wait for the quantize
            "quantize on main", "claim on comm", "comm waits main", "transfer on comm",
            "event on comm",
        ], forward  # fmt: skip
        log.clear()
        cs.wait(first)
        cs.wait(second)
        cs.end()
        assert log == ["main waits event", "finish on main", "main waits event", "join",
                       "finish on main", "join"]  # fmt: skip
        assert not cs.forked
