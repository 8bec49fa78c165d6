"""hostmem-copy's copies on several lanes (streams) a direction, without a GPU: the calls'
stream operations are recorded by a fake, then two ranks execute them in random orders that
respect each rank's stream order and events, one operation at a time, as a CUDA graph whose
branches run one after the other would. Every order must finish (no rank waits forever for a
flag) and every H2D copy must read the chunk its peer wrote for the same call."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from lightwell.distributed.comm.hostmem_copy import HostMemCopyAllReduce, _Ops


class _Recorder(_Ops):
    """Appends every operation to ``nodes`` as (stream, kind, payload, dependencies)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.nodes: list[dict[str, Any]] = []
        self.last: dict[str, int] = {}
        self.call = 0  # the call being issued (the data check's tag)

    def _add(self, stream: str, kind: str, deps: tuple[int, ...] = (), **what: Any) -> int:
        prev = self.last.get(stream)
        deps = tuple(d for d in (prev, *deps) if d is not None)
        node = {"stream": stream, "kind": kind, "call": self.call, "deps": deps, **what}
        self.nodes.append(node)
        self.last[stream] = len(self.nodes) - 1
        return len(self.nodes) - 1

    def d2h(self, dst: int, src: torch.Tensor, a: int, b: int, stream: Any) -> None:
        self._add(stream, "d2h", at=dst, piece=a)

    def h2d(self, dst: torch.Tensor, a: int, b: int, src: int, stream: Any) -> None:
        self._add(stream, "h2d", at=src, piece=a)

    def write_flag(self, offset: int, value: int, stream: Any) -> None:
        self._add(stream, "write", at=offset, value=value)

    def wait_flag(self, offset: int, value: int, stream: Any) -> None:
        self._add(stream, "wait", at=offset, value=value)

    def record(self, stream: Any) -> int:
        return self._add(stream, "mark")

    def after(self, marker: int, stream: Any) -> None:
        self._add(stream, "after", deps=(marker,))


def _strategy(rank: int, lanes: int, chunks: int) -> HostMemCopyAllReduce:
    """The strategy's state for ``_claim`` / ``_transfer`` alone (no shared segment)."""
    s = object.__new__(HostMemCopyAllReduce)
    s.rank, s.size, s.peers = rank, 2, [1 - rank]
    s.chunks, s.lanes, s.int8 = chunks, lanes, False
    s.calls, s.order = 0, [None, None]
    s.flag_bytes, s.slot_bytes = 4096, 1 << 20
    s.stages = [torch.empty(1, 1 << 20, dtype=torch.uint8)]
    s.ops = _Recorder(rank)
    s.up_extra = [f"up{i}" for i in range(1, lanes)]
    s.downs = [f"down{i}" for i in range(lanes)]
    return s


