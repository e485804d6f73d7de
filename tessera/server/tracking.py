"""Runs one request through the async engine, recording its metrics and turning engine
exceptions into API errors."""
from __future__ import annotations

import asyncio
import contextlib
import time
from typing import AsyncIterator

from fastapi import Request

from tessera.engine.engine import RequestError
from tessera.multimodal.inputs import MultimodalInputs
from tessera.engine.outputs import RequestOutput
from tessera.pooling.outputs import PoolingRequestOutput
from tessera.pooling.params import PoolingParams, PoolingParamsError
from tessera.sampling.params import SamplingParams, SamplingParamsError
from tessera.server.async_engine import EngineDeadError, GenerationError, OverloadedError
from tessera.server.errors import ClientGone, GenerationFailed, Overloaded, Unavailable, ValidationFailed
from tessera.server.state import ServerState


async def run_request(state: ServerState, request_id: str, prompt_ids: list[int],
                      params: SamplingParams | PoolingParams, lora: str | None = None,
                      priority: int = 0, images: MultimodalInputs | None = None
                      ) -> AsyncIterator[RequestOutput | PoolingRequestOutput]:
    """The request's outputs (with the loaded adapter named `lora`, if any); metrics
    recorded on the way; errors raised as APIError. An embedding request's one output
    counts its prompt tokens and latency."""
    m = state.metrics
    arrival = time.monotonic()
    last = None
    tokens = 0
    outcome = "aborted"  # unless it ends otherwise (a client that went away)
    try:
        async for out in state.engine.generate(request_id, prompt_ids, params, lora, priority, images):
            now = time.monotonic()
            new = sum(len(c.delta_token_ids) for c in out.outputs) if isinstance(out, RequestOutput) else 0
            if new:
                if last is None:
                    m.ttft.observe(now - arrival)
                    scheduled = out.metrics.get("first_scheduled_time")
                    if scheduled is not None:
                        m.queue_time.observe(max(scheduled - out.metrics.get("arrival_time", scheduled), 0.0))
                else:
                    m.itl.observe(now - last)
                last = now
                tokens += new
            if out.finished:
                outcome = "success"
                m.e2e.observe(now - arrival)
                m.prompt_tokens.inc(len(prompt_ids))
            yield out
    except OverloadedError as exc:
        outcome = "overloaded"
        raise Overloaded(str(exc)) from exc
    except (RequestError, SamplingParamsError, PoolingParamsError) as exc:
        outcome = "validation_error"
        refusal = ValidationFailed(str(exc), param=getattr(exc, "param", None))
        refusal.counted = True  # here (finally): the app's error handler must not count it again
        raise refusal from exc
    except GenerationError as exc:
        outcome = "generation_error"
        raise GenerationFailed(str(exc)) from exc
    except EngineDeadError as exc:
        outcome = "unavailable"
        raise Unavailable(str(exc)) from exc
    finally:
        m.generation_tokens.inc(tokens)
        m.requests.labels(outcome=outcome).inc()


async def final_output(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    """The last output of a request's stream (closed on the way out, aborting it if cut short)."""
    final = None
    try:
        async for out in outputs:
            final = out
    finally:
        await outputs.aclose()
    return final


async def until_done(request: Request, task: asyncio.Future):
    """`task`'s result; cancelled (and ClientGone raised) if the client disconnects first.
    One watcher per HTTP request, however many engine requests `task` waits on."""
    try:
        while not task.done():  # polled: a step of a small model is well under a millisecond
            done, _ = await asyncio.wait({task}, timeout=0.1)
            if not done and await request.is_disconnected():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                raise ClientGone("the client closed the connection")
        return await task
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def collect(request: Request, outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    """The final output of a non-streaming request; aborts it if the client disconnects."""
    try:
        return await until_done(request, asyncio.ensure_future(final_output(outputs)))
    finally:
        await outputs.aclose()
