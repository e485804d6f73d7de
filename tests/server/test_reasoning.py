"""Reasoning parsers: the split of an answer into reasoning_content and content for each
syntax, the stream's deltas adding up to that split however the text is cut into tokens,
and the chat route over real HTTP (the tiny model is made to think by a regex)."""
from __future__ import annotations

import json
import re
import shutil

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.server.reasoning import (END, START, ReasoningStream, prompt_closes_reasoning, prompt_opens_reasoning,
                                     split_reasoning, tag_token)
from tests.server.conftest import CHAT, MODEL_NAME, start_server

@pytest.mark.parametrize("opened, text, expected", [
    (True, "let me see</think>The answer", ("let me see", "The answer")),
    (True, "<think>\nlet me see\n</think>\n\nThe answer", ("\nlet me see\n", "\n\nThe answer")),
    (True, "still thinking when cut", ("still thinking when cut", None)),
    (True, "</think>only an answer", (None, "only an answer")),
    (True, "thought</think>", ("thought", None)),
    (False, "<think>\nhmm\n</think>\n\nParis.", ("\nhmm\n", "\n\nParis.")),
    (False, "Paris, without thinking.", (None, "Paris, without thinking.")),
    (False, "  <think>cut before the end", ("cut before the end", None)),
    (False, "a </think> not opened", (None, "a </think> not opened")),
    (False, "", (None, None)),
])
def test_split(opened, text, expected):
    assert split_reasoning(text, opened) == expected


@pytest.mark.parametrize("prompt, opened", [
    ("<|im_start|>assistant\n<think>\n", True),                 # QwQ, Qwen3 Thinking 2507
    ("<｜Assistant｜><think>\n", True),                            # DeepSeek-R1
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False),  # Qwen3, enable_thinking false
    ("<|im_start|>assistant\n", False),                          # Qwen3: the model opens it
    ("system: use <think> tags\n<|im_start|>assistant\n", False),
])
def test_the_prompt_says_whether_the_output_starts_inside_the_reasoning(prompt, opened):
    assert prompt_opens_reasoning(prompt) is opened


PIECES = st.sampled_from(["<think>", "</think>", "<", "</", "think", ">", "th", "ink>", "\n", " ", "a", "b c",
                          "<thi", "</th", "é"])


@settings(max_examples=400, deadline=None)
@given(pieces=st.lists(PIECES, max_size=12), cuts=st.lists(st.integers(0, 60), max_size=6),
       opened=st.booleans())
def test_streamed_deltas_add_up_to_the_split(pieces, cuts, opened):
    text = "".join(pieces)
    bounds = sorted({0, len(text), *[c for c in cuts if c <= len(text)]})
    stream, reasoning, content = ReasoningStream(opened), "", ""
    for start, end in zip(bounds, bounds[1:]):
        thought, said = stream.delta(text[start:end], final=False)
        reasoning, content = reasoning + thought, content + said
    thought, said = stream.delta("", final=True)
    reasoning, content = reasoning + thought, content + said
    assert (reasoning or None, content or None) == split_reasoning(text, opened)


THINK = "<think>[a-z]{2,6}</think>[a-z]{2,6}"  # the tiny random model thinks when told to


@pytest.fixture
def chat(server, monkeypatch):
    def post(parser: str | None, **body) -> httpx.Response:
        monkeypatch.setattr(server.state, "reasoning_parser", parser)
        request = {"model": MODEL_NAME, "messages": CHAT, "max_tokens": 24, "temperature": 0, **body}
        return httpx.post(server.url + "/v1/chat/completions", json=request, timeout=30)
    return post


