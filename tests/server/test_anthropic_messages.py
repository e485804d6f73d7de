"""Anthropic's Messages API through the real `anthropic` client: the same answer as the
chat completion of the same conversation (greedy), streamed events that add up to it and
validate as the SDK's, stop sequences, prefill, tool_use blocks (forced, streamed as
input_json_delta), tool results sent back, token counting, auth by x-api-key, and errors
in Anthropic's shape."""
from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from tests.server.conftest import MODEL_NAME
from tests.server.test_responses_tools import TOOL_TEMPLATE

QUESTION = "Paged attention stores the KV cache"
WEATHER = {"name": "get_weather", "description": "Weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                                            "metric": {"type": "boolean"}},
                            "required": ["city", "metric"], "additionalProperties": False}}
TIME = {"name": "get_time", "input_schema": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                             "required": ["zone"], "additionalProperties": False}}


@pytest.fixture
def client(url):
    with anthropic.Anthropic(base_url=url, api_key="-", max_retries=0, timeout=60) as client:
        yield client


GREEDY = {"temperature": 0}  # the newest SDK leaves sampling fields out of its signature


def create(client, **kw):
    kw.setdefault("extra_body", GREEDY)
    kw.setdefault("max_tokens", 12)
    kw.setdefault("messages", [{"role": "user", "content": QUESTION}])
    return client.messages.create(model=MODEL_NAME, **kw)


def prompt_tokens(msg) -> int:
    """The whole prompt: Anthropic counts the tokens read from the cache apart."""
    return msg.usage.input_tokens + msg.usage.cache_read_input_tokens


def raw_events(url: str, **body) -> list:
    """A streamed message's events, each validated as the SDK's RawMessageStreamEvent, with its
    SSE event name equal to its type."""
    from pydantic import TypeAdapter
    from anthropic.types import RawMessageStreamEvent

    body = {"model": MODEL_NAME, "stream": True, "max_tokens": 12, "temperature": 0,
            "messages": [{"role": "user", "content": QUESTION}], **body}
    raw = httpx.post(url + "/v1/messages", json=body, timeout=60).text
    adapter, events = TypeAdapter(RawMessageStreamEvent), []
    for block in raw.strip().split("\n\n"):
        name, data = (line.split(": ", 1)[1] for line in block.splitlines())
        events.append(adapter.validate_python(json.loads(data)))
        assert events[-1].type == name
    return events


