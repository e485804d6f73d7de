"""Clients that go away, many clients at once, and more clients than the server admits."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time

import httpx
import openai
import pytest
from text_generation import Client
from text_generation.errors import OverloadedError

from tests.server.conftest import CHAT, MODEL_NAME, PROMPT, start_server, wait_until

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:text_generation")

LONG = 3500  # tokens: seconds of work for the tiny model, so a request is surely still running
LONG_PROMPT = "Paged attention"  # greedy, the tiny model does not end it (EOS) within LONG tokens


@pytest.fixture(scope="module")
def long_server(long_model_dir):
    """A 4096-token context and room for only 2 requests at a time."""
    running = start_server(long_model_dir, max_concurrent_requests=2)
    yield running
    running.stop()


@pytest.fixture
def busy(long_server):
    long_server.assert_idle()
    yield long_server
    long_server.assert_idle()


def _aborted(server) -> float:
    text = httpx.get(server.url + "/metrics").text
    for line in text.splitlines():
        if line.startswith('tessera_requests_total{outcome="aborted"}'):
            return float(line.split()[1])
    return 0.0


class SSE:
    """Reads the events of an open streamed response, a few at a time. The line iterator is
    kept: dropping an httpx line iterator before the end closes the connection."""

    def __init__(self, response: httpx.Response):
        assert response.status_code == 200
        self.lines = response.iter_lines()

    def read(self, count: int) -> list[dict]:
        events = []
        while len(events) < count:
            line = next(self.lines)
            if line.startswith("data:"):
                events.append(json.loads(line[5:]))
        return events


@contextlib.contextmanager
def uvicorn_errors():
    """ERROR records the server logs (an exception in the ASGI app) while the block runs."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler = Keep(level=logging.ERROR)
    logger = logging.getLogger("uvicorn.error")
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


@pytest.mark.parametrize("route,body", [
    # TGI has no ignore_eos: a prompt whose greedy continuation runs past LONG tokens
    ("/generate_stream", {"inputs": LONG_PROMPT, "parameters": {"max_new_tokens": LONG}}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": LONG, "stream": True, "ignore_eos": True}),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": LONG, "stream": True, "ignore_eos": True}),
])
def test_disconnect_mid_stream_frees_the_kv_cache(busy, route, body):
    engine = busy.engine
    steps, aborted = engine.num_steps, _aborted(busy)
    with uvicorn_errors() as errors, httpx.Client(base_url=busy.url, timeout=30) as client:
        with client.stream("POST", route, json=body) as r:
            reader = SSE(r)
            assert len(reader.read(2)) == 2
            time.sleep(0.1)
            assert engine.num_in_flight == 1  # still running: the client has not gone yet
            assert not engine.engine.block_manager.all_free()
        # the client has gone: the request is aborted and its blocks freed, long before it could end
        assert wait_until(busy.idle, timeout=5), "KV blocks still in use after the client disconnected"
        assert engine.num_steps - steps < LONG // 2
        assert wait_until(lambda: _aborted(busy) == aborted + 1, timeout=2)
        time.sleep(0.1)
    # a client going away is not a server error
    assert not errors, errors[0].getMessage() + "\n" + str(errors[0].exc_info and errors[0].exc_info[1])