def streamed(response: httpx.Response) -> tuple[str, str, list[dict]]:
    """(reasoning, content, deltas) of a streamed chat answer's first choice."""
    lines = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: {")]
    chunks = [json.loads(line)["choices"][0]["delta"] for line in lines]
    for c in chunks:
        assert c.get("reasoning") == c.get("reasoning_content")  # both names, the same text
    return ("".join(c.get("reasoning_content") or "" for c in chunks),
            "".join(c.get("content") or "" for c in chunks), chunks)


def test_chat_answer_is_split_and_the_stream_says_the_same(chat):
    plain = chat(None, structured_outputs={"regex": THINK}).json()["choices"][0]["message"]
    assert plain["content"].startswith("<think>") and "reasoning_content" not in plain
    message = chat("qwen3", structured_outputs={"regex": THINK}).json()["choices"][0]["message"]
    thought, answer = plain["content"].removeprefix("<think>").split("</think>")
    assert message["reasoning_content"] == message["reasoning"] == thought and message["content"] == answer
    reasoning, content, chunks = streamed(chat("qwen3", structured_outputs={"regex": THINK}, stream=True))
    assert (reasoning, content) == (thought, answer)
    assert not any("think>" in (c.get("content") or "") + (c.get("reasoning_content") or "") for c in chunks)


def test_a_tag_cut_short_by_the_end_is_flushed_as_reasoning(chat):
    forced = {"guided_choice": ["<think>abc</thi"]}
    message = chat("qwen3", **forced).json()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("abc</thi", None)
    assert streamed(chat("qwen3", stream=True, **forced))[:2] == ("abc</thi", "")


def test_deepseek_r1_output_is_reasoning_until_it_closes_and_constraints_are_content(chat):
    """R1's output starts inside the reasoning: an unconstrained answer of the random model
    (no </think>) is all reasoning, streamed or not; a constrained one is all content (it
    is the schema's, not a thought), the reasoning fields still present, null."""
    raw = chat(None).json()["choices"][0]["message"]["content"]
    message = chat("deepseek_r1").json()["choices"][0]["message"]
    assert "</think>" not in raw
    assert message == {"role": "assistant", "content": None, "reasoning_content": raw, "reasoning": raw}
    assert streamed(chat("deepseek_r1", stream=True))[:2] == (raw, "")
    constrained = chat("deepseek_r1", structured_outputs={"regex": "[a-z]{3,8}"}).json()["choices"][0]["message"]
    assert constrained["content"] and constrained["reasoning_content"] is None and constrained["reasoning"] is None


def test_a_template_that_opens_the_reasoning_makes_qwen3_output_start_inside_it(tiny_model_dir):
    """QwQ / Qwen3 Thinking 2507 end the prompt with <think>: the output is reasoning until
    </think> (the random model never writes it: all reasoning), streamed or not. The same
    request to the plain template's server is all content."""
    opening = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m.get('reasoning_content', '') }}"
               "{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<s>assistant:<think>\n{% endif %}")
    running = start_server(tiny_model_dir, llm_kwargs={"chat_template": opening})
    try:
        running.state.reasoning_parser = "qwen3"
        request = {"model": MODEL_NAME, "messages": CHAT, "max_tokens": 12, "temperature": 0}
        message = httpx.post(running.url + "/v1/chat/completions", json=request, timeout=30).json()
        message = message["choices"][0]["message"]
        assert message["reasoning_content"] and message["content"] is None
        stream = httpx.post(running.url + "/v1/chat/completions", json={**request, "stream": True}, timeout=30)
        assert streamed(stream)[:2] == (message["reasoning_content"], "")
        # an earlier turn's `reasoning` (vLLM's newer name) reaches the template as
        # reasoning_content (transformers' apply_chat_template maps it)
        turns = [{"role": "assistant", "content": "Paris."}, *CHAT]
        sizes = [httpx.post(running.url + "/v1/chat/completions", timeout=30, json={
            **request, "max_tokens": 1, "messages": [{**turns[0], **extra}, *turns[1:]]}).json()["usage"]["prompt_tokens"]
            for extra in ({}, {"reasoning": "the capital of France"}, {"reasoning_content": "the capital of France"})]
        assert sizes[0] < sizes[1] == sizes[2]
    finally:
        running.stop()


def test_qwen3_output_of_a_template_that_does_not_open_it_is_content(chat):
    message = chat("qwen3").json()["choices"][0]["message"]
    assert message["content"] and message["reasoning_content"] is None


def test_tool_calls_are_read_from_the_content_after_the_reasoning(chat, server, monkeypatch):
    from tests.server.test_tool_calls_http import HERMES_CALLS, HERMES_OUTPUT, TIME, WEATHER

    monkeypatch.setattr(server.state, "tool_call_parser", "hermes")
    forced = {"guided_choice": ["<think>which city?</think>" + HERMES_OUTPUT]}
    choice = chat("qwen3", tools=[WEATHER, TIME], max_tokens=400, **forced).json()["choices"][0]
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls" and message["reasoning_content"] == "which city?"
    assert message["content"] == "Let me check."
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == HERMES_CALLS
    reasoning, content, chunks = streamed(chat("qwen3", tools=[WEATHER, TIME], max_tokens=400, stream=True, **forced))
    assert (reasoning, content) == ("which city?", "Let me check.")
    calls: dict[int, tuple[str, str]] = {}  # as a client puts them together: name first, arguments in pieces
    for c in (c for chunk in chunks for c in chunk.get("tool_calls") or []):
        name, arguments = calls.get(c["index"], (c["function"].get("name"), ""))
        calls[c["index"]] = (name, arguments + c["function"].get("arguments", ""))
    assert list(calls.values()) == HERMES_CALLS