def test_a_message_is_the_chat_completion_of_its_conversation(client, openai_client, url, server):
    msg = create(client, system="Answer briefly.")
    chat = openai_client.chat.completions.create(model=MODEL_NAME, max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": "Answer briefly."}, {"role": "user", "content": QUESTION}])
    (block,) = msg.content
    assert block.type == "text" and block.text == chat.choices[0].message.content
    assert msg.id.startswith("msg_") and msg.model == MODEL_NAME and msg.role == "assistant"
    assert msg.stop_reason == "max_tokens" and msg.stop_sequence is None
    assert (prompt_tokens(msg), msg.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    from anthropic.types import Message
    raw = httpx.post(url + "/v1/messages", json={"model": MODEL_NAME, "max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "text", "text": QUESTION, "cache_control": {"type": "ephemeral"}}]}],
        "system": [{"type": "text", "text": "Answer briefly."}]}).json()
    assert Message.model_validate(raw).usage.cache_creation_input_tokens == 0
    assert client.messages.count_tokens(model=MODEL_NAME, system="Answer briefly.", messages=[
        {"role": "user", "content": QUESTION}]).input_tokens == prompt_tokens(msg)
    server.assert_idle()


def test_streamed_events_add_up_to_the_message(client, url, server):
    whole = create(client)
    with client.messages.stream(model=MODEL_NAME, max_tokens=12, extra_body=GREEDY,
                                messages=[{"role": "user", "content": QUESTION}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == whole.usage.output_tokens
    events = raw_events(url)
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    start = events[0].message.usage
    assert start.input_tokens + start.cache_read_input_tokens == prompt_tokens(whole) and events[0].message.content == []
    assert events[-2].delta.stop_reason == "max_tokens" and events[-2].usage.output_tokens == 12
    server.assert_idle()


def test_stop_sequences_and_prefill(client, openai_client, server):
    text = create(client, max_tokens=20).content[0].text
    stop = text[4:7]
    cut = create(client, max_tokens=20, stop_sequences=["\u2603", stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[:text.index(stop)]
    with client.messages.stream(model=MODEL_NAME, max_tokens=20, extra_body=GREEDY, stop_sequences=[stop],
                                messages=[{"role": "user", "content": QUESTION}]) as stream:
        assert stream.get_final_message().stop_sequence == stop
    # a last assistant turn is continued (Anthropic's prefill), as chat's continue_final_message
    turns = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "It stores"}]
    more = create(client, messages=turns, max_tokens=6)
    same = openai_client.chat.completions.create(model=MODEL_NAME, messages=turns, max_tokens=6, temperature=0,
                                               extra_body={"add_generation_prompt": False,
                                                           "continue_final_message": True})
    assert more.content[0].text == same.choices[0].message.content
    assert prompt_tokens(more) == same.usage.prompt_tokens
    server.assert_idle()


def valid_input(block) -> bool:
    if block.name == "get_weather":
        return set(block.input) == {"city", "metric"} and block.input["city"] in ("Paris", "Oslo")
    return block.name == "get_time" and block.input["zone"] in ("UTC", "CET")


def test_a_forced_tool_gives_a_tool_use_block_streamed_and_not(client, url, server):
    choice = {"type": "tool", "name": "get_weather"}
    msg = create(client, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=80)
    (block,) = msg.content
    assert block.type == "tool_use" and block.name == "get_weather" and valid_input(block)
    assert block.id.startswith("toolu_") and msg.stop_reason == "tool_use"
    with client.messages.stream(model=MODEL_NAME, max_tokens=80, extra_body=GREEDY, tools=[WEATHER, TIME],
                                tool_choice=choice, messages=[{"role": "user", "content": QUESTION}]) as stream:
        final = stream.get_final_message()
    assert final.content[0].input == block.input and final.stop_reason == "tool_use"
    assert final.content[0].name == "get_weather"
    events = raw_events(url, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=80)
    partial = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta")
    assert json.loads(partial) == block.input and events[1].content_block.type == "tool_use"
    assert events[1].content_block.name == "get_weather"  # the block opens with its tool's name
    # "any" with parallel use disabled: exactly one call
    one = create(client, tools=[WEATHER, TIME], tool_choice={"type": "any", "disable_parallel_tool_use": True},
                 max_tokens=200)
    assert [b.type for b in one.content] == ["tool_use"] and valid_input(one.content[0])
    # cut short (max_tokens, a stop sequence inside the arguments): a tool_use of the complete
    # members, whole as the SDK reads them from the stream
    for cut, reason in (({"max_tokens": 9}, "max_tokens"), ({"stop_sequences": ["metric"]}, "stop_sequence")):
        short = create(client, tools=[WEATHER], tool_choice=choice, **{"max_tokens": 80, **cut})
        with client.messages.stream(model=MODEL_NAME, extra_body=GREEDY, tools=[WEATHER], tool_choice=choice,
                                    messages=[{"role": "user", "content": QUESTION}],
                                    **{"max_tokens": 80, **cut}) as stream:
            streamed = stream.get_final_message()
        assert [b.type for b in short.content] == ["tool_use"] and short.stop_reason == streamed.stop_reason == reason
        assert short.content[0].input == streamed.content[0].input and set(short.content[0].input) < {"city", "metric"}
    server.assert_idle()


CONVERSATION = [
    {"role": "user", "content": "Time in Oslo?"},
    {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                      {"type": "text", "text": "Checking."},
                                      {"type": "tool_use", "id": "toolu_a", "name": "get_time",
                                       "input": {"zone": "CET"}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_a", "is_error": True,
                                  "content": [{"type": "text", "text": "12:00"}]},
                                 {"type": "text", "text": "And now?"}]},
]
AS_CHAT = [
    {"role": "user", "content": "Time in Oslo?"},
    {"role": "assistant", "content": "Checking.", "tool_calls": [
        {"id": "toolu_a", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}}]},
    {"role": "tool", "tool_call_id": "toolu_a", "content": "12:00", "name": "get_time", "is_error": True},
    {"role": "user", "content": [{"type": "text", "text": "And now?"}]},
]


def test_tool_results_sent_back_are_the_chat_conversation(client, openai_client, server, monkeypatch):
    from tessera.server.anthropic_input import MessagesRequest, chat_request

    chat = chat_request(MessagesRequest(model=MODEL_NAME, messages=CONVERSATION, tools=[TIME]))
    assert [m.model_dump(exclude_none=True) for m in chat.messages] == AS_CHAT
    monkeypatch.setattr(server.state, "chat_template", TOOL_TEMPLATE)
    msg = create(client, messages=CONVERSATION, tools=[TIME], tool_choice={"type": "none"}, max_tokens=6)
    same = openai_client.chat.completions.create(model=MODEL_NAME, messages=AS_CHAT, max_tokens=6, temperature=0,
                                               tools=[{"type": "function", "function": {
                                                   "name": "get_time", "parameters": TIME["input_schema"]}}],
                                               tool_choice="none")
    assert prompt_tokens(msg) == same.usage.prompt_tokens and msg.content[0].text == same.choices[0].message.content
    server.assert_idle()


def test_auth_by_x_api_key(url, server, monkeypatch):
    monkeypatch.setattr(server.state, "api_key", "sk-test")
    with anthropic.Anthropic(base_url=url, api_key="sk-test", max_retries=0) as good:
        assert create(good, max_tokens=2).usage.output_tokens == 2
    with anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0) as bad:
        with pytest.raises(anthropic.AuthenticationError) as err:
            create(bad, max_tokens=2)
    assert err.value.body["error"]["type"] == "authentication_error"


@pytest.mark.parametrize("body, kind, message", [
    ({"max_tokens": None}, "invalid_request_error", "max_tokens"),
    ({"model": "claude-nope"}, "not_found_error", "claude-nope"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "invalid_request_error", "server tools"),
    ({"messages": [{"role": "system", "content": "x"}]}, "invalid_request_error", "`system`"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "invalid_request_error",
     "'document'"),
    ({"tool_choice": {"type": "any"}}, "invalid_request_error", "needs `tools`"),
    ({"tools": [TIME]}, "invalid_request_error", "--tool-call-parser"),
    ({"unknown_field": 1}, "invalid_request_error", "unknown_field"),
    ({"temperature": 5}, "invalid_request_error", "between 0 and 1"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "invalid_request_error",
     "must be a string"),
    ({"messages": [{"role": "user", "content": []}]}, "invalid_request_error", "cannot be empty"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": "get_time", "input": {}}]}]}, "invalid_request_error",
     "no tool_result"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t9", "content": "x"}]}]},
     "invalid_request_error", "only those"),
])
def test_errors_are_anthropics(url, server, body, kind, message):
    """Anthropic's error shape, what the real API refuses refused (a tool_use needs its
    tool_result next, and a result its tool_use), in Anthropic's words."""
    full = {"model": MODEL_NAME, "max_tokens": 4, "messages": [{"role": "user", "content": QUESTION}], **body}
    r = httpx.post(url + "/v1/messages", json={k: v for k, v in full.items() if v is not None})
    assert r.status_code == (404 if kind == "not_found_error" else 400), r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == kind and message in err["error"]["message"], err
    server.assert_idle()


def test_output_config_format_constrains_the_text(client):
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
              "additionalProperties": False}
    msg = create(client, max_tokens=40, output_config={"format": {"type": "json_schema", "schema": schema},
                                                       "effort": "low"})
    assert json.loads(msg.content[0].text)["city"] in ("Paris", "Oslo") and msg.stop_reason == "end_turn"
    with pytest.raises(anthropic.BadRequestError, match="output_config.format"):
        create(client, output_config={"format": {"type": "regex"}})


