"""gpt-oss's harmony replies (`--reasoning-parser openai_gptoss`, `--tool-call-parser
openai`): the analysis channel becomes the reasoning, final and commentary bodies the
content, calls (`to=functions.NAME`, before or after the channel) tool calls; a stream's
deltas add up to the whole reply's split however the text is cut; and the chat route over
real HTTP, with a tiny model whose vocabulary has harmony's markers as special tokens,
made to write harmony by a forced choice."""
from __future__ import annotations

import json
import shutil

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.server.harmony import HarmonyStream, split_harmony
from tessera.server.tool_parsers import PARSERS
from tests.server.conftest import CHAT, MODEL_NAME, start_server

ANALYSIS = "<|channel|>analysis<|message|>The user wants the time.<|end|>"
CALL = ("<|start|>assistant<|channel|>commentary to=functions.get_time <|constrain|>json"
        '<|message|>{"zone": "UTC"}<|call|>')
# the recipient may also come first, before the channel
CALL_FIRST = '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Oslo", "metric": true}'
FINAL = "<|start|>assistant<|channel|>final<|message|>It is noon in London.<|return|>"


@pytest.mark.parametrize("text, expected", [
    (ANALYSIS + FINAL, ("The user wants the time.", "It is noon in London.")),
    (ANALYSIS + "<|start|>assistant<|channel|>final<|message|>cut mid-answer", ("The user wants the time.",
                                                                               "cut mid-answer")),
    ("<|channel|>analysis<|message|>cut while thinking", ("cut while thinking", None)),
    ("<|channel|>final<|message|>no reasoning at all", (None, "no reasoning at all")),
    # commentary for the user is content; a header cut short is nothing
    ("<|channel|>commentary<|message|>Checking. <|end|><|start|>assistant<|channel|>fin", (None, "Checking. ")),
    ('{"a": 1}', (None, '{"a": 1}')),  # no markup (a constrained output): content as written
    ("<b>Hi</b> there", (None, "<b>Hi</b> there")),  # "<" alone is no header
    ("<|chan", (None, "<|chan")),  # cut before a header was whole: markup it never became
    ("", (None, None)),
])
def test_split(text, expected):
    assert split_harmony(text) == expected


def test_calls_are_written_for_the_openai_parser():
    reasoning, content = split_harmony(ANALYSIS + CALL + CALL_FIRST)
    assert reasoning == "The user wants the time."
    assert content == ('<|start|>assistant to=get_time<|message|>{"zone": "UTC"}<|call|>'
                       '<|start|>assistant to=get_weather<|message|>{"city": "Oslo", "metric": true}<|call|>')
    parser = PARSERS["openai"]
    assert parser.parse(content) == (None, [("get_time", '{"zone": "UTC"}'),
                                            ("get_weather", '{"city": "Oslo", "metric": true}')])
    preamble = split_harmony("<|channel|>commentary<|message|>Let me check.<|end|>" + CALL)[1]
    assert parser.parse(preamble)[0] == "Let me check."
    assert parser.parse(split_harmony(RECIPIENT_FIRST)[1]) == (None, [("get_time", '{"zone": "UTC"}')])
    broken = split_harmony(CALL.replace('{"zone": "UTC"}', '{"zone": '))[1]
    assert parser.parse(broken) == (broken, None)  # a call cut mid-arguments: all content


# the recipient may also open the reply, before any channel
RECIPIENT_FIRST = 'to=functions.get_time<|channel|>commentary json<|message|>{"zone": "UTC"}'
REPLIES = [ANALYSIS + FINAL, ANALYSIS + CALL + CALL_FIRST, "<|channel|>analysis<|message|>a<b <|c|> d",
           "  plain text < not markup", "<|channel|>commentary<|message|>Checking.<|end|>" + CALL,
           "<b>Hi</b> there", RECIPIENT_FIRST]


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(REPLIES), st.lists(st.integers(min_value=1, max_value=9), max_size=60))
def test_streamed_deltas_add_up_to_the_split(text, cuts):
    stream, reasoning, content, at = HarmonyStream(), "", "", 0
    for size in cuts:
        thought, said = stream.delta(text[at:at + size], final=False)
        reasoning, content, at = reasoning + thought, content + said, at + size
        assert "<|end|>" not in content + reasoning
    thought, said = stream.delta(text[at:], final=True)
    assert (reasoning + thought or None, content + said or None) == split_harmony(text)


def test_partial_calls_grow_as_written():
    content = split_harmony(CALL)[1]
    parser = PARSERS["openai"]
    assert parser.content_end(content[:10]) == 0  # may be a call's start: held back
    cut = content[:content.index("UTC")]
    (call,) = parser.partial(cut)
    assert (call.name, call.arguments, call.done) == ("get_time", '{"zone": "', False)