def _with_tags(tiny_model_dir, folder, special: bool, tags: tuple[str, ...] = (START, END)):
    """The tiny model with `tags` (`<think>` and `</think>`) as tokens of their own, as a
    reasoning model's vocabulary has them (ids past the trained ones, inside the model's 512)."""
    from transformers import AutoTokenizer

    shutil.copytree(tiny_model_dir, folder, dirs_exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_tokens(list(tags), special_tokens=special)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def thinking_model_dir(tiny_model_dir, tmp_path_factory):
    return _with_tags(tiny_model_dir, tmp_path_factory.mktemp("thinking"), special=False)


def test_the_tags_count_only_as_tokens_of_their_own_kept_in_the_text(tiny_model_dir, thinking_model_dir,
                                                                       tmp_path):
    from transformers import AutoTokenizer

    assert tag_token(AutoTokenizer.from_pretrained(tiny_model_dir), END) is None  # several tokens
    tokenizer = AutoTokenizer.from_pretrained(thinking_model_dir)
    assert tag_token(tokenizer, END) == tokenizer.convert_tokens_to_ids(END) < 512
    assert tag_token(tokenizer, START) == tokenizer.convert_tokens_to_ids(START) != tag_token(tokenizer, END)
    special = AutoTokenizer.from_pretrained(_with_tags(tiny_model_dir, tmp_path / "special", special=True))
    assert tag_token(special, END) is None  # skipped in the text: nothing to split the answer at
    assert prompt_closes_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # Qwen3, thinking off
    assert not prompt_closes_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_closes_reasoning("<|im_start|>assistant\n")


REGEX = "[ab]{2,4}-[0-9]"
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def thinking_server(thinking_model_dir):
    running = start_server(thinking_model_dir)
    yield running
    running.stop()


def _post(running, parser: str, **body) -> httpx.Response:
    running.state.reasoning_parser = parser
    request = {"model": MODEL_NAME, "messages": CHAT, "max_tokens": 40, "temperature": 0, **body}
    return httpx.post(running.url + "/v1/chat/completions", json=request, timeout=30)


def test_a_constrained_answer_of_a_reasoning_model_follows_its_reasoning(thinking_server):
    """With the tags as tokens, R1's output (inside the reasoning from the start) is free
    until `</think>`: made to close it at once (a logit bias), the answer after it is the
    constraint's content; kept from closing it, the output is all reasoning, the model's
    own (the constraint never started), streamed the same."""
    tokenizer = thinking_server.state.tokenizer
    end = str(tag_token(tokenizer, END))
    closed = _post(thinking_server, "deepseek_r1", logit_bias={end: 100}, structured_outputs={"regex": REGEX})
    message = closed.json()["choices"][0]["message"]
    assert message["reasoning_content"] is None and re.fullmatch(REGEX, message["content"]), message
    stream = _post(thinking_server, "deepseek_r1", logit_bias={end: 100}, structured_outputs={"regex": REGEX},
                   stream=True)
    assert streamed(stream)[:2] == ("", message["content"])

    free = _post(thinking_server, "deepseek_r1", max_tokens=16, logit_bias={end: -100}).json()
    kept = _post(thinking_server, "deepseek_r1", max_tokens=16, logit_bias={end: -100},
                 structured_outputs={"regex": REGEX}).json()
    message = kept["choices"][0]["message"]
    assert message["content"] is None and message["reasoning_content"] == free["choices"][0]["message"]["reasoning_content"]
    assert kept["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("constraint", [{"structured_outputs": {"regex": REGEX}},
                                        {"tools": [TOOL], "tool_choice": "required"}], ids=["regex", "tool"])
def test_qwen3_may_think_first_or_answer_at_once_under_a_constraint(thinking_server, constraint):
    """Qwen3's prompt leaves the reasoning closed and the model may open it: its first
    token is `<think>` or the constraint's. Biased to open and at once close it, the
    answer after `</think>` is the constraint's (a regex's text, a required tool call);
    kept from opening it, the answer is the constraint's from the first token."""
    tokenizer = thinking_server.state.tokenizer
    start, end = str(tag_token(tokenizer, START)), str(tag_token(tokenizer, END))
    for bias, first in (({start: 50, end: 100}, [START, END]), ({start: -100}, None)):
        reply = _post(thinking_server, "qwen3", max_tokens=120, logit_bias=bias, logprobs=True,
                      **constraint).json()["choices"][0]
        message = reply["message"]
        tokens = [t["token"] for t in reply["logprobs"]["content"]]
        if first:  # it thought (briefly): the reasoning is empty, the answer follows the tags
            assert tokens[:2] == first, tokens
        else:
            assert START not in tokens and END not in tokens, tokens
        assert message["reasoning_content"] is None, message
        if "tools" in constraint:
            assert [c["function"]["name"] for c in message["tool_calls"]] == ["lookup"], message
            assert reply["finish_reason"] == "tool_calls"
        else:
            assert re.fullmatch(REGEX, message["content"]), message