def test_no_such_route_or_method_is_an_anthropic_error(url):
    r = httpx.get(url + "/v1/messages")
    assert r.status_code == 405 and r.json()["type"] == "error"
    assert httpx.get(url + "/v1/nowhere").json() == {"detail": "Not Found"}  # elsewhere FastAPI's, as vLLM's


def test_auto_tool_use_streams_its_input_as_the_model_writes_it(client, url, server, monkeypatch):
    """Under --tool-call-parser (llama3_json here; the tiny model is made to write a call by
    output_config.format): the tool_use block opens with its name, its input comes in
    several input_json_delta pieces, and adds up to the whole reply's input."""
    monkeypatch.setattr(server.state, "tool_call_parser", "llama3_json")
    call = {"type": "object", "properties": {"name": {"const": "get_time"}, "parameters": {
        "type": "object", "properties": {"zone": {"const": "UTC"}}, "required": ["zone"],
        "additionalProperties": False}}, "required": ["name", "parameters"], "additionalProperties": False}
    body = dict(tools=[WEATHER, TIME], max_tokens=200, output_config={"format": {"type": "json_schema", "schema": call}})
    whole = create(client, **body)
    assert [(b.type, b.name, b.input) for b in whole.content] == [("tool_use", "get_time", {"zone": "UTC"})]
    assert whole.stop_reason == "tool_use"
    events = raw_events(url, **body)
    start = [e for e in events if e.type == "content_block_start"]
    assert [(e.content_block.type, e.content_block.name) for e in start] == [("tool_use", "get_time")]
    pieces = [e.delta.partial_json for e in events if e.type == "content_block_delta"]
    assert len(pieces) > 1 and json.loads("".join(pieces)) == {"zone": "UTC"}
    server.assert_idle()