@pytest.mark.parametrize("route,body", [
    ("/generate", {"inputs": LONG_PROMPT, "parameters": {"max_new_tokens": LONG}}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": LONG, "ignore_eos": True}),
])
def test_client_timeout_on_a_non_streaming_request_aborts(busy, route, body):
    engine = busy.engine
    steps = engine.num_steps
    try:
        with uvicorn_errors() as errors:
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(busy.url + route, json=body, timeout=httpx.Timeout(30, read=0.3))
            assert wait_until(busy.idle, timeout=3), "a non-streaming request outlived its client"
            assert engine.num_steps - steps < LONG // 2
            time.sleep(0.2)
        # a client going away is not a server error (no traceback in the log)
        assert not errors, errors[0].getMessage() + "\n" + str(errors[0].exc_info and errors[0].exc_info[1])
    finally:
        wait_until(busy.idle, timeout=60)  # not the next test's business


@contextlib.contextmanager
def _two_long_streams(server):
    """Two streams in flight (each has sent a token) for as long as the block runs."""
    readers = []
    with httpx.Client(base_url=server.url, timeout=30) as client, contextlib.ExitStack() as stack:
        for _ in range(2):
            r = stack.enter_context(client.stream("POST", "/v1/chat/completions", json={
                "messages": CHAT, "max_tokens": LONG, "ignore_eos": True, "stream": True}))
            reader = SSE(r)
            assert len(reader.read(2)) == 2  # the role chunk and a token
            readers.append(reader)
        assert server.engine.num_in_flight == 2
        yield


def test_overloaded_is_429(busy):
    url = busy.url
    with _two_long_streams(busy):
        r = httpx.post(url + "/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 2}})
        assert r.status_code == 429
        assert r.json() == {"error": "Model is overloaded", "error_type": "overloaded"}

        r = httpx.post(url + "/", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 2}})
        assert r.status_code == 429 and r.json()["error_type"] == "overloaded"

        r = httpx.post(url + "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2})
        assert r.status_code == 429
        err = r.json()["error"]
        assert err["code"] == 429 and "overloaded" in err["message"].lower()

        # TGI reports a refused stream as an error event of a 200 stream (its clients raise
        # the same error for either)
        r = httpx.post(url + "/generate_stream", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 2}})
        if r.status_code == 200:
            events = [json.loads(line[5:]) for line in r.text.split("\n") if line.startswith("data:")]
            assert events == [{"error": "Model is overloaded", "error_type": "overloaded"}]
        else:
            assert r.status_code == 429 and r.json()["error_type"] == "overloaded"

        tgi = Client(url, timeout=30)
        with pytest.raises(OverloadedError):
            tgi.generate(PROMPT, max_new_tokens=2)
        with pytest.raises(OverloadedError):
            list(tgi.generate_stream(PROMPT, max_new_tokens=2))
        with openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as oa:
            with pytest.raises(openai.RateLimitError):
                oa.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2)
    # the streams are gone: the server admits requests again
    assert wait_until(busy.idle, timeout=5)
    r = httpx.post(url + "/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 2}})
    assert r.status_code == 200


def test_overloaded_openai_stream_is_429(busy):
    with _two_long_streams(busy):
        r = httpx.post(busy.url + "/v1/chat/completions",
                       json={"messages": CHAT, "max_tokens": 2, "stream": True})
        assert r.status_code == 429
        assert r.json()["error"]["code"] == 429


def test_64_concurrent_streams_match_the_request_alone(server):
    url = server.url
    prompts = [PROMPT, "Paged attention", "Continuous batching lets", "def fibonacci(n):"]
    params = {"max_new_tokens": 16, "details": True}
    alone = {}
    for p in prompts:
        body = httpx.post(url + "/generate", json={"inputs": p, "parameters": params}).json()
        alone[p] = (body["generated_text"], [t["id"] for t in body["details"]["tokens"]])

    peak = [0]
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], server.engine.num_in_flight)
            time.sleep(0.005)

    async def one(client: httpx.AsyncClient, prompt: str) -> tuple[str, list[int]]:
        ids, text = [], None
        async with client.stream("POST", "/generate_stream",
                                 json={"inputs": prompt, "parameters": params}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    event = json.loads(line[5:])
                    assert "error" not in event, event
                    ids.append(event["token"]["id"])
                    text = event["generated_text"] if event["generated_text"] is not None else text
        return text, ids

    async def main():
        limits = httpx.Limits(max_connections=80, max_keepalive_connections=80)
        async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
            return await asyncio.wait_for(
                asyncio.gather(*(one(client, prompts[i % len(prompts)]) for i in range(64))), timeout=90)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        results = asyncio.run(main())
    finally:
        stop.set()
        watcher.join()
    assert len(results) == 64
    for i, got in enumerate(results):
        assert got == alone[prompts[i % len(prompts)]], f"client {i}"
    assert peak[0] > 8, "the clients did not overlap"


@contextlib.contextmanager
def _one_long_stream(server):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        with client.stream("POST", "/v1/chat/completions", json={
                "messages": CHAT, "max_tokens": LONG, "ignore_eos": True, "stream": True}) as r:
            reader = SSE(r)
            assert len(reader.read(2)) == 2
            assert server.engine.num_in_flight == 1
            yield reader


def test_batch_of_prompts_partly_overloaded(busy):
    """Two prompts in one /v1/completions request, room for one: a 429, and the admitted
    prompt does not keep running for nobody."""
    engine = busy.engine
    body = {"prompt": [PROMPT, LONG_PROMPT], "max_tokens": LONG, "ignore_eos": True}
    with _one_long_stream(busy):
        steps = engine.num_steps
        r = httpx.post(busy.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 429 and r.json()["error"]["code"] == 429
        assert wait_until(lambda: engine.num_in_flight == 1, timeout=3), "the admitted prompt kept running"
        assert engine.num_steps - steps < LONG // 2


def test_streamed_batch_partly_overloaded_ends_cleanly(busy):
    body = {"prompt": [PROMPT, LONG_PROMPT], "max_tokens": LONG, "ignore_eos": True, "stream": True}
    with _one_long_stream(busy):
        try:
            r = httpx.post(busy.url + "/v1/completions", json=body, timeout=30)
        except httpx.RemoteProtocolError as exc:  # the server broke the chunked body off
            pytest.fail(f"stream broken off: {exc}")
        if r.status_code == 200:
            assert r.text.endswith("data: [DONE]\n\n")
            errors = [json.loads(line[5:]) for line in r.text.split("\n")
                      if line.startswith("data:") and '"error"' in line]
            assert errors and errors[0]["error"]["code"] == 429
        else:
            assert r.status_code == 429
        assert wait_until(lambda: busy.engine.num_in_flight == 1, timeout=3)
