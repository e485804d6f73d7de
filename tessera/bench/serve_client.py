"""The load generator of `tessera bench serve`: streaming requests against a running TGI or
OpenAI-compatible server, at fixed concurrency or Poisson arrivals, each timed per chunk.

Streaming is what makes TTFT and inter-token latency measurable from the outside: the time
of each `data:` line is the time its token(s) reached the client."""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Literal

import httpx
from tqdm import tqdm

Backend = Literal["tgi", "openai", "openai-chat"]
BACKENDS: tuple[str, ...] = ("tgi", "openai", "openai-chat")
PATHS = {"tgi": "/generate_stream", "openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}


@dataclass
class RequestRecord:
    """One request, as the client saw it. Times are seconds; `start_s` is from the run's start."""
    ok: bool
    start_s: float = 0.0
    ttft_s: float = 0.0          # until the first chunk carrying generated output
    e2e_s: float = 0.0           # until the stream ended
    output_tokens: int = 0       # server's count when it gives one (TGI details, OpenAI usage)
    prompt_tokens: int | None = None  # None: the server did not say
    chunks: int = 0              # chunks carrying output (one per token, but see itl_s)
    itl_s: list[float] = field(default_factory=list)  # gaps between those chunks: chunks - 1 of them
    error: str = ""


@dataclass
class LevelRun:
    records: list[RequestRecord]
    duration_s: float  # first send to last response, the denominator of every throughput


def poisson_schedule(num: int, rate: float, seed: int) -> list[float]:
    """Send times (seconds from the start) of `num` requests arriving as a Poisson process of
    `rate` per second; an infinite rate sends everything at once."""
    if rate == float("inf"):
        return [0.0] * num
    rng = random.Random(seed)
    t, times = 0.0, []
    for _ in range(num):
        times.append(t)
        t += rng.expovariate(rate)  # exponential gaps: a Poisson process
    return times


def request_body(backend: Backend, prompt: str, output_len: int, model: str | None) -> dict:
    """Greedy, exactly `output_len` new tokens where the protocol allows it."""
    if backend == "tgi":
        # TGI has no ignore_eos: no stop strings and max_new_tokens is the closest; details
        # give the server's own token count.
        return {"inputs": prompt, "parameters": {"max_new_tokens": output_len, "do_sample": False,
                                                 "details": True, "stop": []}}
    body: dict = {"max_tokens": output_len, "temperature": 0.0, "stream": True, "ignore_eos": True,
                  "stream_options": {"include_usage": True}}
    if model is not None:
        body["model"] = model
    if backend == "openai":
        body["prompt"] = prompt
    else:
        body["messages"] = [{"role": "user", "content": prompt}]
    return body


def _carries_output(backend: Backend, event: dict) -> bool:
    if backend == "tgi":
        return "token" in event
    choices = event.get("choices") or []
    if not choices:
        return False  # the usage chunk
    # the chat stream opens with a role-only chunk: no token yet
    return backend == "openai" or "role" not in choices[0].get("delta", {})


def _error_of(event: dict) -> str | None:
    err = event.get("error")
    if err is None:
        return None
    return err.get("message", str(err)) if isinstance(err, dict) else str(err)


async def send_request(client: httpx.AsyncClient, url: str, backend: Backend, body: dict,
                       start: float) -> RequestRecord:
    """One streaming request; every failure (connection, HTTP status, error event) becomes a
    failed record, never an exception, so one bad request cannot end the run."""
    sent = time.perf_counter()
    rec = RequestRecord(ok=False, start_s=sent - start)
    last = sent
    server_tokens = None
    try:
        async with client.stream("POST", url + PATHS[backend], json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                rec.error = f"HTTP {response.status_code}: {text[:300]}"
                return rec
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                event = json.loads(data)
                if (error := _error_of(event)) is not None:
                    rec.error = error
                    return rec
                if _carries_output(backend, event):
                    if rec.chunks == 0:
                        rec.ttft_s = now - sent
                    else:
                        rec.itl_s.append(now - last)
                    rec.chunks += 1
                    last = now
                details = event.get("details") if backend == "tgi" else event.get("usage")
                if details:
                    server_tokens = details.get("generated_tokens", details.get("completion_tokens"))
                    rec.prompt_tokens = details.get("input_length", details.get("prompt_tokens"))
        rec.e2e_s = time.perf_counter() - sent
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
        return rec
    rec.output_tokens = server_tokens if server_tokens is not None else rec.chunks
    rec.ok = rec.chunks > 0 or rec.output_tokens > 0
    if not rec.ok:
        rec.error = "the stream ended without any output"
    return rec


async def run_level(url: str, backend: Backend, bodies: list[dict], concurrency: int | None,
                    schedule: list[float], timeout_s: float = 600.0, progress: bool = True) -> LevelRun:
    """Send `bodies[i]` at `schedule[i]`, with at most `concurrency` in flight (None: no cap)."""
    gate = asyncio.Semaphore(concurrency) if concurrency else None
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)  # the gate is the cap
    bar = tqdm(total=len(bodies), desc=f"concurrency {concurrency or 'max'}", disable=not progress,
               leave=False)
    url = url.rstrip("/")

    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0), limits=limits) as client:
        start = time.perf_counter()

        async def one(body: dict, at: float) -> RequestRecord:
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - start)))
            if gate is None:
                rec = await send_request(client, url, backend, body, start)
            else:
                async with gate:
                    rec = await send_request(client, url, backend, body, start)
            bar.update(1)
            return rec

        records = await asyncio.gather(*(one(b, t) for b, t in zip(bodies, schedule)))
        duration = time.perf_counter() - start
    bar.close()
    return LevelRun(list(records), duration)


def served_model(url: str, timeout_s: float = 10.0) -> str | None:
    """The first id of GET /v1/models (OpenAI bodies name their model); None if unavailable."""
    try:
        data = httpx.get(url.rstrip("/") + "/v1/models", timeout=timeout_s).json()
        return data["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return None
