"""Beam search over HTTP, as vLLM's OpenAI server takes it (`use_beam_search`,
`length_penalty`, `early_stopping` beside `n` / `best_of`), with the openai client and raw
streams: the beams come best first, streamed whole at the end, and what the engine cannot
do is refused with a 400 naming the field. Real HTTP against the shared tiny-model server."""
from __future__ import annotations

import httpx

from tests.server.conftest import CHAT, MODEL_NAME, PROMPT
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
