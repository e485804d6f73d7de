"""The OpenAI routes through the `openai` package, over real HTTP on loopback."""
from __future__ import annotations

import httpx
import openai
import pytest

from tests.server.conftest import CHAT, MODEL_NAME, PROMPT, start_server

MAX_TOKENS = 12


def _greedy_chat(client, **kw):
    kw.setdefault("extra_body", {"ignore_eos": True})
    return client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=MAX_TOKENS,
                                          temperature=0, **kw)


def test_models_lists_the_served_name(client, server, tiny_model_dir):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL_NAME]
    assert models[0].owned_by == "tessera"
    assert models[0].model_extra["max_model_len"] == server.state.limits.max_total_tokens
    # vLLM's card: the base model's root is what --model named, without a parent
    assert models[0].model_extra["root"] == str(tiny_model_dir) and models[0].model_extra["parent"] is None


def test_chat_stream_and_non_stream_agree(client):
    full = _greedy_chat(client)
    choice = full.choices[0]
    assert full.object == "chat.completion" and full.model == MODEL_NAME
    assert choice.message.role == "assistant"
    assert choice.finish_reason == "length"
    assert full.usage.completion_tokens == MAX_TOKENS
    assert full.usage.total_tokens == full.usage.prompt_tokens + MAX_TOKENS
    assert choice.message.content  # 12 tokens of a random model: some text

    chunks = list(_greedy_chat(client, stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    # 1. the role chunk
    first = chunks[0].choices[0]
    assert first.delta.role == "assistant" and first.delta.content == "" and first.finish_reason is None
    # 4. the usage chunk, with no choices
    usage = chunks[-1]
    assert usage.choices == []
    assert usage.usage.completion_tokens == MAX_TOKENS
    assert usage.usage.prompt_tokens == full.usage.prompt_tokens
    # 3. exactly one chunk carries finish_reason, the one before the usage chunk
    finishing = [i for i, c in enumerate(chunks) if c.choices and c.choices[0].finish_reason is not None]
    assert finishing == [len(chunks) - 2]
    assert chunks[-2].choices[0].finish_reason == "length"
    # 2. content chunks in between; their text is the non-streamed text
    middle = chunks[1:-1]
    assert all(c.usage is None for c in chunks[:-1])
    assert all(c.choices[0].delta.role is None for c in middle)
    text = "".join(c.choices[0].delta.content or "" for c in middle)
    assert text == choice.message.content


def test_chat_logprobs(client):
    out = _greedy_chat(client, logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert len(content) == MAX_TOKENS
    for item in content:
        assert 1 <= len(item.top_logprobs) <= 2
        # greedy: the chosen token is the most likely one
        assert item.logprob == pytest.approx(max(t.logprob for t in item.top_logprobs), abs=1e-5)
        assert item.bytes == list(item.token.encode("utf-8"))


def test_completions_logprobs(client):
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=5, temperature=0,
                                    logprobs=2, extra_body={"ignore_eos": True})
    choice = out.choices[0]
    assert out.object == "text_completion" and choice.finish_reason == "length"
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(isinstance(x, float) and x <= 0 for x in lp.token_logprobs)
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3  # the chosen token and up to 2 alternatives
        # greedy: nothing listed beats the chosen token (texts may collide as dict keys, so the
        # chosen token's own entry can be overwritten by a same-text alternative)
        assert chosen >= max(top.values()) - 1e-5
    assert lp.text_offset == sorted(lp.text_offset)


def test_completions_echo(client):
    plain = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0,
                                      extra_body={"ignore_eos": True})
    echoed = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0,
                                       echo=True, logprobs=1, extra_body={"ignore_eos": True})
    n_prompt = plain.usage.prompt_tokens
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    lp = echoed.choices[0].logprobs
    assert len(lp.tokens) == n_prompt + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts token 0
    assert all(x is not None for x in lp.token_logprobs[1:])
    assert "".join(lp.tokens[:n_prompt]) == PROMPT


def test_n_with_seed_is_reproducible(client):
    def sample():
        out = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=MAX_TOKENS, n=2,
                                             temperature=0.8, seed=1234, extra_body={"ignore_eos": True})
        assert sorted(c.index for c in out.choices) == [0, 1]
        assert out.usage.completion_tokens == 2 * MAX_TOKENS
        return [c.message.content for c in sorted(out.choices, key=lambda c: c.index)]

    first = sample()
    assert first == sample()
    assert first[0] != first[1]  # two samples of a near-uniform distribution


def test_unknown_model_is_404(client, url):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-17", messages=CHAT, max_tokens=2)
    assert info.value.status_code == 404
    r = httpx.post(url + "/v1/completions", json={"model": "gpt-17", "prompt": "hi"})
    assert r.status_code == 404
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == 404 and "gpt-17" in err["message"] and err["param"] == "model"


@pytest.mark.parametrize("bad", [
    # the message names the field the client sent (max_tokens, not SamplingParams' max_new_tokens)
    {"temperature": -1}, {"top_p": 2}, {"n": 0}, {"frequency_penalty": 3}, {"max_tokens": 0},
])
def test_bad_value_is_400(client, url, bad):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL_NAME, messages=CHAT, **bad)
    r = httpx.post(url + "/v1/chat/completions", json={"messages": CHAT, **bad})
    assert r.status_code == 400
    body = r.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == 400
    assert next(iter(bad)) in body["error"]["message"]


