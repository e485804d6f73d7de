"""Structured outputs over real HTTP: TGI's `grammar` (through TGI's own client), OpenAI's
`response_format` (through the openai package, streamed and not), vLLM's
`structured_outputs` and `guided_*` extras; and the errors for bad or conflicting
constraints. The tiny random model writes noise unless constrained."""
from __future__ import annotations

import json
import re

import httpx
import pytest
from text_generation import Client
from text_generation.types import Grammar, GrammarType

from tests.sampling.test_structured_outputs import SCHEMA, valid_against_schema
from tests.server.conftest import CHAT, MODEL_NAME, PROMPT
from tests.server.test_http_wire import openai_error, tgi_error

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:text_generation")


def test_tgi_client_json_grammar(url, server):
    out = Client(url, timeout=30).generate(PROMPT, max_new_tokens=60, grammar=Grammar(type=GrammarType.Json, value=SCHEMA))
    assert valid_against_schema(out.generated_text), out.generated_text
    assert out.details.finish_reason == "eos_token"
    server.assert_idle()


@pytest.mark.parametrize("grammar,valid", [
    ({"type": "regex", "value": "[0-9]{3}"}, lambda t: re.fullmatch("[0-9]{3}", t)),
    ({"type": "json_schema", "value": {"name": "thing", "schema": SCHEMA}}, valid_against_schema),
    ({"type": "json", "value": json.dumps(SCHEMA)}, valid_against_schema),
])
@pytest.mark.parametrize("route", ["/generate", "/generate_stream"])
def test_tgi_grammar_kinds(url, grammar, valid, route):
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 60, "grammar": grammar, "do_sample": True, "seed": 4}}
    r = httpx.post(url + route, json=body, timeout=30)
    assert r.status_code == 200, r.text
    if route == "/generate":
        text = r.json()["generated_text"]
    else:
        events = [json.loads(line[5:]) for line in r.text.splitlines() if line.startswith("data:")]
        text = events[-1]["generated_text"]
        assert text == "".join(e["token"]["text"] for e in events if not e["token"]["special"])
    assert valid(text), text


def test_openai_chat_json_schema_stream_and_not(client, server):
    response_format = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
    full = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=60, temperature=0,
                                          response_format=response_format)
    text = full.choices[0].message.content
    assert valid_against_schema(text), text
    assert full.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=60, temperature=0,
                                            response_format=response_format, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text
    server.assert_idle()


def test_openai_chat_json_object(client):
    out = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=120, temperature=0.7, seed=2,
                                         response_format={"type": "json_object"})
    text = out.choices[0].message.content
    assert text.startswith("{")
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("extra,valid", [
    ({"guided_choice": ["alpha", "beta"]}, lambda t: t in ("alpha", "beta")),
    ({"guided_regex": "(ab|ba){2}"}, lambda t: re.fullmatch("(ab|ba){2}", t)),
    ({"guided_json": SCHEMA}, valid_against_schema),
    ({"guided_grammar": 'root ::= "<" [a-c] ">"'}, lambda t: re.fullmatch("<[a-c]>", t)),
    ({"structured_outputs": {"choice": ["one", "two"]}}, lambda t: t in ("one", "two")),
])
def test_vllm_extras_on_completions(client, extra, valid):
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=60, temperature=1.0, seed=5, n=2,
                                    extra_body=extra)
    for choice in out.choices:
        assert valid(choice.text), choice.text


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, None),
    ({"guided_regex": "(unclosed"}, None),
])
def test_openai_constraint_errors_are_400(url, server, body, param):
    r = httpx.post(url + "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 5, **body})
    err = openai_error(r, 400)
    assert err["param"] == param
    server.assert_idle()


def test_tgi_bad_grammar_value_is_422(url):
    r = httpx.post(url + "/generate", json={"inputs": PROMPT, "parameters": {
        "max_new_tokens": 5, "grammar": {"type": "json_schema", "value": {"name": "no schema"}}}})
    assert "`grammar` must be" in tgi_error(r, 422, "validation")


def test_constraints_compile_before_reaching_the_engine_thread(url, server, monkeypatch):
    """The HTTP side compiles (a large schema must not stall every running stream), so a
    constraint that does not compile never reaches the engine."""
    core = server.engine.engine
    added = []
    add_request = core.add_request
    monkeypatch.setattr(core, "add_request", lambda *a, **kw: added.append(a) or add_request(*a, **kw))
    r = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 5, "guided_regex": "(bad"})
    assert openai_error(r, 400)["message"].startswith("invalid regex constraint")
    assert added == []
    r = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 5, "guided_regex": "[xy]{2}"})
    assert r.status_code == 200 and len(added) == 1
    assert re.fullmatch("[xy]{2}", r.json()["choices"][0]["text"])


def test_excluded_tokens_logprobs_are_json_floors_not_infinity(url, server, monkeypatch):
    """With processed logprobs, tokens a constraint or top_k excludes have logprob -inf,
    which JSON cannot carry: the API sends vLLM's floor, -9999.0, streamed or not."""
    monkeypatch.setattr(server.engine.engine.runner.sampler, "logprobs_mode", "processed")
    body = {"messages": CHAT, "max_tokens": 4, "logprobs": True, "top_logprobs": 5, "temperature": 0,
            "guided_choice": ["yes", "no"]}
    r = httpx.post(url + "/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    top = r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    assert -9999.0 in [t["logprob"] for t in top]
    r = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "logprobs": 3, "top_k": 2,
                                                  "stream": True})
    assert r.status_code == 200 and "Infinity" not in r.text and "-9999.0" in r.text
    r = httpx.post(url + "/generate", json={"inputs": PROMPT, "parameters": {
        "max_new_tokens": 3, "top_k": 1, "top_n_tokens": 3, "details": True, "do_sample": True}})
    assert r.status_code == 200, r.text


def test_tgi_style_response_format_from_huggingface_hub(url):
    """TGI's clients send response_format in TGI's grammar shape ({"type": "json", "value"})."""
    from huggingface_hub import InferenceClient

    hub = InferenceClient(base_url=url, timeout=30)
    out = hub.chat_completion(CHAT, model=MODEL_NAME, max_tokens=60, temperature=0,
                              response_format={"type": "json", "value": SCHEMA})
    assert valid_against_schema(out.choices[0].message.content)
    out = hub.chat_completion(CHAT, model=MODEL_NAME, max_tokens=10, temperature=0,
                              response_format={"type": "regex", "value": "[xyz]{4}"})
    assert re.fullmatch("[xyz]{4}", out.choices[0].message.content)
    r = httpx.post(url + "/v1/chat/completions", json={"messages": CHAT, "response_format": {"type": "regex"}})
    assert openai_error(r, 400)["param"] == "response_format"


def test_an_unexpected_error_is_an_error_body_and_frees_the_request(url, server, monkeypatch):
    """A bug while building a response gives the OpenAI error shape (streamed: an error
    event, then [DONE]) and leaves nothing in flight."""
    import tessera.server.openai_routes as routes

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(routes, "chat_logprobs", broken)
    body = {"messages": CHAT, "max_tokens": 4, "logprobs": True}
    r = httpx.post(url + "/v1/chat/completions", json=body)
    assert openai_error(r, 500)["message"] == "internal error: RuntimeError: boom"
    r = httpx.post(url + "/v1/chat/completions", json={**body, "stream": True})
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["message"] == "internal error: RuntimeError: boom"
    server.assert_idle()
