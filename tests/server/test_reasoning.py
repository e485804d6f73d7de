"""Reasoning parsers: the split of an answer into reasoning_content and content for each
syntax, the stream's deltas adding up to that split however the text is cut into tokens,
and the chat route over real HTTP (the tiny model is made to think by a regex)."""
from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.server.reasoning import REASONING_PARSERS, ReasoningStream, split_reasoning
from tests.server.conftest import CHAT, MODEL_NAME

R1, QWEN3 = REASONING_PARSERS["deepseek_r1"], REASONING_PARSERS["qwen3"]


@pytest.mark.parametrize("syntax, text, expected", [
    (R1, "let me see</think>The answer", ("let me see", "The answer")),
    (R1, "<think>\nlet me see\n</think>\n\nThe answer", ("\nlet me see\n", "\n\nThe answer")),
    (R1, "still thinking when cut", ("still thinking when cut", None)),
    (R1, "</think>only an answer", (None, "only an answer")),
    (R1, "thought</think>", ("thought", None)),
    (QWEN3, "<think>\nhmm\n</think>\n\nParis.", ("\nhmm\n", "\n\nParis.")),
    (QWEN3, "Paris, without thinking.", (None, "Paris, without thinking.")),
    (QWEN3, "  <think>cut before the end", ("cut before the end", None)),
    (QWEN3, "a </think> not opened", (None, "a </think> not opened")),
    (QWEN3, "", (None, None)),
])
def test_split(syntax, text, expected):
    assert split_reasoning(syntax, text) == expected


PIECES = st.sampled_from(["<think>", "</think>", "<", "</", "think", ">", "th", "ink>", "\n", " ", "a", "b c",
                          "<thi", "</th", "é"])


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(PIECES, max_size=12), cuts=st.lists(st.integers(0, 60), max_size=6),
       syntax=st.sampled_from([R1, QWEN3]))
def test_streamed_deltas_add_up_to_the_split(pieces, cuts, syntax):
    text = "".join(pieces)
    bounds = sorted({0, len(text), *[c for c in cuts if c <= len(text)]})
    stream, reasoning, content = ReasoningStream(syntax), "", ""
    for start, end in zip(bounds, bounds[1:]):
        thought, said = stream.delta(text[start:end], final=False)
        reasoning, content = reasoning + thought, content + said
    thought, said = stream.delta("", final=True)
    reasoning, content = reasoning + thought, content + said
    assert (reasoning or None, content or None) == split_reasoning(syntax, text)


THINK = "<think>[a-z]{2,6}</think>[a-z]{2,6}"  # the tiny random model thinks when told to


@pytest.fixture
def chat(server, monkeypatch):
    def post(parser: str | None, **body) -> httpx.Response:
        monkeypatch.setattr(server.state, "reasoning_parser", parser)
        request = {"model": MODEL_NAME, "messages": CHAT, "max_tokens": 24, "temperature": 0, **body}
        return httpx.post(server.url + "/v1/chat/completions", json=request, timeout=30)
    return post


def test_chat_answer_is_split_and_the_stream_says_the_same(chat):
    plain = chat(None, structured_outputs={"regex": THINK}).json()["choices"][0]["message"]
    assert plain["content"].startswith("<think>") and "reasoning_content" not in plain
    message = chat("qwen3", structured_outputs={"regex": THINK}).json()["choices"][0]["message"]
    thought, answer = plain["content"].removeprefix("<think>").split("</think>")
    assert message["reasoning_content"] == thought and message["content"] == answer

    response = chat("qwen3", structured_outputs={"regex": THINK}, stream=True)
    deltas = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: {")]
    chunks = [json.loads(d)["choices"][0]["delta"] for d in deltas]
    assert "".join(c.get("reasoning_content") or "" for c in chunks) == thought
    assert "".join(c.get("content") or "" for c in chunks) == answer
    assert not any("<think>" in (c.get("content") or "") + (c.get("reasoning_content") or "") for c in chunks)


def test_deepseek_r1_output_is_reasoning_until_it_closes_and_constraints_are_content(chat):
    """The R1 template opens <think> in the prompt: an unconstrained answer of the random
    model (no </think>) is all reasoning; a constrained one is all content (it is the
    schema's, not a thought)."""
    raw = chat(None).json()["choices"][0]["message"]["content"]
    message = chat("deepseek_r1").json()["choices"][0]["message"]
    assert "</think>" not in raw and message == {"role": "assistant", "content": None, "reasoning_content": raw}
    constrained = chat("deepseek_r1", structured_outputs={"regex": "[a-z]{3,8}"}).json()["choices"][0]["message"]
    assert constrained["content"] and "reasoning_content" not in constrained


def test_tool_calls_are_read_from_the_content_after_the_reasoning(chat, server, monkeypatch):
    from tests.server.test_tool_calls_http import HERMES_CALLS, HERMES_OUTPUT, TIME, WEATHER

    monkeypatch.setattr(server.state, "tool_call_parser", "hermes")
    forced = {"guided_choice": ["<think>which city?</think>" + HERMES_OUTPUT]}
    choice = chat("qwen3", tools=[WEATHER, TIME], max_tokens=400, **forced).json()["choices"][0]
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls" and message["reasoning_content"] == "which city?"
    assert message["content"] == "Let me check."
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == HERMES_CALLS