def test_thinking_switches_the_templates_enable_thinking(client, server, monkeypatch):
    """{"type": "disabled"} renders the prompt with enable_thinking false (Qwen3's switch),
    "enabled" with it true, and no `thinking` as the template's default."""
    template = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}<s>assistant:"
                "{% if enable_thinking is defined and not enable_thinking %} no thoughts{% endif %}")
    monkeypatch.setattr(server.state, "chat_template", template)
    tokens = {kind: create(client, max_tokens=1, **({"thinking": {"type": kind, **(
        {"budget_tokens": 1024} if kind == "enabled" else {})}} if kind else {})).usage for kind in
              ("disabled", "enabled", None)}
    counted = {kind: usage.input_tokens + usage.cache_read_input_tokens for kind, usage in tokens.items()}
    assert counted["disabled"] > counted["enabled"] == counted[None]


def test_a_max_tokens_past_the_context_is_a_bound_not_an_error(client, openai_client, server):
    """Anthropic's max_tokens is a bound the model may stop before (Claude Code asks for
    32000 whatever the model): past the context's room it is cut to the room, and a reply
    that fills the context says model_context_window_exceeded; the chat route refuses it,
    as vLLM does."""
    room = server.state.limits.max_total_tokens
    msg = create(client, max_tokens=room * 4)
    assert msg.stop_reason == "model_context_window_exceeded"
    assert msg.usage.output_tokens == room - (msg.usage.input_tokens + msg.usage.cache_read_input_tokens)
    with pytest.raises(openai.BadRequestError):
        openai_client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": QUESTION}],
                                            max_tokens=room * 4)
    short = create(client, max_tokens=3)
    assert short.stop_reason == "max_tokens"
    server.assert_idle()
