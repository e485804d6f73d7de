"""The engine loop on its own thread, and an asyncio face for the HTTP server.

Requests reach the loop through a thread-safe command queue; each request's outputs come
back on its own asyncio queue. A consumer that stops listening (client disconnect) aborts
its request at once, which frees its KV blocks. A step that raises fails the requests it
was running with a GenerationError instead of hanging them.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Sequence as Seq

from tessera.engine.engine import Engine
from tessera.engine.errors import EngineFatalError
from tessera.engine.outputs import RequestOutput
from tessera.multimodal.inputs import MultimodalInputs
from tessera.pooling.outputs import PoolingRequestOutput
from tessera.pooling.params import PoolingParams, TokenTypedPrompt
from tessera.sampling.params import SamplingParams

logger = logging.getLogger(__name__)


class OverloadedError(RuntimeError):
    """More requests in flight than max_concurrent_requests."""


class GenerationError(RuntimeError):
    """The engine failed while computing this request."""


class EngineDeadError(RuntimeError):
    """The engine loop is not running (it crashed or the server is shutting down)."""


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams | PoolingParams
    sink: "_Sink"
    lora: str | None = None  # a loaded adapter's name
    priority: int = 0
    images: MultimodalInputs | None = None  # a prompt's images (token-id prompts only)


@dataclass
class _Abort:
    request_id: str


class _Sink:
    """Delivers outputs (or an exception) from the engine thread to one asyncio consumer."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncEngine:
    def __init__(self, engine: Engine, max_concurrent_requests: int = 128,
                 stall_timeout_s: float = 60.0):
        self.engine = engine
        self.max_concurrent_requests = max_concurrent_requests
        self.stall_timeout_s = stall_timeout_s
        self._commands: queue.Queue[_Add | _Abort | None] = queue.Queue()
        self._sinks: dict[str, _Sink] = {}
        self._in_flight = 0
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._closed = False  # (under _lock) the loop takes no more commands: new ones fail at once
        self.dead_reason: str | None = None
        self.step_started: float | None = None  # set while a step runs (stall detection)
        self.num_steps = 0
        engine.on_fatal(self._engine_failed)

    # --- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="tessera-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop accepting, let in-flight requests finish for up to `timeout`, then fail the rest."""
        self._stopping.set()
        deadline = time.monotonic() + timeout
        while self.num_in_flight and time.monotonic() < deadline and self.is_alive:
            time.sleep(0.05)
        self._commands.put(None)
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        self.engine.close()  # stops tensor-parallel ranks; nothing to do without them

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead_reason is None

    def is_healthy(self) -> bool:
        """Alive, and not stuck inside one step for longer than the stall timeout."""
        started = self.step_started
        stalled = started is not None and time.monotonic() - started > self.stall_timeout_s
        return self.is_alive and not stalled and not self._stopping.is_set()

    @property
    def num_in_flight(self) -> int:
        return self._in_flight

    # --- requests ----------------------------------------------------------------------------

    async def generate(self, request_id: str, prompt: str | Seq[int], params: SamplingParams | PoolingParams,
                       lora: str | None = None, priority: int = 0,
                       images: MultimodalInputs | None = None
                       ) -> AsyncIterator[RequestOutput | PoolingRequestOutput]:
        """Outputs of one request as the engine produces them; the last has finished=True.
        Closing the iterator early aborts the request. `lora`: a loaded adapter's name;
        `priority`: Engine.add_request's. An embedding request (PoolingParams) has one
        output, its embedding."""
        if not self.is_alive or self._stopping.is_set():
            raise EngineDeadError(self.dead_reason or "the server is shutting down")
        with self._lock:
            if self._in_flight >= self.max_concurrent_requests:
                raise OverloadedError("Model is overloaded")
            self._in_flight += 1
        sink = _Sink(asyncio.get_running_loop())
        finished = False
        try:
            if getattr(params, "structured_outputs", None) is not None:
                # compile here, off the engine thread, so running streams do not wait for it;
                # the engine's own compile then hits xgrammar's cache
                await asyncio.to_thread(self.engine.compile_grammar, params.structured_outputs)
            with self._lock:  # (the loop drains the queue under it as it closes: nothing is stranded there)
                if self._closed:
                    raise EngineDeadError(self.dead_reason or "the server is shutting down")
                self._commands.put(_Add(request_id, prompt if isinstance(prompt, (str, TokenTypedPrompt))
                                        else list(prompt), params, sink, lora, priority, images))
            while True:
                item = await sink.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._commands.put(_Abort(request_id))
            with self._lock:
                self._in_flight -= 1

    def _engine_failed(self, exc: EngineFatalError) -> None:
        """(The engine's watcher thread) a tensor-parallel rank died: fail every request
        now and turn /health to 503, even while the loop is still blocked in the step that
        will fail. The loop drops its sinks when that step raises."""
        self.dead_reason = str(exc)
        for sink in list(self._sinks.values()):
            sink.put(GenerationError(str(exc)))
        self._fail_queued(close=False)

    def _fail_queued(self, close: bool) -> None:
        """Fail every request still waiting in the command queue (`close`: and every later
        one, as generate() checks under the same lock)."""
        reason = self.dead_reason or "the server is shutting down"
        with self._lock:
            self._closed = self._closed or close
            kept = []  # aborts and the shutdown sentinel: the loop still reads those
            while True:
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    break
                if isinstance(cmd, _Add):
                    cmd.sink.put(EngineDeadError(reason))
                else:
                    kept.append(cmd)
            for cmd in kept:
                self._commands.put(cmd)

    # --- the loop (engine thread) ------------------------------------------------------------

    def _loop(self) -> None:
        engine = self.engine
        try:
            while True:
                block = not engine.has_unfinished()
                try:
                    cmd = self._commands.get(block=block, timeout=None if block else 0)
                except queue.Empty:
                    cmd = False
                if cmd is None:
                    break
                if cmd:
                    self._apply(cmd)
                    continue  # drain every pending command before the next step
                self._step()
        except BaseException as exc:  # the loop itself failed: nothing can be served
            self.dead_reason = f"engine loop died: {exc!r}"
            logger.exception("engine loop died")
        finally:
            reason = self.dead_reason or "the server is shutting down"
            for request_id, sink in list(self._sinks.items()):
                sink.put(EngineDeadError(reason))
                engine.abort(request_id)
            self._sinks.clear()
            self._fail_queued(close=True)

    def _apply(self, cmd: _Add | _Abort) -> None:
        if isinstance(cmd, _Abort):
            if self._sinks.pop(cmd.request_id, None) is not None:
                self.engine.abort(cmd.request_id)
            return
        if self.dead_reason is not None:  # (a rank died while this waited: nothing can run it)
            cmd.sink.put(EngineDeadError(self.dead_reason))
            return
        try:
            self.engine.add_request(cmd.request_id, cmd.prompt, cmd.params, cmd.lora, cmd.priority,
                                    multimodal=cmd.images)
        except Exception as exc:  # validation the engine does itself (length, ids ...)
            cmd.sink.put(exc)
            return
        self._sinks[cmd.request_id] = cmd.sink

    def _step(self) -> None:
        self.step_started = time.monotonic()
        try:
            outputs = self.engine.step()
        except Exception as exc:
            logger.exception("engine step failed; failing the requests in flight")
            for request_id, sink in list(self._sinks.items()):
                sink.put(GenerationError(str(exc) or type(exc).__name__))
                self.engine.abort(request_id)
            self._sinks.clear()
            if isinstance(exc, EngineFatalError):  # no later step can succeed: the loop dies,
                raise                                # /health turns 503, new requests get 503
            return
        finally:
            self.step_started = None
            self.num_steps += 1
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue
            sink.put(out)
            if out.finished:
                del self._sinks[out.request_id]
