"""Function tools and logprobs on OpenAI's Responses API, through the real `openai` client:
a named function or "required" gives valid function_call items (streamed as argument
deltas, the same as whole), "auto" reads the model's own syntax with the server's parser,
calls and their results sent back as input render as the chat route renders the same
conversation, and the message's logprobs are chat's."""
from __future__ import annotations

import json

import httpx
import pytest

from tessera.server.protocol import ResponsesRequest
from tessera.server.responses_input import chat_request
from tests.server.conftest import MODEL_NAME
from tests.server.test_responses_api import QUESTION, strict_events

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                                           "metric": {"type": "boolean"}},
                          "required": ["city", "metric"], "additionalProperties": False}}
TIME = {"type": "function", "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                       "required": ["zone"], "additionalProperties": False}}
# a template that writes calls and results, so that their rendering can be compared
TOOL_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}"
                 "{% for c in m.get('tool_calls', []) %} [{{ c['id'] }} {{ c['function']['name'] }} "
                 "{{ c['function']['arguments'] | tojson }}]{% endfor %}"
                 "{% if m.get('tool_call_id') %} ({{ m['tool_call_id'] }}){% endif %}\n{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant:{% endif %}")


def create(client, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_output_tokens", 80)
    return client.responses.create(model=MODEL_NAME, input=kw.pop("input", QUESTION), **kw)


def valid_call(item) -> bool:
    args = json.loads(item.arguments)
    if item.name == "get_weather":
        return set(args) == {"city", "metric"} and args["city"] in ("Paris", "Oslo")
    return item.name == "get_time" and args["zone"] in ("UTC", "CET")


def test_a_named_function_gives_one_function_call_item_streamed_and_not(client, server):
    choice = {"type": "function", "name": "get_weather"}
    resp = create(client, tools=[WEATHER, TIME], tool_choice=choice)
    (call,) = resp.output
    assert call.type == "function_call" and call.name == "get_weather" and valid_call(call)
    assert call.call_id.startswith("call_") and call.id.startswith("fc_") and call.status == "completed"
    assert resp.status == "completed" and resp.output_text == "" and resp.tool_choice.name == "get_weather"
    assert [t.name for t in resp.tools] == ["get_weather", "get_time"]
    events = strict_events(client, input=QUESTION, tools=[WEATHER, TIME], tool_choice=choice, temperature=0,
                           max_output_tokens=80)
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done",
                          "response.completed"]
    assert set(kinds[3:-3]) == {"response.function_call_arguments.delta"}
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == events[-3].arguments == call.arguments == events[-1].response.output[0].arguments
    assert events[2].item.type == "function_call" and events[2].item.arguments == ""
    assert events[2].item.status == "in_progress" and events[-2].item.status == "completed"
    assert len({e.item_id for e in events if hasattr(e, "item_id")}) == 1
    server.assert_idle()


@pytest.mark.parametrize("parallel", [None, False])
def test_required_gives_valid_calls(client, parallel):
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    resp = create(client, tools=[WEATHER, TIME], tool_choice="required", max_output_tokens=400, **extra)
    calls = [item for item in resp.output if item.type == "function_call"]
    assert calls and all(valid_call(c) for c in calls) and resp.parallel_tool_calls is (parallel is None)
    if parallel is False:
        assert len(calls) == 1
    assert len({c.call_id for c in calls}) == len(calls)
    # streamed, the calls come once the list is whole, one item each, as the response's
    events = strict_events(client, input=QUESTION, tools=[WEATHER, TIME], tool_choice="required", temperature=0,
                           max_output_tokens=400, **extra)
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [(i.name, i.arguments) for i in done] == [(c.name, c.arguments) for c in calls]
    assert [(i.name, i.arguments) for i in events[-1].response.output] == [(c.name, c.arguments) for c in calls]


