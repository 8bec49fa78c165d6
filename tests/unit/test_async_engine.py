"""AsyncEngine's thread loop against a fake engine: delivery, refusal, abort, death, idling."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from lightwell.engine.async_engine import AsyncEngine, EngineDeadError
from lightwell.engine.llm_engine import EngineStats
from lightwell.types import CompletionOutput, FinishReason, RequestOutput, SamplingParams


class FakeEngine:
    """One token per step per request; prompt "bad" is refused; fail_step breaks step()."""

    def __init__(self) -> None:
        self.reqs: dict[str, list] = {}  # id -> [max_tokens, produced]
        self.steps = 0
        self.fail_step = False
        self.shut = False
        self.output_processor = SimpleNamespace(
            has=lambda rid: rid in self.reqs,
            child_ids=lambda rid: [rid] if rid in self.reqs else [],
            parents={},
        )
        self.scheduler = SimpleNamespace(get_request=lambda rid: None)

    def new_request_id(self) -> str:
        return f"r{len(self.reqs)}-{time.monotonic_ns()}"

    def executor_failure(self) -> str | None:
        return None  # the workers are alive

    def add_request(self, rid, prompt, params, arrival_time=None, final_only=False) -> str:
        if prompt == "bad":
            raise ValueError("the prompt is bad")
        if rid in self.reqs:
            raise ValueError("duplicate id")
        self.reqs[rid] = [params.max_tokens, 0]
        return rid

    def _out(self, rid: str, n: int, reason: FinishReason | None) -> RequestOutput:
        comp = CompletionOutput(0, "x" * n, list(range(n)), finish_reason=reason)
        return RequestOutput(rid, None, [1], [comp], finished=reason is not None)

    def abort_request(self, rid: str) -> RequestOutput | None:
        if rid not in self.reqs:
            return None
        _, n = self.reqs.pop(rid)
        return self._out(rid, n, FinishReason.ABORT)

    def step(self) -> list[RequestOutput]:
        self.steps += 1
        if self.fail_step:
            raise RuntimeError("boom")
        time.sleep(0.002)
        outs = []
        for rid, st in list(self.reqs.items()):
            st[1] += 1
            done = st[1] >= st[0]
            outs.append(self._out(rid, st[1], FinishReason.LENGTH if done else None))
            if done:
                del self.reqs[rid]
        return outs

    def has_unfinished_requests(self) -> bool:
        return bool(self.reqs)

    def stats(self) -> EngineStats:
        return EngineStats(len(self.reqs), 0, 0.0, 0, 0, 0)

    def shutdown(self) -> None:
        self.shut = True


@pytest.fixture
def fake():
    engine = FakeEngine()
    finished: list[RequestOutput] = []
    ae = AsyncEngine(engine, on_finished=finished.append)  # type: ignore[arg-type]
    ae.finished = finished  # type: ignore[attr-defined]
    yield engine, ae
    ae.shutdown(timeout=1)


async def _wait_for(cond, timeout: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_generate_streams_until_finished(fake):
    engine, ae = fake

    async def run():
        outs = [o async for o in ae.generate("hi", SamplingParams(max_tokens=5), "a")]
        return outs

    outs = asyncio.run(run())
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 5
    assert all(not o.finished for o in outs[:-1])
    assert [o.request_id for o in ae.finished] == ["a"]


def test_refused_request_raises_and_loop_survives(fake):
    engine, ae = fake

    async def run():
        with pytest.raises(ValueError, match="bad"):
            await ae.add_request("x", "bad", SamplingParams())
        return [o async for o in ae.generate("ok", SamplingParams(max_tokens=2))]

    assert asyncio.run(run())[-1].finished
    assert ae.is_alive


def test_consumer_that_stops_early_aborts(fake):
    engine, ae = fake

    async def run():
        gen = ae.generate("hi", SamplingParams(max_tokens=10_000), "long")
        async for _ in gen:
            break
        await gen.aclose()
        await _wait_for(lambda: "long" not in engine.reqs)

    asyncio.run(run())
    assert ae.finished[-1].outputs[0].finish_reason == FinishReason.ABORT


def test_cancelled_consumer_aborts(fake):
    engine, ae = fake

    async def consume():
        async for _ in ae.generate("hi", SamplingParams(max_tokens=10_000), "c"):
            pass

    async def run():
        task = asyncio.create_task(consume())
        await _wait_for(lambda: engine.reqs.get("c", [0, 0])[1] > 2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _wait_for(lambda: "c" not in engine.reqs)

    asyncio.run(run())


def test_failed_step_kills_loop_and_fails_requests(fake):
    engine, ae = fake

    async def run():
        stream = await ae.add_request("d", "hi", SamplingParams(max_tokens=10_000))
        await stream.get()
        engine.fail_step = True
        with pytest.raises(EngineDeadError, match="boom"):
            while True:
                await stream.get()
        await _wait_for(lambda: not ae.is_alive)
        with pytest.raises(EngineDeadError):
            await ae.add_request("e", "hi", SamplingParams())

    asyncio.run(run())


def test_idle_loop_does_not_step(fake):
    engine, ae = fake
    time.sleep(0.1)
    before = engine.steps
    time.sleep(0.3)
    assert engine.steps == before == 0


def test_shutdown_waits_for_open_requests():
    engine = FakeEngine()
    ae = AsyncEngine(engine)  # type: ignore[arg-type]

    async def run():
        stream = await ae.add_request("s", "hi", SamplingParams(max_tokens=50))
        loop = asyncio.get_running_loop()
        stopper = loop.run_in_executor(None, ae.shutdown, 5.0)
        outs = [o async for o in ae.iterate(stream)]
        await stopper
        return outs

    outs = asyncio.run(run())
    assert outs[-1].outputs[0].finish_reason == FinishReason.LENGTH
    assert engine.shut and not ae.is_alive