def _bounds(nbytes: int, chunks: int) -> list[tuple[int, int]]:
    """Exactly ``chunks`` byte ranges (chunk_bounds would keep MIN_CHUNK_BYTES a piece)."""
    step = -(-nbytes // chunks)
    return [(a, min(a + step, nbytes)) for a in range(0, nbytes, step)]


def _issue(s: HostMemCopyAllReduce, calls: int, nbytes: int, phased: bool) -> None:
    """``calls`` calls, whole on the main stream, or in phases as the dual-stream overlap
    makes them: the comm stream joins the main one at each launch, and the main stream sums
    call k (waits for its copies) only after launching call k + 1."""
    payload, bounds = torch.empty(nbytes, dtype=torch.uint8), _bounds(nbytes, s.chunks)
    here = "comm" if phased else "main"
    s._here = lambda: here
    marks = []
    for call in range(calls):
        s.ops.call = call
        if phased:
            s.ops.after(s.ops.record("main"), "comm")  # the launch (after the quantize)
        marks.append(s._transfer(payload, bounds, 0, phased=phased))
        if not phased:
            s.ops.after(marks[-1][0], "main")  # the sum
            s.ops.after(marks[-1][1], "main")
        elif call:
            s.ops.after(marks[-2][0], "main")  # the previous call's sum
    if phased:
        s.ops.after(marks[-1][0], "main")
        for _, lowered in marks:  # the forward's end joins every call
            s.ops.after(lowered, "main")


def _issue_mixed(s: HostMemCopyAllReduce, nbytes: int) -> None:
    """Calls in phases mixed with a whole call on the comm stream (what ``CommStream`` runs
    when ``start`` declines): launch 0 and 1 in phases, the sum of 0, launch 2 whole, the sum
    of 1, the wait for 2, launch 3 in phases and its sum; then the forward's end."""
    payload, bounds = torch.empty(nbytes, dtype=torch.uint8), _bounds(nbytes, s.chunks)
    s._here = lambda: "comm"
    marks = {}

    def launch(call: int, phased: bool) -> None:
        s.ops.call = call
        s.ops.after(s.ops.record("main"), "comm")
        marks[call] = s._transfer(payload, bounds, 0, phased=phased)
        if not phased:  # the whole call's sum, on the comm stream
            s.ops.after(marks[call][0], "comm")
            s.ops.after(marks[call][1], "comm")

    launch(0, True)
    launch(1, True)
    s.ops.after(marks[0][0], "main")
    launch(2, False)
    s.ops.after(marks[1][0], "main")
    s.ops.after(s.ops.record("comm"), "main")  # the wait for call 2
    launch(3, True)
    s.ops.after(marks[3][0], "main")
    for call in (0, 1, 3):
        s.ops.after(marks[call][1], "main")
    s.ops.after(s.ops.record("comm"), "main")


@pytest.mark.parametrize("lanes", [1, 2, 3])
def test_lanes_with_whole_and_phased_calls_mixed(lanes):
    strategies = [_strategy(r, lanes, chunks=4) for r in (0, 1)]
    for s in strategies:
        _issue_mixed(s, 4096)
    for seed in range(300):
        _run([s.ops for s in strategies], random.Random(seed))


def _run(ranks: list[_Recorder], rng: random.Random) -> None:
    """Both ranks' operations, one at a time a rank in a random order of its graph; a rank
    whose chosen operation is a wait for an unset flag holds there until a peer sets it."""
    # adversarial orders: each rank runs at its own pace and, half the time, prefers its
    # streams in a fixed order (a graph run branch by branch), else picks at random
    pace = [rng.uniform(0.1, 1.0) for _ in ranks]
    rank_of = [{name: rng.random() for name in {n["stream"] for n in r.nodes}} for r in ranks]
    flags: dict[int, int] = {}
    slots: dict[int, tuple[int, int]] = {}  # host byte offset -> (writer, call) of its chunk
    missing = [[len(node["deps"]) for node in r.nodes] for r in ranks]  # unmet dependencies
    users: list[list[list[int]]] = [[[] for _ in r.nodes] for r in ranks]
    for i, rec in enumerate(ranks):
        for n, node in enumerate(rec.nodes):
            for d in node["deps"]:
                users[i][d].append(n)
    ready = [sorted(n for n, k in enumerate(m) if k == 0) for m in missing]
    left = [len(r.nodes) for r in ranks]
    holding: list[int | None] = [None for _ in ranks]
    while any(left):
        moved = False
        for i, rec in enumerate(ranks):
            if holding[i] is None:
                if not ready[i]:
                    continue
                if rng.random() < 0.5:
                    pick = rng.randrange(len(ready[i]))
                else:
                    streams = [rank_of[i][rec.nodes[n]["stream"]] for n in ready[i]]
                    pick = streams.index(min(streams))
                holding[i] = ready[i].pop(pick)
            if rng.random() > pace[i]:
                moved = True  # (this rank waits a turn)
                continue
            node = rec.nodes[holding[i]]
            if node["kind"] == "wait" and flags.get(node["at"], 0) != node["value"]:
                continue  # held: a serial graph cannot run anything else meanwhile
            if node["kind"] == "write":
                flags[node["at"]] = node["value"]
            elif node["kind"] == "d2h":
                slots[node["at"]] = (rec.rank, node["call"])
            elif node["kind"] == "h2d":
                assert slots.get(node["at"]) == (1 - rec.rank, node["call"]), (
                    f"rank {rec.rank} call {node['call']} copied a chunk its peer had not "
                    "written for that call"
                )
            for u in users[i][holding[i]]:
                missing[i][u] -= 1
                if missing[i][u] == 0:
                    ready[i].append(u)
            left[i] -= 1
            holding[i] = None
            moved = True
        assert moved, "deadlock: every rank waits for a flag no one will set"


CASES = [(1, 4, False), (2, 4, False), (2, 4, True), (3, 4, True), (2, 3, False), (4, 2, True)]


@pytest.mark.parametrize("lanes,chunks,phased", CASES)
def test_lanes_progress_in_any_serial_order(lanes, chunks, phased):
    strategies = [_strategy(r, lanes, chunks) for r in (0, 1)]
    for s in strategies:
        _issue(s, calls=5, nbytes=4096, phased=phased)
    # each chunk's copies on their lane: D2H chunk c on up lane c % lanes, H2D on down lane
    nodes = strategies[0].ops.nodes
    ups = ["comm" if phased else "main", *strategies[0].up_extra]
    used = min(lanes, chunks)
    d2h = [n["stream"] for n in nodes if n["kind"] == "d2h" and n["call"] == 0]
    h2d = [n["stream"] for n in nodes if n["kind"] == "h2d" and n["call"] == 0]
    assert d2h == [ups[c % used] for c in range(chunks)]
    assert h2d == [f"down{c % used}" for c in range(chunks)]
    for seed in range(150):
        _run([s.ops for s in strategies], random.Random(seed))


def test_lanes_and_chunks_options_are_checked():
    with pytest.raises(ValueError, match="lanes must be 1..4"):
        HostMemCopyAllReduce(None, lanes=5)  # type: ignore[arg-type]  (checked before set-up)
    with pytest.raises(ValueError, match="chunks must be 1..16"):
        HostMemCopyAllReduce(None, chunks=17)  # type: ignore[arg-type]