def test_auto_reads_the_models_own_calls_with_the_servers_parser(client, server, monkeypatch):
    """The tiny model is made to write a llama3_json call by a text.format schema (which
    "auto" leaves free); the parser turns it into a function_call item."""
    monkeypatch.setattr(server.state, "tool_call_parser", "llama3_json")
    call = {"type": "object", "properties": {"name": {"const": "get_time"}, "parameters": {
        "type": "object", "properties": {"zone": {"const": "UTC"}}, "required": ["zone"],
        "additionalProperties": False}}, "required": ["name", "parameters"], "additionalProperties": False}
    fmt = {"format": {"type": "json_schema", "name": "call", "schema": call}}
    resp = create(client, tools=[WEATHER, TIME], text=fmt, max_output_tokens=200)
    assert [(i.type, i.name, json.loads(i.arguments)) for i in resp.output] == [
        ("function_call", "get_time", {"zone": "UTC"})]
    events = strict_events(client, input=QUESTION, tools=[WEATHER, TIME], text=fmt, temperature=0,
                           max_output_tokens=200)
    (done,) = [e.item for e in events if e.type == "response.output_item.done"]
    assert done.type == "function_call" and done.arguments == resp.output[0].arguments
    # an answer that is not a call is the message
    plain = {"type": "object", "properties": {"answer": {"const": "no"}}, "required": ["answer"],
             "additionalProperties": False}
    text = create(client, tools=[WEATHER, TIME], tool_choice="auto", max_output_tokens=200,
                  text={"format": {"type": "json_schema", "name": "a", "schema": plain}})
    assert [i.type for i in text.output] == ["message"] and json.loads(text.output_text) == {"answer": "no"}
    server.assert_idle()


