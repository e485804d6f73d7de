"""Tokenization over HTTP in both dialects: TGI's /tokenize and /chat_tokenize, vLLM's
/tokenize (a prompt, or chat messages rendered as /v1/chat/completions renders them) and
/detokenize, with each dialect's error shape."""
from __future__ import annotations

import httpx

from tests.server.conftest import CHAT, MODEL_NAME, PROMPT


def test_vllm_tokenize_a_prompt_and_detokenize_it(url, server):
    tok = server.state.tokenizer
    r = httpx.post(url + "/tokenize", json={"model": MODEL_NAME, "prompt": PROMPT, "return_token_strs": True})
    assert r.status_code == 200
    body = r.json()
    assert body["tokens"] == list(tok(PROMPT).input_ids) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == server.engine.engine.max_model_len
    assert body["token_strs"] == tok.convert_ids_to_tokens(body["tokens"])
    plain = httpx.post(url + "/tokenize", json={"prompt": PROMPT, "add_special_tokens": False}).json()
    assert plain["tokens"] == list(tok(PROMPT, add_special_tokens=False).input_ids) and plain["token_strs"] is None
    r = httpx.post(url + "/detokenize", json={"model": MODEL_NAME, "tokens": plain["tokens"]})
    assert r.status_code == 200 and r.json() == {"prompt": PROMPT}


def test_vllm_tokenize_chat_counts_what_a_chat_request_runs(url, server):
    """The count of a chat prompt is the prompt_tokens a chat completion of it reports."""
    r = httpx.post(url + "/tokenize", json={"messages": CHAT})
    assert r.status_code == 200
    count = r.json()["count"]
    chat = httpx.post(url + "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == count
    without = httpx.post(url + "/tokenize", json={"messages": CHAT, "add_generation_prompt": False}).json()
    assert without["count"] < count
    server.assert_idle()


def test_tgi_chat_tokenize(url, server):
    r = httpx.post(url + "/chat_tokenize", json={"model": "tgi", "messages": CHAT})
    assert r.status_code == 200
    body = r.json()
    text = body["templated_text"]
    assert CHAT[0]["content"] in text
    ids = [t["id"] for t in body["tokenize_response"]]
    assert ids == httpx.post(url + "/tokenize", json={"messages": CHAT}).json()["tokens"]
    assert all(t["text"] == text[t["start"]:t["stop"]] for t in body["tokenize_response"])


def test_errors_come_in_each_dialect(url):
    for body in ({"prompt": PROMPT, "messages": CHAT}, {"model": MODEL_NAME}):  # vLLM's, without inputs
        both = httpx.post(url + "/tokenize", json=body)
        assert both.status_code == 400 and "either `prompt` or `messages`" in both.json()["error"]["message"]
    unknown = httpx.post(url + "/tokenize", json={"prompt": PROMPT, "model": "nope"})
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"
    extra = httpx.post(url + "/tokenize", json={"prompt": PROMPT, "nonsense": 1})
    assert extra.status_code == 400 and "nonsense" in extra.json()["error"]["message"]
    bad = httpx.post(url + "/detokenize", json={"tokens": [1, 10 ** 9]})
    assert bad.status_code == 400 and "outside the vocabulary" in bad.json()["error"]["message"]
    tgi = httpx.post(url + "/tokenize", json={"inputs": 5})  # TGI's shape, TGI's error
    assert tgi.status_code == 422 and tgi.json()["error_type"] == "validation"
    not_json = httpx.post(url + "/tokenize", content=b"{", headers={"content-type": "application/json"})
    assert not_json.status_code == 422 and "not JSON" in not_json.json()["error"]
    empty = httpx.post(url + "/chat_tokenize", json={"messages": []})
    assert empty.status_code == 422 and "cannot be empty" in empty.json()["error"]
