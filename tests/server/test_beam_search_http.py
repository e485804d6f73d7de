"""Beam search over HTTP, as vLLM's OpenAI server takes it (`use_beam_search`,
`length_penalty`, `early_stopping` beside `n` / `best_of`), with the openai client and raw
streams: the beams come best first, streamed whole at the end, and what the engine cannot
do is refused with a 400 naming the field. Real HTTP against the shared tiny-model server."""
from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import CHAT, MODEL_NAME, PROMPT, start_server, wait_until
from tests.server.test_openai_vllm_behaviour import stream_chunks

BEAMS = {"use_beam_search": True, "ignore_eos": True}


def test_completion_beams_come_best_first(openai_client):
    out = openai_client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, n=3, logprobs=0,
                                           extra_body={**BEAMS, "length_penalty": 1.0})
    assert [c.index for c in out.choices] == [0, 1, 2]
    texts = [c.text for c in out.choices]
    assert len(set(texts)) == 3, texts
    scores = [sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs) for c in out.choices]
    assert scores == sorted(scores, reverse=True)
    assert all(c.finish_reason == "length" and len(c.logprobs.tokens) == 8 for c in out.choices)
    assert out.usage.completion_tokens == 24
    wider = openai_client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, n=3, best_of=5,
                                             extra_body=BEAMS)
    assert len(wider.choices) == 3  # 5 beams searched, the 3 best returned


def test_stop_strings_end_beams(openai_client):
    free = openai_client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, n=2, extra_body=BEAMS)
    text = free.choices[0].text
    stop = text[-3:-1]  # two characters the best beam writes near its end
    out = openai_client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, n=2, stop=[stop],
                                           extra_body=BEAMS)
    assert all(stop not in c.text for c in out.choices)
    stopped = [c for c in out.choices if c.finish_reason == "stop"]
    assert stopped and all(c.model_extra["stop_reason"] == stop for c in stopped)


def test_streamed_beams_equal_the_reply(url):
    body = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, n=2, **BEAMS)
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
    chunks = stream_chunks(url, "completions", **{k: v for k, v in body.items() if k != "model"})
    for choice in reply["choices"]:
        mine = [ch for c in chunks for ch in c["choices"] if ch["index"] == choice["index"]]
        assert "".join(ch["text"] for ch in mine) == choice["text"]
        assert mine[-1]["finish_reason"] == choice["finish_reason"]


def test_chat_beams(openai_client):
    out = openai_client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=6, n=2,
                                                extra_body={**BEAMS, "early_stopping": "never"})
    assert len(out.choices) == 2 and out.choices[0].message.content != out.choices[1].message.content


def test_beam_search_refusals(url):
    def post(**extra) -> httpx.Response:
        return httpx.post(f"{url}/v1/completions", json={"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 4,
                                                         "n": 2, "use_beam_search": True, **extra}, timeout=60)

    refused = post(response_format={"type": "json_object"})
    assert refused.status_code == 400
    assert "structured outputs (`structured_outputs`, `response_format`" in refused.json()["error"]["message"]
    refused = post(early_stopping="sometimes")
    assert refused.status_code in (400, 422)


def test_beams_beside_other_requests_under_load(server, url):
    """Beam searches of several widths (some with stop strings) among sampled and greedy
    requests, all at once: every reply is whole, and then no request and no KV block is
    left (the `server` fixture checks)."""
    import asyncio

    bodies = []
    for i in range(12):
        body = dict(model=MODEL_NAME, prompt=f"{PROMPT} {i}", max_tokens=6 + i % 5)
        if i % 3 == 0:
            body.update(use_beam_search=True, n=1 + i % 4, best_of=2 + i % 4)
        elif i % 3 == 1:
            body.update(use_beam_search=True, n=2, stop=[" "], stream=i % 2 == 0)
        else:
            body.update(temperature=0.8, seed=i, n=2)
        bodies.append(body)

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            return await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))

    for body, reply in zip(bodies, asyncio.run(run())):
        assert reply.status_code == 200, reply.text
        if not body.get("stream"):
            assert len(reply.json()["choices"]) == body.get("n", 1)


@pytest.fixture(scope="module")
def long_server(long_model_dir):
    """A 4096-token context: a search that runs for many seconds."""
    running = start_server(long_model_dir)
    yield running
    running.stop()


@pytest.mark.parametrize("route,stream", [("completions", False), ("completions", True),
                                          ("chat/completions", True)])
def test_a_client_leaving_mid_search_ends_it(long_server, route, stream):
    """Beams send nothing until they end (a stream's first chunk holds them whole); a client
    that gives up before then still aborts the search, long before it would end."""
    engine = long_server.engine
    long_server.assert_idle()
    steps = engine.num_steps
    body = {"model": MODEL_NAME, "max_tokens": 3500, "n": 2, "stream": stream, "use_beam_search": True,
            "ignore_eos": True, **({"prompt": PROMPT} if route == "completions" else {"messages": CHAT})}
    with pytest.raises(httpx.ReadTimeout), httpx.Client(timeout=httpx.Timeout(30, read=0.5)) as client:
        with client.stream("POST", f"{long_server.url}/v1/{route}", json=body) as reply:
            for _ in reply.iter_lines():  # (a chat stream's first chunks come at once)
                pass
    assert wait_until(long_server.idle, timeout=5), "the search kept running after its client left"
    assert engine.num_steps - steps < 3000
