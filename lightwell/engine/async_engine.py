"""AsyncEngine: the asyncio front of LLMEngine for the server.

One background thread owns the LLMEngine (which is not thread-safe) and runs its step loop.
Requests and aborts enter through a command deque guarded by a ``threading.Condition``; the
thread sleeps on that condition while there is nothing to do (never a busy-wait). Outputs go
back to per-request ``asyncio.Queue``s through ``loop.call_soon_threadsafe``, one call per event
loop per step. docs/serving.md explains why a thread and not a process (measured).

Failures are contained: a request the engine refuses (``ValueError`` from ``add_request``) is
raised to its caller and nothing else changes; only an exception inside ``step()`` stops the
loop, since the engine's state can no longer be trusted. Then every open request gets an
``EngineDeadError`` and ``is_alive`` turns False (the server's /health fails).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from lightwell.engine.llm_engine import EngineStats, LLMEngine, PromptInput
from lightwell.types import RequestOutput, SamplingParams

logger = logging.getLogger(__name__)

# Called on the engine thread with each finished (or aborted) request's last output.
FinishedCallback = Callable[[RequestOutput], None]


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (a step failed, or shutdown): no request can be served."""


class RequestStream:
    """The outputs of one request, delivered by the engine thread into this event loop."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.loop = loop
        self.accepted: asyncio.Future[None] = loop.create_future()
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False

    def put(self, item: RequestOutput | BaseException) -> None:
        """Event-loop side of a delivery; accepts an output or the error that ends the stream."""
        if not self.accepted.done():
            if isinstance(item, BaseException):
                self.accepted.set_exception(item)
                return
            self.accepted.set_result(None)
        self._queue.put_nowait(item)

    async def get(self) -> RequestOutput:
        """The newest output: outputs are cumulative, so queued older ones are skipped."""
        item = await self._queue.get()
        while not self._queue.empty() and not isinstance(item, BaseException):
            item = self._queue.get_nowait()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item


@dataclass
class _Add:
    request_id: str
    prompt: PromptInput
    params: SamplingParams
    stream: RequestStream
    final_only: bool = False
    arrival_time: float = field(default_factory=time.time)


@dataclass
class _Abort:
    request_id: str


class AsyncEngine:
    """Runs ``engine``'s step loop on a background thread; the only thread that touches it."""

    def __init__(
        self,
        engine: LLMEngine,
        on_finished: FinishedCallback | None = None,
        on_step: Callable[[float], None] | None = None,
    ) -> None:
        """``on_finished(output)`` and ``on_step(seconds)`` run on the engine thread."""
        self.engine = engine
        self.on_finished = on_finished
        self.on_step = on_step
        self._cond = threading.Condition()
        self._commands: deque[_Add | _Abort] = deque()
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._stats = engine.stats()
        self._error: BaseException | None = None
        self._accepting = True
        self._closing = False
        self._stopped = False  # set (under the lock) once the loop takes no more commands
        self._thread = threading.Thread(target=self._run, name="lightwell-engine", daemon=True)
        self._thread.start()

    # ---- event-loop side ------------------------------------------------------------------
    @property
    def is_alive(self) -> bool:
        alive = self._thread.is_alive() and self._error is None and not self._closing
        return alive and self.engine.executor_failure() is None

    @property
    def stats(self) -> EngineStats:
        """Engine counters as of the end of the last step."""
        return self._stats

    async def add_request(
        self,
        request_id: str,
        prompt: PromptInput,
        params: SamplingParams,
        final_only: bool = False,
    ) -> RequestStream:
        """Queue a request; returns once the engine accepted it, or raises its ValueError.

        ``final_only``: the stream gets one output, when the request finishes (no per-step
        snapshots: what a non-streaming HTTP request needs)."""
        if self._error is not None or not self._thread.is_alive():
            raise EngineDeadError(f"the engine loop has stopped: {self._error!r}")
        if not self._accepting:
            raise EngineDeadError("the server is shutting down")
        stream = RequestStream(request_id, asyncio.get_running_loop())
        self._submit(_Add(request_id, prompt, params, stream, final_only))
        try:
            await asyncio.shield(stream.accepted)
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        return stream

    async def iterate(self, stream: RequestStream) -> AsyncIterator[RequestOutput]:
        """Yield a stream's outputs until it finishes; aborts it if the consumer stops early."""
        try:
            while not stream.finished:
                yield await stream.get()
        finally:
            if not stream.finished:
                self.abort(stream.request_id)

    async def generate(
        self, prompt: PromptInput, params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its cumulative outputs; the last one has ``finished``."""
        request_id = request_id or self.engine.new_request_id()
        stream = await self.add_request(request_id, prompt, params)
        async with contextlib.aclosing(self.iterate(stream)) as outputs:
            async for out in outputs:
                yield out

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe, idempotent); its KV blocks are freed before the next
        step."""
        self._submit(_Abort(request_id))

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop accepting, let open requests finish for up to ``timeout`` s, then abort the rest
        and stop the loop. Blocking: call it off the event loop or at the very end."""
        self._accepting = False
        deadline = time.monotonic() + timeout
        while self._streams and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join(timeout=max(5.0, timeout))
        if self._thread.is_alive():  # stuck in a step: the engine is still in use
            logger.warning("the engine loop did not stop; leaving the engine as it is")
            return
        self.engine.shutdown()

    def _submit(self, command: _Add | _Abort) -> None:
        with self._cond:
            if self._stopped:  # nobody will read it any more
                if isinstance(command, _Add):
                    raise EngineDeadError("the engine loop has stopped")
                return
            self._commands.append(command)
            self._cond.notify()

    # ---- engine thread --------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                commands = self._wait_for_work()
                if commands is None:
                    break
                for command in commands:
                    self._apply(command)
                if self.engine.has_unfinished_requests():
                    self._step()
                elif commands:
                    self._stats = self.engine.stats()  # e.g. after the last request's abort
        except BaseException as e:  # noqa: BLE001 - the loop must report any failure
            logger.exception("the engine loop failed; no further requests can be served")
            self._error = e
        finally:
            why = f"the engine loop failed: {self._error!r}" if self._error else "shut down"
            self._fail_all(EngineDeadError(f"the engine has stopped ({why})"))

    def _wait_for_work(self) -> list[_Add | _Abort] | None:
        with self._cond:
            while not (self._commands or self._closing or self.engine.has_unfinished_requests()):
                self._cond.wait()
            if self._closing:
                return None
            commands = list(self._commands)
            self._commands.clear()
            return commands

    def _apply(self, command: _Add | _Abort) -> None:
        if isinstance(command, _Abort):
            stream = self._streams.pop(command.request_id, None)
            out = self.engine.abort_request(command.request_id)
            if out is not None:
                self._finished(out)
                if stream is not None:
                    self._deliver([(stream, out)])
            return
        self._add(command)

    def _add(self, c: _Add) -> None:
        try:
            self.engine.add_request(
                c.request_id, c.prompt, c.params, c.arrival_time, final_only=c.final_only
            )
        except Exception as e:  # noqa: BLE001 - a refused request must not stop the loop
            self._deliver([(c.stream, e)])
            return
        self._streams[c.request_id] = c.stream
        c.stream.loop.call_soon_threadsafe(_accept, c.stream)

    def _step(self) -> None:
        t0 = time.perf_counter()
        outputs = self.engine.step()
        self._stats = self.engine.stats()
        if self.on_step is not None:
            try:
                self.on_step(time.perf_counter() - t0)
            except Exception:  # noqa: BLE001 - metrics must never stop the engine
                logger.exception("the on_step callback failed")
        deliveries: list[tuple[RequestStream, RequestOutput | BaseException]] = []
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if out.finished:
                self._streams.pop(out.request_id, None)
                self._finished(out)
            if stream is not None:
                deliveries.append((stream, out))
        self._deliver(deliveries)

    def _finished(self, out: RequestOutput) -> None:
        if self.on_finished is None:
            return
        try:
            self.on_finished(out)
        except Exception:  # noqa: BLE001 - metrics must never stop the engine
            logger.exception("the on_finished callback failed")

    def _deliver(self, items: list[tuple[RequestStream, RequestOutput | BaseException]]) -> None:
        """One call_soon_threadsafe per event loop for a whole step's outputs."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for stream, item in items:
            by_loop.setdefault(stream.loop, []).append((stream, item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                for stream, _ in batch:
                    if self._streams.pop(stream.request_id, None) and not self._stopped:
                        self.engine.abort_request(stream.request_id)  # free its KV blocks

    def _fail_all(self, error: EngineDeadError) -> None:
        with self._cond:
            self._stopped = True
            pending = [c.stream for c in self._commands if isinstance(c, _Add)]
            self._commands.clear()
        streams = pending + list(self._streams.values())
        self._streams.clear()
        self._deliver([(s, error) for s in streams])


def _accept(stream: RequestStream) -> None:
    if not stream.accepted.done():
        stream.accepted.set_result(None)


def _put_all(batch: list[tuple[RequestStream, RequestOutput | BaseException]]) -> None:
    for stream, item in batch:
        stream.put(item)