# --- over HTTP ----------------------------------------------------------------------------

HARMONY_TOKENS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]
TEMPLATE = ("{% if reasoning_effort %}<|start|>system<|message|>Reasoning: {{ reasoning_effort }}<|end|>{% endif %}"
            "{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|start|>assistant{% endif %}")


@pytest.fixture(scope="module")
def harmony_server(tiny_model_dir, tmp_path_factory):
    """The tiny model with harmony's markers as special tokens of its vocabulary (ids
    inside its 512) and a harmony-like template, served with both gpt-oss parsers."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("harmony")
    shutil.copytree(tiny_model_dir, folder, dirs_exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_special_tokens({"additional_special_tokens": HARMONY_TOKENS})
    assert max(tokenizer.convert_tokens_to_ids(HARMONY_TOKENS)) < 512
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(folder)
    running = start_server(folder)
    running.state.reasoning_parser, running.state.tool_call_parser = "openai_gptoss", "openai"
    yield running
    running.stop()


def _chat(server, reply: str, **body) -> httpx.Response:
    request = {"model": MODEL_NAME, "messages": CHAT, "max_tokens": 200, "temperature": 0,
               "guided_choice": [reply], **body}
    return httpx.post(server.url + "/v1/chat/completions", json=request, timeout=60)


def _streamed(response: httpx.Response) -> list[dict]:
    lines = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: {")]
    return [json.loads(line)["choices"][0] for line in lines]


def test_reasoning_and_answer_over_http(harmony_server):
    reply = ANALYSIS + FINAL.removesuffix("<|return|>")
    message = _chat(harmony_server, reply).json()["choices"][0]["message"]
    assert message["reasoning_content"] == message["reasoning"] == "The user wants the time."
    assert message["content"] == "It is noon in London."
    chunks = _streamed(_chat(harmony_server, reply, stream=True))
    deltas = [c["delta"] for c in chunks]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "The user wants the time."
    assert "".join(d.get("content") or "" for d in deltas) == "It is noon in London."


def test_tool_calls_over_http(harmony_server):
    from tests.server.test_tool_calls_http import TIME, WEATHER

    reply = ANALYSIS + CALL.removesuffix("<|call|>")
    choice = _chat(harmony_server, reply, tools=[WEATHER, TIME]).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["reasoning_content"] == "The user wants the time."
    (call,) = choice["message"]["tool_calls"]
    assert (call["function"]["name"], call["function"]["arguments"]) == ("get_time", '{"zone": "UTC"}')
    chunks = _streamed(_chat(harmony_server, reply, tools=[WEATHER, TIME], stream=True))
    pieces = [c for chunk in chunks for c in chunk["delta"].get("tool_calls") or []]
    assert pieces[0]["function"]["name"] == "get_time"
    assert "".join(p["function"].get("arguments", "") for p in pieces) == '{"zone": "UTC"}'
    assert chunks[-1]["finish_reason"] == "tool_calls"
    assert not any(c["delta"].get("content") for c in chunks)


def test_reasoning_effort_reaches_the_template(harmony_server):
    """OpenAI's `reasoning_effort` (chat) and `reasoning.effort` (Responses) render the
    template's reasoning line; chat_template_kwargs override it; an unknown level is a 400."""
    def prompt_tokens(path: str, **body) -> int:
        limit = "max_output_tokens" if path == "/v1/responses" else "max_tokens"
        request = {"model": MODEL_NAME, limit: 1, "temperature": 0, **body}
        response = httpx.post(harmony_server.url + path, json=request, timeout=60)
        assert response.status_code == 200, response.text
        usage = response.json()["usage"]
        return usage.get("prompt_tokens", usage.get("input_tokens"))

    plain = prompt_tokens("/v1/chat/completions", messages=CHAT)
    low = prompt_tokens("/v1/chat/completions", messages=CHAT, reasoning_effort="low")
    assert low > plain
    assert prompt_tokens("/v1/chat/completions", messages=CHAT, reasoning_effort="low",
                         chat_template_kwargs={"reasoning_effort": None}) == plain
    assert prompt_tokens("/v1/responses", input=CHAT, reasoning={"effort": "low"}) == low
    bad = httpx.post(harmony_server.url + "/v1/chat/completions", timeout=60,
                     json={"model": MODEL_NAME, "messages": CHAT, "reasoning_effort": "extreme"})
    assert bad.status_code == 400 and "reasoning_effort" in bad.text


def test_the_openai_tool_parser_needs_the_harmony_reasoning_parser():
    """Without openai_gptoss the calls would stay harmony messages in the answer: refused at
    start-up, before any model loads."""
    from tessera.cli import main

    with pytest.raises(SystemExit, match="start the server with both"):
        main(["serve", "--model", "/nonexistent", "--tool-call-parser", "openai"])