CONVERSATION = [
    {"role": "user", "content": "Time and weather in Oslo?"},
    {"type": "reasoning", "id": "rs_1", "summary": []},
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
    {"type": "function_call", "call_id": "call_a", "name": "get_time", "arguments": '{"zone": "CET"}'},
    {"type": "function_call", "call_id": "call_b", "name": "get_weather",
     "arguments": '{"city": "Oslo", "metric": true}', "id": "fc_2", "status": "completed"},
    {"type": "function_call_output", "call_id": "call_a", "output": "12:00"},
    {"type": "function_call_output", "call_id": "call_b", "output": [{"type": "input_text", "text": "-3 C"}]},
]
AS_CHAT = [
    {"role": "user", "content": "Time and weather in Oslo?"},
    {"role": "assistant", "content": "Checking.", "tool_calls": [
        {"id": "call_a", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}},
        {"id": "call_b", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "metric": true}'}}]},
    {"role": "tool", "tool_call_id": "call_a", "content": "12:00", "name": "get_time"},
    {"role": "tool", "tool_call_id": "call_b", "content": "-3 C", "name": "get_weather"},
]


def test_calls_and_results_sent_back_are_the_chat_conversation(client, server, monkeypatch):
    chat = chat_request(ResponsesRequest(input=CONVERSATION, tools=[WEATHER, TIME], tool_choice="none"))
    assert [m.model_dump(exclude_none=True) for m in chat.messages] == [
        {**m, "content": [{"type": "text", "text": m["content"]}]} if m["role"] == "assistant" else m
        for m in AS_CHAT]
    assert chat.tools[0] == {"type": "function", "function": {k: WEATHER[k] for k in
                                                              ("name", "description", "parameters")}}
    monkeypatch.setattr(server.state, "chat_template", TOOL_TEMPLATE)
    resp = create(client, input=CONVERSATION, tools=[WEATHER, TIME], tool_choice="none", max_output_tokens=6)
    same = client.chat.completions.create(model=MODEL_NAME, messages=AS_CHAT, max_tokens=6, temperature=0,
                                          tools=[{"type": "function", "function": WEATHER}], tool_choice="none")
    assert resp.usage.input_tokens == same.usage.prompt_tokens and resp.output_text == same.choices[0].message.content
    rendered = httpx.post(str(client.base_url).replace("/v1/", "/") + "tokenize", json={"messages": AS_CHAT}).json()
    text = server.state.tokenizer.decode(rendered["tokens"])
    assert "[call_a get_time" in text and "(call_b)" in text and rendered["count"] == resp.usage.input_tokens
    # a response's own output sent back with the result (the Agents SDK's loop)
    first = create(client, tools=[TIME], tool_choice={"type": "function", "name": "get_time"})
    history = [{"role": "user", "content": QUESTION}, *[i.model_dump(exclude_none=True) for i in first.output],
               {"type": "function_call_output", "call_id": first.output[0].call_id, "output": "noon"}]
    again = create(client, input=history, tools=[TIME], tool_choice="none", max_output_tokens=4)
    assert again.output[0].type == "message" and again.usage.input_tokens > first.usage.input_tokens
    server.assert_idle()


def test_message_logprobs_are_the_chat_ones_streamed_and_not(client, server):
    resp = create(client, max_output_tokens=6, include=["message.output_text.logprobs"], top_logprobs=2)
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": QUESTION}],
                                          max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    lps = resp.output[0].content[0].logprobs
    want = chat.choices[0].logprobs.content
    assert [(lp.token, lp.logprob, len(lp.top_logprobs)) for lp in lps] == [
        (lp.token, lp.logprob, 2) for lp in want] and len(lps) == resp.usage.output_tokens == 6
    assert "".join(lp.token for lp in lps) == resp.output_text
    events = strict_events(client, input=QUESTION, max_output_tokens=6, temperature=0, top_logprobs=0)
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert [(lp.token, lp.logprob, lp.top_logprobs) for lp in streamed] == [(lp.token, lp.logprob, []) for lp in lps]
    assert create(client, max_output_tokens=3).output[0].content[0].logprobs == []
    server.assert_idle()


@pytest.mark.parametrize("body, param, message", [
    ({"tools": [{"type": "web_search"}], "tool_choice": "required"}, "tools", "hosted tools"),
    ({"tools": [TIME]}, "tool_choice", "--tool-call-parser"),
    ({"tools": [TIME], "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice",
     "'allowed_tools'"),
    ({"tools": [TIME], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "not among `tools`"),
    ({"tool_choice": "required"}, "tool_choice", "needs `tools`"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input", "`call_id`"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "get_time", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c", "output": [{"type": "input_image"}]}]}, "input",
     "input_text"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]}, "input", "no function_call"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]}, "input", "must be a string"),
    ({"tools": [{"type": "custom", "name": "patch"}], "tool_choice": "required"}, "tools", "custom tools"),
    ({"text": {"format": "json"}}, "text", "must be an object"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text", "needs a `schema`"),
    ({"include": ["everything"]}, "include", "everything"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input", "'item_reference'"),
    ({"tools": [TIME], "tool_choice": "required", "include": ["message.output_text.logprobs"]}, "include",
     "plain answers"),
    ({"top_logprobs": 21}, "top_logprobs", "[0, 20]"),
])
def test_what_tools_cannot_do_is_a_clear_400(url, server, body, param, message):
    r = httpx.post(url + "/v1/responses", json={"model": MODEL_NAME, "input": QUESTION, "max_output_tokens": 4,
                                                 **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"], error
    server.assert_idle()


def test_the_writer_opens_each_item_in_turn_and_closes_the_one_before():
    """Reasoning, then text, then two calls (a parser's, whole, and one in pieces): each item
    has its own output_index and id, each event validates as the SDK's, and the finished
    response holds the same items."""
    from pydantic import TypeAdapter
    from openai.types.responses import Response, ResponseStreamEvent

    from tessera.engine.outputs import CompletionOutput
    from tessera.server.responses_output import ResponseWriter

    writer = ResponseWriter("resp_1", MODEL_NAME, ResponsesRequest(input="q", tools=[TIME]), 3, len)
    raw = writer.delta("thinking ", {}) + writer.delta("done", {"content": "Let me"}, [])
    raw += writer.delta("", {"content": " check.", "tool_calls": [
        {"index": 0, "id": "x", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}},
        {"index": 1, "id": "y", "type": "function", "function": {"name": "get_time", "arguments": "{"}}]})
    raw += writer.delta("", {"tool_calls": [{"index": 1, "function": {"arguments": '"zone": "CET"}'}}]})
    out = CompletionOutput(index=0, text="", token_ids=[1, 2, 3], finish_reason="eos_token")
    raw += writer.close_output(out)
    adapter = TypeAdapter(ResponseStreamEvent)
    events = [adapter.validate_python(json.loads(block.split("data: ", 1)[1])) for block in raw]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    added = [(e.output_index, e.item.type) for e in events if e.type == "response.output_item.added"]
    done = [(e.output_index, e.item.type) for e in events if e.type == "response.output_item.done"]
    assert added == done == [(0, "reasoning"), (1, "message"), (2, "function_call"), (3, "function_call")]
    assert [e.item.name for e in events if e.type == "response.output_item.added" and e.output_index > 1] == [
        "get_time", "get_time"]  # a call's item opens with its function's name
    kinds = [(e.type, e.output_index) for e in events if hasattr(e, "output_index")]
    for index in range(3):  # an item is done before the next is added
        assert kinds.index(("response.output_item.done", index)) < kinds.index(("response.output_item.added", index + 1))
    response = Response.model_validate(writer.response(out))
    assert response.output[0].content[0].text == "thinking done" and response.output_text == "Let me check."
    assert [(i.name, i.arguments) for i in response.output[2:]] == [("get_time", '{"zone": "UTC"}'),
                                                                    ("get_time", '{"zone": "CET"}')]
    assert response.usage.output_tokens_details.reasoning_tokens == len("thinking done")
