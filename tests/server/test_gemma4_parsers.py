"""Gemma 4's parsers: `--tool-call-parser gemma4` (`<|tool_call>call:NAME{...}<tool_call|>` in
Gemma's own notation: bare keys, `<|"|>`-delimited strings) and `--reasoning-parser gemma4`
(`<|channel>thought` ... `<channel|>`), whole, streamed in pieces of every size, and over
real HTTP (the tiny model is made to write them by a structured output)."""
from __future__ import annotations

import json

import httpx
import pytest

from tessera.server.reasoning import ReasoningStream, prompt_opens_reasoning, split_reasoning
from tessera.server.tool_parsers import PARSERS
from tests.server.conftest import CHAT, MODEL_NAME
from tests.server.test_tool_calls_http import GEMMA4_OUTPUT, HERMES_CALLS, stream_pieces

Q = '<|"|>'


@pytest.mark.parametrize("size", [1, 3, 8, 1000])
def test_stream_pieces_give_the_calls_and_the_content_before_them(size):
    assert stream_pieces(GEMMA4_OUTPUT, size, "gemma4") == ("Let me check.", HERMES_CALLS, "tool_calls")
    waiting = GEMMA4_OUTPUT + "<|tool_response>"  # where the model waits for the results
    assert stream_pieces(waiting, size, "gemma4") == ("Let me check.", HERMES_CALLS, "tool_calls")
    for text in ("No tools <|tool but not a marker", f"<|tool_call>call:get_time{{zone:{Q}UTC}}<tool_call|>",
                 "<|tool_call>call:get_time{zone:UTC}<tool_call|>", "<|tool_call>call:get_time{}",
                 f"<|tool_call>call:get_time{{zone:{Q}UTC{Q}}}<tool_call|> and more"):
        assert stream_pieces(text, size, "gemma4") == (text, [], "stop")  # malformed or cut: content


def test_values_become_json():
    parse = PARSERS["gemma4"].parse
    text = (f"<|tool_call>call:fs.write{{path:{Q}a b, c{Q},lines:[1, -2.50, 3e2],opts:{{force:false,mode:null}},"
            f"{Q}spaced key{Q}:{Q}{{not: an object}}{Q}}}<tool_call|>")
    content, calls = parse(text)
    assert content is None and calls[0][0] == "fs.write"
    assert json.loads(calls[0][1]) == {"path": "a b, c", "lines": [1, -2.5, 300], "opts": {"force": False, "mode": None},
                                       "spaced key": "{not: an object}"}
    assert '"lines": [1, -2.50, 3E+2]' in calls[0][1]  # numbers keep their digits
    assert parse("<|tool_call>call:f{a:1,a:2}<tool_call|>") == ("<|tool_call>call:f{a:1,a:2}<tool_call|>", None)
    assert parse("<|tool_call>call:f{}<tool_call|>") == (None, [("f", "{}")])


@pytest.mark.parametrize("opened, text, expected", [
    (False, "<|channel>thought\nhmm<channel|>Paris.", ("\nhmm", "Paris.")),
    (True, "\nstill thinking", ("\nstill thinking", None)),
    (True, "done<channel|>The answer", ("done", "The answer")),
    (False, "Paris, without thinking.", (None, "Paris, without thinking.")),
    (False, "a <channel|> not opened", (None, "a <channel|> not opened")),
])
def test_reasoning_split(opened, text, expected):
    assert split_reasoning(text, opened, "gemma4") == expected


@pytest.mark.parametrize("size", [1, 2, 5, 100])
def test_reasoning_streamed_in_pieces(size):
    text = "<|channel>thought\nlet me see<channel|>The answer"
    stream, reasoning, content = ReasoningStream(False, "<|channel>thought", "<channel|>"), "", ""
    for i in range(0, len(text), size):
        thought, said = stream.delta(text[i:i + size], final=False)
        reasoning, content = reasoning + thought, content + said
    thought, said = stream.delta("", final=True)
    assert (reasoning + thought, content + said) == ("\nlet me see", "The answer")


def test_a_generation_prompt_that_opens_the_thought():
    assert prompt_opens_reasoning("<|turn>model\n<|channel>thought\n", "gemma4")
    assert not prompt_opens_reasoning("<|turn>model\n", "gemma4")


def test_reasoning_over_http(server, monkeypatch):
    """(The tool parser over HTTP: tests/server/test_tool_calls_http.py.)"""
    monkeypatch.setattr(server.state, "reasoning_parser", "gemma4")
    request = {"model": MODEL_NAME, "messages": CHAT, "max_tokens": 200, "temperature": 0,
               "guided_choice": ["<|channel>thought\nhmm<channel|>Paris."]}
    message = httpx.post(server.url + "/v1/chat/completions", json=request, timeout=30).json()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("\nhmm", "Paris.")
