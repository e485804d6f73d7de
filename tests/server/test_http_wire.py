"""The wire formats of API.md checked byte by byte with raw httpx: error shapes and TGI's
validation messages, defaults, SSE framing, headers, /info, /tokenize, /metrics."""
from __future__ import annotations

import json

import httpx
import pytest

from tests.server.conftest import CHAT, MODEL_NAME, PROMPT

JSON = {"content-type": "application/json"}


def sse_data(body: str) -> list[str]:
    """The `data` payloads of an SSE body, in order (each line as sent, after `data:`)."""
    out = []
    for event in body.split("\n\n"):
        lines = [line for line in event.split("\n") if line]
        for line in lines:
            assert line.startswith("data:"), f"unexpected SSE line {line!r}"
            out.append(line[len("data:"):])
    return out


def prompt_len(url: str, text: str = PROMPT) -> int:
    return len(httpx.post(url + "/tokenize", json={"inputs": text}).json())


def tgi_error(r: httpx.Response, status: int, error_type: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error", "error_type"} and body["error_type"] == error_type
    return body["error"]


def openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    assert isinstance(err["message"], str) and err["message"]
    return err


def stream_validation_error(r: httpx.Response) -> str:
    """TGI answers a bad /generate_stream request with a 200 stream holding one error event;
    an up-front 422 is just as good for its clients. Either way: the message."""
    if r.status_code == 422:
        return tgi_error(r, 422, "validation")
    assert r.status_code == 200, r.text
    events = [json.loads(d) for d in sse_data(r.text)]
    assert len(events) == 1 and events[0]["error_type"] == "validation"
    return events[0]["error"]


# --- malformed bodies ------------------------------------------------------------------------

@pytest.mark.parametrize("route", ["/generate", "/generate_stream", "/"])
def test_malformed_json_tgi(url, route):
    msg = tgi_error(httpx.post(url + route, content=b'{"inputs": "x",', headers=JSON), 422, "validation")
    assert msg.startswith("Input validation error: ")


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_malformed_json_openai(url, route):
    openai_error(httpx.post(url + route, content=b'{"messages": [', headers=JSON), 400)


@pytest.mark.parametrize("body", [
    {"inputs": 5},
    {"parameters": {"max_new_tokens": 2}},
    {"inputs": "x", "parameters": {"max_new_tokens": "many"}},
    {"inputs": "x", "parameters": {"stop": "not a list"}},
    {"inputs": "x", "parameters": [1, 2]},
])
def test_wrong_types_tgi(url, body):
    tgi_error(httpx.post(url + "/generate", json=body), 422, "validation")


@pytest.mark.parametrize("route,body", [
    ("/v1/chat/completions", {"messages": "hi"}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": "lots"}),
    ("/v1/chat/completions", {"messages": CHAT, "n": [2]}),
    ("/v1/completions", {"prompt": {"text": "hi"}}),
    ("/v1/completions", {"prompt": "hi", "logprobs": "yes"}),
])
def test_wrong_types_openai(url, route, body):
    openai_error(httpx.post(url + route, json=body), 400)


# --- TGI validation, TGI's messages ----------------------------------------------------------

V = "Input validation error: "


@pytest.mark.parametrize("params,message", [
    ({"temperature": 0.0}, "`temperature` must be strictly positive"),
    ({"top_p": 1.0}, "`top_p` must be > 0.0 and < 1.0"),
    ({"top_p": 0.0}, "`top_p` must be > 0.0 and < 1.0"),
    ({"typical_p": 1.0}, "`typical_p` must be > 0.0 and < 1.0"),
    ({"top_k": 0}, "`top_k` must be strictly positive"),
    ({"repetition_penalty": 0.0}, "`repetition_penalty` must be strictly positive"),
    ({"max_new_tokens": 0}, "`max_new_tokens` must be strictly positive"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "`stop` supports up to 4 stop sequences. Given: 5"),
    ({"best_of": 3, "do_sample": True}, "`best_of` must be > 0 and <= 2. Given: 3"),
    ({"best_of": 2}, "you must use sampling when `best_of` is > 1"),
    ({"best_of": 2, "do_sample": True, "seed": 3}, "`seed` must not be set when `best_of` > 1"),
    ({"top_n_tokens": 6}, "`top_n_tokens` must be >= 0 and <= 5. Given: 6"),
    ({"truncate": 0}, "`truncate` must be strictly positive and less than 511. Given: 0"),
    ({"truncate": 600}, "`truncate` must be strictly positive and less than 511. Given: 600"),
])
def test_tgi_validation_messages(url, params, message):
    r = httpx.post(url + "/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 2, **params}})
    assert tgi_error(r, 422, "validation") == V + message


def test_empty_inputs(url):
    r = httpx.post(url + "/generate", json={"inputs": "", "parameters": {"max_new_tokens": 2}})
    assert tgi_error(r, 422, "validation") == V + "`inputs` cannot be empty"


def test_too_long_exact_message(url):
    n = prompt_len(url)
    r = httpx.post(url + "/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 600}})
    assert tgi_error(r, 422, "validation") == (
        V + f"`inputs` tokens + `max_new_tokens` must be <= 512. Given: {n} `inputs` tokens and 600 "
        "`max_new_tokens`")
    # the limit is inclusive
    r = httpx.post(url + "/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 512 - n,
                                                                           "stop": ["e"]}})
    assert r.status_code == 200


def test_input_longer_than_max_input_tokens(url, server, monkeypatch):
    monkeypatch.setattr(server.state.limits, "max_input_tokens", 3)
    n = prompt_len(url)
    r = httpx.post(url + "/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 2}})
    assert tgi_error(r, 422, "validation") == V + f"`inputs` must have less than 3 tokens. Given: {n}"


@pytest.mark.parametrize("params", [
    {"grammar": {"type": "lark", "value": "start: 'a'"}},
    {"grammar": {"type": "regex", "value": ["[ab]+"]}},
    {"adapter_id": "some/adapter"},
])
def test_unsupported_features_are_422(url, params):
    r = httpx.post(url + "/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 2, **params}})
    assert next(iter(params)) in tgi_error(r, 422, "validation")


def test_a_grammar_that_does_not_compile_is_422_with_the_reason(url, server):
    r = httpx.post(url + "/generate", json={"inputs": PROMPT, "parameters": {
        "max_new_tokens": 2, "grammar": {"type": "regex", "value": "[ab"}}})
    assert tgi_error(r, 422, "validation") == (
        V + "invalid regex constraint: Regex parsing error at position 4: Unclosed '['")
    server.assert_idle()


@pytest.mark.parametrize("params,message", [
    ({"best_of": 2, "do_sample": True}, "`best_of` != 1 is not supported when streaming tokens"),
    ({"decoder_input_details": True}, "`decoder_input_details` == true is not supported when streaming tokens"),
    ({"top_p": 1.0}, "`top_p` must be > 0.0 and < 1.0"),
])
def test_stream_validation(url, params, message):
    r = httpx.post(url + "/generate_stream", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 2, **params}})
    assert stream_validation_error(r) == V + message


# --- TGI defaults and response shapes ---------------------------------------------------------

def test_truncate_keeps_the_last_tokens(url):
    ids = [t["id"] for t in httpx.post(url + "/tokenize", json={"inputs": PROMPT}).json()]
    r = httpx.post(url + "/generate", json={"inputs": PROMPT, "parameters": {
        "max_new_tokens": 2, "truncate": 3, "decoder_input_details": True}})
    assert r.status_code == 200, r.text
    assert [t["id"] for t in r.json()["details"]["prefill"]] == ids[-3:]
    assert r.headers["x-prompt-tokens"] == "3"


def test_no_parameters_object_samples_without_details(url):
    n = prompt_len(url)
    texts = []
    for _ in range(2):
        r = httpx.post(url + "/generate", json={"inputs": PROMPT}, timeout=60)
        assert r.status_code == 200, r.text
        assert set(r.json()) == {"generated_text"}
        # max_new_tokens defaults to max_total_tokens - input length (EOS may come first)
        assert 1 <= int(r.headers["x-generated-tokens"]) <= 512 - n
        texts.append(r.json()["generated_text"])
    assert texts[0] != texts[1]  # do_sample: true


def test_empty_parameters_object_is_greedy(url):
    bodies = [httpx.post(url + "/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 10}}).json()
              for _ in range(2)]
    assert bodies[0] == bodies[1] and set(bodies[0]) == {"generated_text"}


def test_details_key_only_when_asked(url):
    def keys(**params):
        r = httpx.post(url + "/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 3, **params}})
        assert r.status_code == 200, r.text
        return r.json()

    assert set(keys()) == {"generated_text"}
    assert set(keys(details=False, decoder_input_details=False)) == {"generated_text"}
    with_prefill = keys(decoder_input_details=True)["details"]
    assert len(with_prefill["prefill"]) == prompt_len(url)
    details = keys(details=True)["details"]
    assert set(details) >= {"finish_reason", "generated_tokens", "seed", "prefill", "tokens"}
    assert details["prefill"] == [] and "top_tokens" not in details and "best_of_sequences" not in details
    assert set(details["tokens"][0]) == {"id", "text", "logprob", "special"}


def test_return_full_text(url):
    plain = httpx.post(url + "/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 4}}).json()
    full = httpx.post(url + "/generate", json={"inputs": PROMPT, "parameters": {
        "max_new_tokens": 4, "return_full_text": True}}).json()
    assert full["generated_text"] == PROMPT + plain["generated_text"]


def test_generate_headers(url):
    r = httpx.post(url + "/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 5, "details": True}})
    h = r.headers
    for name in ("x-compute-type", "x-compute-time", "x-compute-characters", "x-total-time",
                 "x-validation-time", "x-queue-time", "x-inference-time", "x-time-per-token",
                 "x-prompt-tokens", "x-generated-tokens"):
        assert name in h, name
    assert h["x-compute-type"] == "cpu"
    assert float(h["x-compute-time"]) > 0
    assert h["x-compute-characters"] == str(len(PROMPT))
    for name in ("x-total-time", "x-validation-time", "x-queue-time", "x-inference-time", "x-time-per-token"):
        assert int(h[name]) >= 0, name
    assert int(h["x-total-time"]) >= int(h["x-inference-time"])
    assert int(h["x-prompt-tokens"]) == prompt_len(url)
    assert int(h["x-generated-tokens"]) == r.json()["details"]["generated_tokens"]


# --- SSE framing ------------------------------------------------------------------------------

def test_generate_stream_sse(url):
    n = prompt_len(url)
    r = httpx.post(url + "/generate_stream", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 6,
                                                                                    "details": True}})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["x-accel-buffering"] == "no" and r.headers["x-compute-type"] == "cpu"
    assert r.headers["x-compute-characters"] == str(len(PROMPT))
    lines = [line for line in r.text.split("\n") if line]
    assert all(line.startswith("data:{") for line in lines), lines  # no space, no [DONE]
    events = [json.loads(line[5:]) for line in lines]
    assert [e["index"] for e in events] == list(range(1, len(events) + 1))
    for e in events:
        assert set(e) == {"index", "token", "top_tokens", "generated_text", "details"}
        assert set(e["token"]) == {"id", "text", "logprob", "special"} and e["top_tokens"] == []
    assert all(e["generated_text"] is None and e["details"] is None for e in events[:-1])
    last = events[-1]
    greedy = httpx.post(url + "/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 6}}).json()
    assert last["generated_text"] == greedy["generated_text"]
    assert last["details"]["generated_tokens"] == len(events)
    assert last["details"]["input_length"] == n and last["details"]["seed"] is None
    assert last["details"]["finish_reason"] in ("length", "eos_token")


def test_generate_stream_without_details(url):
    r = httpx.post(url + "/generate_stream", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 3}})
    events = [json.loads(d) for d in sse_data(r.text)]
    assert events[-1]["generated_text"] is not None and events[-1]["details"] is None


@pytest.mark.parametrize("route", ["/", "/invocations"])  # TGI's compat route, and SageMaker's name for it
def test_compat_route(url, route):
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 4, "details": True}}
    single = httpx.post(url + "/generate", json=body).json()
    r = httpx.post(url + route, json=body)
    assert r.status_code == 200 and isinstance(r.json(), list)
    assert r.json()[0]["generated_text"] == single["generated_text"]
    assert "x-generated-tokens" in r.headers
    r = httpx.post(url + route, json={**body, "stream": True})
    assert r.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(d) for d in sse_data(r.text)]
    assert events[-1]["generated_text"] == single["generated_text"]


