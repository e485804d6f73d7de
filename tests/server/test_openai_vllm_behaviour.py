"""OpenAI-route details where clients rely on vLLM's behaviour: a logprob per streamed token,
multi-turn tool-call messages, continue_final_message, best_of numbering, limits on
logprobs and batch size, truncate_prompt_tokens, a missing max_tokens, the reply's role
and content parts. Real HTTP against the shared tiny-model server."""
from __future__ import annotations

import httpx
import pytest

from tessera.server.openai_routes import _template_message
from tessera.server.protocol import ChatMessage
from tests.server.conftest import CHAT, MODEL_NAME, PROMPT


def post(url: str, route: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/{route}", json={"model": MODEL_NAME, **body}, timeout=60)


def stream_chunks(url: str, route: str, **body) -> list[dict]:
    import json

    chunks = []
    with httpx.stream("POST", f"{url}/v1/{route}", json={"model": MODEL_NAME, "stream": True, **body},
                      timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def rendered_tokens(server, messages: list[dict], **kwargs) -> int:
    tokenizer = server.state.tokenizer
    text = tokenizer.apply_chat_template(messages, chat_template=server.state.chat_template, tokenize=False,
                                         **kwargs)
    return len(tokenizer(text, add_special_tokens=False).input_ids)


def test_streamed_chat_has_a_logprob_for_every_token_even_while_text_is_held_back(url):
    greedy = dict(messages=CHAT, max_tokens=10, temperature=0, ignore_eos=True, logprobs=True)
    full = post(url, "chat/completions", **greedy).json()
    text = full["choices"][0]["message"]["content"]
    # a stop string matching everything after the first few characters, then never completing:
    # the text after them is held back until the end, so those tokens stream with no text
    stop = text[3:] + "\u2603"
    held = post(url, "chat/completions", **greedy, stop=[stop]).json()
    assert held["choices"][0]["message"]["content"] == text
    chunks = stream_chunks(url, "chat/completions", **greedy, stop=[stop])
    entries = [e for c in chunks for ch in c["choices"] if ch.get("logprobs") for e in ch["logprobs"]["content"]]
    assert len(entries) == full["usage"]["completion_tokens"] == 10
    assert [e["token"] for e in entries] == [e["token"] for e in full["choices"][0]["logprobs"]["content"]]
    assert "".join(ch["delta"].get("content", "") for c in chunks for ch in c["choices"]) == text


def test_tool_call_turns_render_as_vllm_hands_them_to_templates():
    assistant = ChatMessage(role="assistant", content=None, tool_calls=[
        {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}])
    message, images = _template_message(assistant, takes_images=False)
    assert message["content"] == "" and images == []
    assert message["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    odd = ChatMessage(role="assistant", content="", tool_calls=[{"function": {"name": "f", "arguments": "not json"}}])
    assert _template_message(odd, False)[0]["tool_calls"][0]["function"]["arguments"] == "not json"
    parts = ChatMessage(role="user", content=[{"type": "text", "text": "Say"}, {"type": "text", "text": "hi"}])
    assert _template_message(parts, False)[0]["content"] == "Say\nhi"
    # a model that takes images gets transformers' parts, images as {"type": "image"}
    image = ChatMessage(role="user", content=[{"type": "text", "text": "Say"},
                                              {"type": "image_url", "image_url": {"url": "http://x/a.png"}}])
    assert _template_message(image, True) == ({"role": "user", "content": [
        {"type": "text", "text": "Say"}, {"type": "image"}]}, ["http://x/a.png"])


def test_a_tool_call_conversation_is_served(url, server):
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = post(url, "chat/completions", messages=messages, max_tokens=2)
    assert r.status_code == 200, r.text
    expected = [{**m, "content": m["content"] or ""} for m in messages]
    assert r.json()["usage"]["prompt_tokens"] == rendered_tokens(server, expected, add_generation_prompt=True)


def test_continue_final_message_leaves_the_last_message_open(url, server):
    messages = [*CHAT, {"role": "assistant", "content": "It stores"}]
    r = post(url, "chat/completions", messages=messages, max_tokens=3, temperature=0,
             add_generation_prompt=False, continue_final_message=True)
    assert r.status_code == 200, r.text
    reply = r.json()
    open_ = rendered_tokens(server, messages, continue_final_message=True)
    closed = rendered_tokens(server, messages, add_generation_prompt=False)
    assert reply["usage"]["prompt_tokens"] == open_ != closed
    assert reply["choices"][0]["message"]["role"] == "assistant"  # the continued message's role
    both = post(url, "chat/completions", messages=messages, max_tokens=3, continue_final_message=True)
    assert both.status_code == 400 and "continue_final_message" in both.json()["error"]["message"]


def test_without_a_generation_prompt_the_reply_takes_the_last_role(url):
    body = dict(messages=CHAT, max_tokens=2, add_generation_prompt=False)
    assert post(url, "chat/completions", **body).json()["choices"][0]["message"]["role"] == "user"
    first = stream_chunks(url, "chat/completions", **body)[0]
    assert first["choices"][0]["delta"]["role"] == "user"


def test_best_of_choices_are_numbered_from_zero(url):
    r = post(url, "completions", prompt=PROMPT, max_tokens=3, temperature=1.0, n=2, best_of=3, seed=1)
    assert [c["index"] for c in r.json()["choices"]] == [0, 1]
    two = post(url, "completions", prompt=[PROMPT, "Hello"], max_tokens=2, temperature=1.0, n=2, best_of=3, seed=1)
    assert [c["index"] for c in two.json()["choices"]] == [0, 1, 2, 3]


@pytest.mark.parametrize("logprobs", [21, -1])
def test_completion_logprobs_are_capped_like_vllm(url, logprobs):
    r = post(url, "completions", prompt=PROMPT, max_tokens=2, logprobs=logprobs)
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"


def test_a_batch_larger_than_the_concurrency_limit_is_refused_whole(url, server):
    limit = server.state.limits.max_concurrent_requests
    r = post(url, "completions", prompt=[PROMPT] * (limit + 1), max_tokens=1)
    assert r.status_code == 400 and "--max-concurrent-requests" in r.json()["error"]["message"]


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_truncate_prompt_tokens_keeps_the_last_ones(url, route):
    body = {"prompt": PROMPT * 3} if route == "completions" else {"messages": CHAT}
    full = post(url, route, **body, max_tokens=1).json()["usage"]["prompt_tokens"]
    cut = post(url, route, **body, max_tokens=1, truncate_prompt_tokens=4).json()["usage"]["prompt_tokens"]
    assert full > 4 and cut == 4
    assert post(url, route, **body, max_tokens=1, truncate_prompt_tokens=0).status_code == 400


def test_completion_without_max_tokens_runs_to_the_context_end(url, server):
    limit = server.state.limits.max_total_tokens
    r = post(url, "completions", prompt=PROMPT, max_tokens=None, ignore_eos=True, temperature=0)
    usage = r.json()["usage"]
    assert usage["total_tokens"] == limit
    assert r.json()["choices"][0]["finish_reason"] == "length"
    # several prompts: each runs to its own context end
    short, long = "Hi", PROMPT * 4
    r = post(url, "completions", prompt=[short, long], max_tokens=None, ignore_eos=True, temperature=0).json()
    lengths = [len(server.state.tokenizer(p).input_ids) for p in (short, long)]
    assert r["usage"]["completion_tokens"] == sum(limit - n for n in lengths)



def test_streamed_echo_carries_the_prompt_logprobs_like_the_full_reply(url):
    body = dict(prompt=PROMPT, max_tokens=4, temperature=0, ignore_eos=True, echo=True, logprobs=1)
    full = post(url, "completions", **body).json()["choices"][0]
    chunks = [ch for c in stream_chunks(url, "completions", **body) for ch in c["choices"]]
    assert "".join(ch["text"] for ch in chunks) == full["text"]
    for key in ("tokens", "text_offset"):
        assert [v for ch in chunks if ch["logprobs"] for v in ch["logprobs"][key]] == full["logprobs"][key]
    streamed = [v for ch in chunks if ch["logprobs"] for v in ch["logprobs"]["token_logprobs"]]
    assert streamed[0] is None and streamed[1:] == pytest.approx(full["logprobs"]["token_logprobs"][1:], abs=1e-5)


def greedy_token_ids(url: str, n: int) -> list[int]:
    """The tiny model's greedy continuation of PROMPT, as token ids (TGI's details)."""
    r = httpx.post(f"{url}/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": n, "details": True}},
                   timeout=60)
    return [t["id"] for t in r.json()["details"]["tokens"]]


def test_allowed_token_ids_and_bad_words(url, server):
    tokenizer = server.state.tokenizer
    body = dict(prompt=PROMPT, max_tokens=16, temperature=0, ignore_eos=True)
    free_ids = greedy_token_ids(url, 16)
    assert greedy_token_ids_with(url) == free_ids[:8]
    free = post(url, "completions", **body).json()["choices"][0]["text"]
    assert free.startswith(tokenizer.decode(free_ids[:4]))
    allowed = sorted({3, 4, 5, free_ids[1]})
    only = greedy_token_ids_with(url, allowed_token_ids=allowed)
    assert only and set(only) <= set(allowed)
    # a word the free run writes is never written with it banned
    words = [w for w in (tokenizer.decode([t]).strip() for t in free_ids) if len(w) >= 2 and w.isalpha()]
    assert words, free
    banned = post(url, "completions", **body, bad_words=[words[0]]).json()["choices"][0]["text"]
    assert words[0] in free and words[0] not in banned
    assert post(url, "completions", **body, allowed_token_ids=[10 ** 6]).status_code == 400
    assert post(url, "completions", **body, bad_words=[" "]).status_code == 400


def greedy_token_ids_with(url: str, **extra) -> list[int]:
    """Greedy completion token ids, through vLLM's return_tokens_as_token_ids."""
    r = post(url, "completions", prompt=PROMPT, max_tokens=8, temperature=0, ignore_eos=True, logprobs=0,
             return_tokens_as_token_ids=True, **extra)
    assert r.status_code == 200, r.text
    return [int(t.removeprefix("token_id:")) for t in r.json()["choices"][0]["logprobs"]["tokens"]]


def test_prompt_logprobs_are_returned_as_vllm_shapes_them(url, server):
    r = post(url, "completions", prompt=PROMPT, max_tokens=1, prompt_logprobs=2).json()
    plp = r["choices"][0]["prompt_logprobs"]
    ids = server.state.tokenizer(PROMPT).input_ids
    assert len(plp) == len(ids) and plp[0] is None
    for token, entry in zip(ids[1:], plp[1:]):
        assert str(token) in entry and len(entry) <= 3  # the prompt token and the top 2
        assert all(set(v) == {"logprob", "rank", "decoded_token"} for v in entry.values())
    chat = post(url, "chat/completions", messages=CHAT, max_tokens=1, prompt_logprobs=0).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    streamed = post(url, "completions", prompt=PROMPT, max_tokens=1, prompt_logprobs=1, stream=True)
    assert streamed.status_code == 400


def test_client_placeholder_names_never_shadow_an_adapter():
    from types import SimpleNamespace

    from tessera.server.openai_validation import resolve_model

    state = SimpleNamespace(model_name="base", lora_names=lambda: ["tgi"])
    assert resolve_model(state, "tgi") == ("tgi", "tgi")          # the adapter of that name
    assert resolve_model(state, "dummy") == ("base", None)        # huggingface_hub's placeholder


def test_completions_take_response_format_like_vllm(url):
    import json as _json

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    r = post(url, "completions", prompt=PROMPT, max_tokens=40, temperature=0,
             response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert set(_json.loads(r.json()["choices"][0]["text"])) == {"ok"}


def test_generation_config_max_new_tokens_caps_every_request_like_vllm(tiny_model_dir, tmp_path):
    """vLLM takes the model's generation_config max_new_tokens as the least of a request's
    max_tokens, that value and the context's room: a default and a cap."""
    import json
    import shutil

    from tests.server.conftest import start_server

    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "max_new_tokens": 5}))
    running = start_server(folder)
    try:
        assert running.state.sampling_defaults == {"max_new_tokens": 5}
        for route, body in (("chat/completions", dict(messages=CHAT)), ("completions", dict(prompt=PROMPT))):
            for asked, got in ((None, 5), (3, 3), (50, 5)):
                extra = {} if asked is None and route == "chat/completions" else {"max_tokens": asked}
                r = post(running.url, route, temperature=0, ignore_eos=True, **body, **extra)
                assert r.status_code == 200, r.text
                assert r.json()["usage"]["completion_tokens"] == got, (route, asked)
                assert r.json()["choices"][0]["finish_reason"] == "length"
        # asking for more than the context holds is still refused, as vLLM does
        r = post(running.url, "chat/completions", messages=CHAT, max_tokens=10 ** 6)
        assert r.status_code == 400 and "maximum context length" in r.text
    finally:
        running.stop()
