"""A server whose engine schedules asynchronously (the default on CUDA) answers as a plain
one does, for concurrent clients, streamed and not, with stop sequences and penalties (a
step that must wait for the last token), and a client that leaves mid-stream frees its
blocks. On CPU a launch runs the step before returning, so this checks the bookkeeping
(pending tokens, dropped tokens of finished sequences, deferred aborts), not overlap."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from text_generation import Client

from tests.server.conftest import CHAT, MODEL_NAME, start_server, wait_until
from tests.server.test_load import LONG, LONG_PROMPT, SSE

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:text_generation")

PROMPTS = ["Paged attention", "The quick brown fox", "Continuous batching", "A KV cache"]


@pytest.fixture(scope="module")
def async_server(tiny_model_dir):
    running = start_server(tiny_model_dir, llm_kwargs={"async_scheduling": True})
    assert running.engine.engine.config.scheduler.async_scheduling
    yield running
    running.stop()


def _tgi_answers(url: str) -> list[tuple[str, list[int], str]]:
    """Concurrent greedy requests of different lengths, one with a stop sequence, one with
    a repetition penalty and one watermarked: (text, token ids, finish reason) each."""
    client = Client(url, timeout=60)
    jobs = [dict(prompt=p, max_new_tokens=5 + 7 * i) for i, p in enumerate(PROMPTS)]
    jobs += [dict(prompt=PROMPTS[0], max_new_tokens=30, stop_sequences=[" the"]),
             dict(prompt=PROMPTS[1], max_new_tokens=20, repetition_penalty=1.3),
             dict(prompt=PROMPTS[2], max_new_tokens=20, watermark=True)]  # seeded by the last token

    def run(job: dict) -> tuple[str, list[int], str]:
        job = dict(job)
        out = client.generate(job.pop("prompt"), **job)
        return out.generated_text, [t.id for t in out.details.tokens], str(out.details.finish_reason)

    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(run, jobs))


def test_concurrent_tgi_answers_equal_a_plain_servers(async_server, server):
    assert _tgi_answers(async_server.url) == _tgi_answers(server.url)
    async_server.assert_idle()


def test_streams_equal_a_plain_servers(async_server, server):
    plain, fast = Client(server.url, timeout=60), Client(async_server.url, timeout=60)
    expected = plain.generate(PROMPTS[0], max_new_tokens=24)
    streamed = list(fast.generate_stream(PROMPTS[0], max_new_tokens=24))
    assert [r.token.id for r in streamed] == [t.id for t in expected.details.tokens]
    assert streamed[-1].generated_text == expected.generated_text

    answers = []
    for url in (server.url, async_server.url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
        chunks = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=16, temperature=0,
                                                stream=True, stream_options={"include_usage": True})
        text, usage = "", None
        for chunk in chunks:
            text += "".join(c.delta.content or "" for c in chunk.choices)
            usage = chunk.usage or usage
        answers.append((text, usage.completion_tokens))
    assert answers[0] == answers[1]
    async_server.assert_idle()


@pytest.fixture(scope="module")
def long_async_server(long_model_dir):
    running = start_server(long_model_dir, llm_kwargs={"async_scheduling": True})
    yield running
    running.stop()


def test_a_client_leaving_mid_stream_frees_its_blocks(long_async_server):
    body = {"inputs": LONG_PROMPT, "parameters": {"max_new_tokens": LONG}}
    engine = long_async_server.engine
    steps = engine.num_steps
    with httpx.Client(base_url=long_async_server.url, timeout=30) as client:
        with client.stream("POST", "/generate_stream", json=body) as r:
            reader = SSE(r)  # kept: a dropped line iterator closes the connection (a disconnect)
            assert len(reader.read(2)) == 2
            assert engine.num_in_flight == 1 and not engine.engine.block_manager.all_free()
        assert wait_until(long_async_server.idle, timeout=5), "KV blocks still in use after the client left"
    assert engine.num_steps - steps < LONG // 2  # aborted, not run to the end