GEMMA4_TAGS = ("<|channel>", "<channel|>")


def test_gemma4_may_think_first_or_answer_at_once_under_a_constraint(tiny_model_dir, tmp_path):
    """Gemma 4's tags are special tokens its parser keeps in the text: a constrained output's
    first token may be `<|channel>` (the thought follows, free until `<channel|>`, then the
    constraint's answer) or the constraint's own."""
    running = start_server(_with_tags(tiny_model_dir, tmp_path / "gemma4", special=True, tags=GEMMA4_TAGS))
    try:
        tokenizer = running.state.tokenizer
        opening, end = (tokenizer.convert_tokens_to_ids(t) for t in GEMMA4_TAGS)
        assert running.state.reasoning_tokens("gemma4") == (opening, end)
        assert running.state.reasoning_tokens("qwen3") == (None, None)  # no <think> here
        for bias, first in (({str(opening): 50, str(end): 100}, list(GEMMA4_TAGS)), ({str(opening): -100}, None)):
            reply = _post(running, "gemma4", max_tokens=60, logit_bias=bias, logprobs=True,
                          structured_outputs={"regex": REGEX}).json()["choices"][0]
            tokens = [t["token"] for t in reply["logprobs"]["content"]]
            if first:  # it opened a thought and closed it at once; the answer follows
                assert tokens[:2] == first, tokens
                assert re.fullmatch(REGEX, "".join(tokens[2:]).removesuffix(tokenizer.eos_token)), tokens
            else:
                assert not set(GEMMA4_TAGS) & set(tokens), tokens
                assert re.fullmatch(REGEX, reply["message"]["content"]), reply["message"]
    finally:
        running.stop()


def test_a_thinking_budget_ends_the_reasoning(thinking_server):
    """`thinking_token_budget`: R1's reasoning (kept from ending by itself) gets that many
    tokens, then `</think>` and the answer; Qwen3's opened one counts after `<think>`; the
    Messages API's thinking.budget_tokens is the same budget."""
    tokenizer = thinking_server.state.tokenizer
    start, end = str(tag_token(tokenizer, START)), str(tag_token(tokenizer, END))
    for parser, bias, before in (("deepseek_r1", {end: -100}, []), ("qwen3", {start: 100, end: -100}, [START])):
        reply = _post(thinking_server, parser, max_tokens=12, logit_bias=bias, logprobs=True,
                      thinking_token_budget=3).json()["choices"][0]
        tokens = [t["token"] for t in reply["logprobs"]["content"]]
        assert tokens[:len(before)] == before and tokens[len(before) + 3] == END, tokens
        assert END not in tokens[len(before):len(before) + 3]
        message = reply["message"]
        assert message["reasoning_content"] == "".join(tokens[len(before):len(before) + 3])
        assert message["content"] == "".join(tokens[len(before) + 4:])
    thinking_server.state.reasoning_parser = "deepseek_r1"  # (the random model never ends it itself)
    body = {"model": MODEL_NAME, "max_tokens": 12, "temperature": 0, "messages": [{"role": "user", "content": "hi"}],
            "thinking": {"type": "enabled"}}
    unlimited = httpx.post(thinking_server.url + "/v1/messages", timeout=30, json=body).json()
    assert [b["type"] for b in unlimited["content"]] == ["thinking"], unlimited
    body["thinking"]["budget_tokens"] = 2
    limited = httpx.post(thinking_server.url + "/v1/messages", timeout=30, json=body).json()
    assert [b["type"] for b in limited["content"]] == ["thinking", "text"], limited
    assert unlimited["content"][0]["thinking"].startswith(limited["content"][0]["thinking"])
    bad = httpx.post(thinking_server.url + "/v1/messages", timeout=30,
                     json={**body, "thinking": {"type": "enabled", "budget_tokens": -1}})
    assert bad.status_code == 400 and "budget_tokens" in bad.text


def test_a_thinking_budget_needs_a_reasoning_parser(server):
    server.state.reasoning_parser = None
    reply = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
        "model": MODEL_NAME, "messages": CHAT, "max_tokens": 4, "thinking_token_budget": 2})
    assert reply.status_code == 400 and "thinking_token_budget" in reply.text