@pytest.mark.parametrize("route,body", [
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 4, "stream": True}),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "stream": True}),
])
def test_openai_streams_end_with_done(url, route, body):
    r = httpx.post(url + route, json=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.text.endswith("data: [DONE]\n\n")
    data = sse_data(r.text)
    assert data[-1] == " [DONE]" and data.count(" [DONE]") == 1
    for d in data[:-1]:
        assert d.startswith(" {")
        chunk = json.loads(d)
        assert chunk["model"] == MODEL_NAME and "error" not in chunk


def test_chat_stream_chunk_fields(url):
    r = httpx.post(url + "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 3, "stream": True})
    chunks = [json.loads(d) for d in sse_data(r.text)[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    for c in chunks:
        assert c["object"] == "chat.completion.chunk" and c["id"].startswith("chatcmpl-")
        assert "usage" not in c or c["usage"] is None  # no include_usage asked


# --- operational routes -----------------------------------------------------------------------

def test_info_has_the_required_keys(url, server):
    info = httpx.get(url + "/info").json()
    required = {"model_id": str, "max_concurrent_requests": int, "max_best_of": int, "max_stop_sequences": int,
                "max_input_tokens": int, "max_total_tokens": int, "validation_workers": int,
                "max_client_batch_size": int, "router": str, "version": str}
    for key, kind in required.items():
        assert isinstance(info.get(key), kind), key
    for key in ("model_sha", "model_pipeline_tag", "sha", "docker_label"):
        assert key in info, key
    assert info["model_id"] == MODEL_NAME
    assert info["max_total_tokens"] == server.engine.engine.max_model_len == 512
    assert info["max_input_tokens"] == 511
    assert info["max_best_of"] == 2 and info["max_stop_sequences"] == 4
    assert info["max_concurrent_requests"] == 128


def test_tokenize(url, server):
    text = "Paged attention, naïve café 🙂"
    r = httpx.post(url + "/tokenize", json={"inputs": text})
    assert r.status_code == 200
    toks = r.json()
    assert [t["id"] for t in toks] == list(server.state.tokenizer(text).input_ids)
    for t in toks:
        assert set(t) == {"id", "text", "start", "stop"}
        assert t["text"] == text[t["start"]:t["stop"]]
    assert toks[0]["start"] == 0 and toks[-1]["stop"] == len(text)
    assert all(a["start"] <= b["start"] and a["stop"] <= b["stop"] for a, b in zip(toks, toks[1:]))


def test_health(url):
    r = httpx.get(url + "/health")
    assert r.status_code == 200


def test_metrics(url):
    httpx.post(url + "/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 2}})
    r = httpx.get(url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    for name in ("tessera_requests_total", "tessera_time_to_first_token_seconds", "tessera_kv_cache_usage_ratio",
                 "tessera_prompt_tokens_total", "tessera_generation_tokens_total",
                 "tessera_e2e_request_latency_seconds", "tessera_num_requests_running"):
        assert name in text, name
    samples = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
               if line and not line.startswith("#")}
    assert samples['tessera_requests_total{outcome="success"}'] >= 1
    assert samples["tessera_prompt_tokens_total"] >= prompt_len(url)
    assert samples["tessera_time_to_first_token_seconds_count"] >= 1
    assert all(name.startswith("tessera_") for name in samples)


def test_refused_requests_are_counted_once(url):
    """TGI counts validation failures; a request refused by the route (422 / 400), by the
    body's schema, or by the engine (a logit_bias id past the vocabulary) counts once."""
    def refused() -> float:
        text = httpx.get(url + "/metrics").text
        line = next((l for l in text.splitlines() if l.startswith('tessera_requests_total{outcome="validation_error"}')),
                    None)
        return float(line.split(" ")[1]) if line else 0.0

    before = refused()
    assert httpx.post(url + "/generate", json={"inputs": PROMPT, "parameters": {"temperature": 0}}).status_code == 422
    assert httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "n": "x"}).status_code == 400
    r = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "logit_bias": {"999999": 1}})
    assert r.status_code == 400
    assert refused() == before + 3


def test_body_too_large_is_413(url, server, monkeypatch):
    monkeypatch.setattr(server.state.limits, "max_body_bytes", 100)
    r = httpx.post(url + "/generate", json={"inputs": "x" * 200})
    assert tgi_error(r, 413, "validation")
    openai_error(httpx.post(url + "/v1/completions", json={"prompt": "x" * 200}), 413)