def test_suffix_is_400(client, url):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, suffix="end", max_tokens=2)
    assert "suffix" in str(info.value)
    err = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "suffix": "x"}).json()["error"]
    assert err["code"] == 400 and err["param"] == "suffix"


def test_completions_stream_matches_non_stream(client):
    kw = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == full
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_n_streamed_per_choice(client):
    kw = dict(model=MODEL_NAME, messages=CHAT, max_tokens=6, n=2, temperature=0.8, seed=99,
              extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw)
    texts = {c.index: c.message.content for c in full.choices}
    seen: dict[int, list] = {0: [], 1: []}
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            seen[c.index].append(c)
    for index, chunks in seen.items():
        assert chunks[0].delta.role == "assistant" and chunks[0].delta.content == ""
        assert [c.finish_reason for c in chunks][-1] == "length"
        assert all(c.finish_reason is None for c in chunks[:-1])
        assert "".join(c.delta.content or "" for c in chunks) == texts[index]


def test_stop_string_stream_and_non_stream(client):
    text = _greedy_chat(client).choices[0].message.content
    k = next((k for k in range(1, len(text) - 1) if text[k:k + 2].isascii() and text[k:k + 2].isprintable()
              and text.find(text[k:k + 2]) == k), None)
    if k is None:
        pytest.fail(f"no usable stop string in {text!r}")
    stop = text[k:k + 2]
    full = _greedy_chat(client, stop=[stop])
    choice = full.choices[0]
    assert choice.message.content == text[:k]  # OpenAI: the stop string is not returned
    assert choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == stop
    chunks = list(_greedy_chat(client, stop=[stop], stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text[:k]
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    # include_stop_str_in_output (vLLM) keeps it
    kept = _greedy_chat(client, stop=[stop], extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert kept.choices[0].message.content == text[:k + 2]


def test_context_overflow_is_400(url):
    r = httpx.post(url + "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 600})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "max_tokens" and "maximum context length is 512 tokens" in err["message"]
    # no max_tokens asked for: the prompt alone is too long, and the error says so
    long = [{"role": "user", "content": "hello " * 600}]
    for route, body in (("chat/completions", {"messages": long}), ("completions", {"prompt": "hello " * 600, "max_tokens": None})):
        r = httpx.post(f"{url}/v1/{route}", json=body)
        assert r.status_code == 400 and "prompt has" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_continuous_usage_stats_count_up_in_every_chunk(client, route):
    options = {"include_usage": True, "continuous_usage_stats": True}
    if route == "chat":
        chunks = list(_greedy_chat(client, stream=True, stream_options=options))
    else:
        chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                                temperature=0, stream=True, stream_options=options,
                                                extra_body={"ignore_eos": True}))
    usages = [c.usage for c in chunks]
    assert all(u is not None for u in usages)
    completion = [u.completion_tokens for u in usages]
    assert completion == sorted(completion) and completion[-1] == MAX_TOKENS
    assert all(u.total_tokens == u.prompt_tokens + u.completion_tokens for u in usages)
    assert chunks[-1].choices == []  # the include_usage chunk still ends the stream


def test_watermark_extra_marks_completions(client, url):
    """`watermark` (TGI's and MindIE's parameter) as an extra body field on the OpenAI
    routes: the text is TGI's watermarked text for the same seed, not the plain one."""
    def text(watermark: bool) -> str:
        out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=1.0,
                                        seed=5, extra_body={"ignore_eos": True, "watermark": watermark})
        return out.choices[0].text

    tgi = httpx.post(url + "/generate", json={"inputs": PROMPT, "parameters": {
        "max_new_tokens": 24, "do_sample": True, "seed": 5, "watermark": True}}).json()
    assert text(True) == tgi["generated_text"] != text(False)
    with pytest.raises(openai.BadRequestError, match="watermark"):
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, extra_body={"watermark": "maybe"})


def test_priority_needs_the_priority_policy(client, tiny_model_dir):
    """vLLM's `priority` extra: refused (400, param "priority") by a first-come-first-served
    server, taken by one started with --scheduling-policy priority."""
    with pytest.raises(openai.BadRequestError, match="scheduling-policy priority") as caught:
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2, extra_body={"priority": 3})
    assert caught.value.body["param"] == "priority"
    running = start_server(tiny_model_dir, llm_kwargs={"scheduling_policy": "priority"})
    core, seen = running.engine.engine, []
    add_request = core.add_request
    core.add_request = lambda *args, **kwargs: seen.append(args[3:]) or add_request(*args, **kwargs)
    try:
        with openai.OpenAI(base_url=running.url + "/v1", api_key="x", max_retries=0, timeout=30) as urgent:
            out = urgent.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=4,
                                                 extra_body={"priority": -10})
            assert out.choices[0].finish_reason in ("length", "stop")
        assert seen == [(None, -10)]  # (adapter, priority) as the engine got them
        running.assert_idle()
    finally:
        running.stop()
