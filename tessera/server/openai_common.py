"""What the OpenAI routes share: finish reasons, usage, request streams merged
and admitted, SSE bodies, and how logprobs name tokens."""
from __future__ import annotations

import asyncio
import json
import logging
from typing import AsyncIterator, Callable

from fastapi import Request

from tessera.engine.outputs import RequestOutput
from tessera.server.errors import APIError, ValidationFailed, openai_error_body
from tessera.server.protocol import _OpenAISampling
from tessera.server.state import ServerState
from tessera.server.tracking import until_done

logger = logging.getLogger(__name__)

FINISH = {"eos_token": "stop", "stop_sequence": "stop", "length": "length", "abort": "abort"}


def state_of(request: Request) -> ServerState:
    return request.app.state.tessera


def usage_of(n_prompt: int, n_completion: int, cached: int | None = None) -> dict:
    """OpenAI's usage; `cached` (with --enable-prompt-tokens-details, as vLLM): how many
    prompt tokens the prefix cache held."""
    usage = {"prompt_tokens": n_prompt, "completion_tokens": n_completion, "total_tokens": n_prompt + n_completion}
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return usage


def continuous_usage(body: _OpenAISampling) -> bool:
    """vLLM's stream_options.continuous_usage_stats: every chunk carries the usage so far
    (with include_usage, as vLLM requires)."""
    options = body.stream_options
    return bool(options and options.include_usage and options.continuous_usage_stats)


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


async def merge_streams(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several requests as they come, tagged with the request's position. Each
    pump owns (and closes) its stream; on exit the pumps are only cancelled."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                await queue.put((i, out))
        except BaseException as exc:  # noqa: BLE001 - delivered to the consumer
            if not isinstance(exc, asyncio.CancelledError):
                await queue.put((i, exc))
            else:
                raise
        finally:
            await stream.aclose()
            queue.put_nowait((i, done))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def admit(request: Request, stream: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    """Wait for the engine to accept the request (its first output) before the response
    starts, so that overload and engine-side validation get their HTTP status (429, 400)
    instead of an error chunk inside a 200 stream. A client that leaves meanwhile (queued,
    in a long prefill, or in a beam search, whose first output is its last) ends the
    request (ClientGone): nothing is sent yet that would show it gone."""
    try:
        first = await until_done(request, asyncio.ensure_future(stream.__anext__()))
    except BaseException:
        await stream.aclose()
        raise

    async def rest() -> AsyncIterator[RequestOutput]:
        try:
            yield first
            async for out in stream:
                yield out
        finally:
            await stream.aclose()

    return rest()


async def stream_body(chunks: AsyncIterator[dict], *streams: AsyncIterator[RequestOutput]) -> AsyncIterator[str]:
    """SSE lines of `chunks`; an error ends the stream with an error event (never a cut
    connection), and the request streams are closed either way (an abandoned one would
    hold its in-flight slot until garbage collection)."""
    try:
        async for chunk in chunks:
            yield sse(chunk)
    except APIError as exc:
        yield sse(openai_error_body(exc))
    except Exception as exc:  # a bug: say so in the stream's own dialect
        logger.exception("streaming response failed")
        yield sse(openai_error_body(APIError(f"internal error: {type(exc).__name__}: {exc}")))
    finally:
        for stream in streams:
            await stream.aclose()
    yield sse("[DONE]")


def token_label(state: ServerState, body: _OpenAISampling) -> Callable[[int], str]:
    """How logprobs name a token: its text, or (vLLM's return_tokens_as_token_ids) "token_id:N"."""
    return (lambda t: f"token_id:{t}") if body.return_tokens_as_token_ids else state.token_text


def truncated(ids: list[int], keep: int | None, limit: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: the last `keep` tokens (-1: the most the context holds)."""
    if keep is None:
        return ids
    if keep == -1:
        keep = limit
    if keep < 1:
        raise ValidationFailed("`truncate_prompt_tokens` must be >= 1 or -1", param="truncate_prompt_tokens")
    return ids[-keep:]
