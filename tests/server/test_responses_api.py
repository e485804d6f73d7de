"""OpenAI's Responses API through the real `openai` client: the same answer as the chat
completion of the same conversation (greedy), streamed events that add up to it, the
length limit as an incomplete response, structured output, and clear refusals."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.server.conftest import MODEL_NAME

QUESTION = "Paged attention stores the KV cache"


def strict_events(client, **body) -> list:
    """A streamed response's events, each validated strictly as the SDK's ResponseStreamEvent
    (the client itself parses leniently), with its SSE event name equal to its type."""
    from pydantic import TypeAdapter
    from openai.types.responses import ResponseStreamEvent

    raw = httpx.post(str(client.base_url) + "responses", json={"model": MODEL_NAME, "stream": True, **body}).text
    adapter, events = TypeAdapter(ResponseStreamEvent), []
    for block in raw.strip().split("\n\n"):
        name, data = (line.split(": ", 1)[1] for line in block.splitlines())
        events.append(adapter.validate_python(json.loads(data)))
        assert events[-1].type == name
    return events


def chat_text(client, messages, n: int) -> tuple[str, str, dict]:
    out = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=n, temperature=0)
    return out.choices[0].message.content, out.choices[0].finish_reason, out.usage


def test_a_response_is_the_chat_completion_of_its_conversation(client, server):
    resp = client.responses.create(model=MODEL_NAME, input=QUESTION, instructions="Answer briefly.",
                                   max_output_tokens=12, temperature=0)
    text, finish, usage = chat_text(client, [{"role": "system", "content": "Answer briefly."},
                                             {"role": "user", "content": QUESTION}], 12)
    assert resp.object == "response" and resp.id.startswith("resp_") and resp.model == MODEL_NAME
    assert resp.output_text == text and resp.output[0].type == "message" and resp.output[0].role == "assistant"
    assert resp.usage.input_tokens == usage.prompt_tokens and resp.usage.output_tokens == usage.completion_tokens
    assert finish == "length" and resp.status == "incomplete" and resp.output[0].status == "incomplete"
    assert resp.incomplete_details.reason == "max_output_tokens"
    # every field the SDK's types require, strictly validated
    from openai.types.responses import Response
    raw = httpx.post(str(client.base_url) + "responses", json={"model": MODEL_NAME, "input": QUESTION,
                                                              "max_output_tokens": 4}).json()
    assert Response.model_validate(raw).usage.input_tokens_details.cache_write_tokens == 0
    # a conversation of messages with parts, developer as system
    convo = client.responses.create(model=MODEL_NAME, max_output_tokens=6, temperature=0, input=[
        {"role": "developer", "content": "Answer briefly."},
        {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}])
    assert convo.output_text == chat_text(client, [{"role": "system", "content": "Answer briefly."},
                                                   {"role": "user", "content": QUESTION}], 6)[0]
    server.assert_idle()


def test_streamed_events_add_up_to_the_response(client, server):
    events = list(client.responses.create(model=MODEL_NAME, input=QUESTION, max_output_tokens=10,
                                          temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == events[-4].text == events[-1].response.output_text
    assert deltas == chat_text(client, [{"role": "user", "content": QUESTION}], 10)[0]
    assert [e.type for e in strict_events(client, input=QUESTION, max_output_tokens=10, temperature=0)] == kinds
    server.assert_idle()


def test_text_format_json_schema_constrains_the_output(client):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    resp = client.responses.create(model=MODEL_NAME, input="Name a city", max_output_tokens=40, temperature=0,
                                   text={"format": {"type": "json_schema", "name": "place", "schema": schema}})
    if resp.status == "completed":
        assert "city" in json.loads(resp.output_text)
    assert resp.output_text.startswith("{")


@pytest.mark.parametrize("kwargs, param", [
    (dict(previous_response_id="resp_1"), "previous_response_id"),
    (dict(input=[{"type": "item_reference", "id": "msg_1"}]), "input"),
])
def test_what_it_does_not_do_is_refused(client, kwargs, param):
    args = dict(model=MODEL_NAME, input=QUESTION, max_output_tokens=4)
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(**{**args, **kwargs})
    assert err.value.body["param"] == param
    with pytest.raises(openai.NotFoundError):
        client.responses.create(**{**args, "model": "nope"})


def test_a_reasoning_parser_gives_a_reasoning_item_first(client, server, monkeypatch):
    """With --reasoning-parser deepseek_r1 the output starts inside the reasoning (the random
    model never closes it): a reasoning item holding the chat answer's reasoning_content,
    then the message; streamed, the reasoning text comes as deltas, its item done before
    the message's events."""
    monkeypatch.setattr(server.state, "reasoning_parser", "deepseek_r1")
    raw = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": QUESTION}],
                                         max_tokens=8, temperature=0).choices[0].message.model_extra["reasoning"]
    resp = client.responses.create(model=MODEL_NAME, input=QUESTION, max_output_tokens=8, temperature=0)
    assert [item.type for item in resp.output] == ["reasoning", "message"]
    assert resp.output[0].content[0].text == raw and resp.output_text == ""
    events = list(client.responses.create(model=MODEL_NAME, input=QUESTION, max_output_tokens=8, temperature=0,
                                          stream=True))
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == ["reasoning", "message"]
    assert [e.type for e in strict_events(client, input=QUESTION, max_output_tokens=8, temperature=0)] == [
        e.type for e in events]
    thinking = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")  # as it thinks
    assert thinking == raw == events[-1].response.output[0].content[0].text
    assert [e.type for e in events].index("response.reasoning_text.done") < [e.type for e in events].index(
        "response.output_item.added", 3)
    # the output sent back as the next turn's input (the stateless pattern): reasoning items skipped
    history = [item.model_dump(exclude_none=True) for item in resp.output]
    again = client.responses.create(model=MODEL_NAME, max_output_tokens=4, temperature=0,
                                    input=[{"role": "user", "content": QUESTION}, *history,
                                           {"role": "user", "content": "And then?"}])
    assert again.status == "incomplete" and again.usage.input_tokens > resp.usage.input_tokens


def test_hints_for_openais_service_are_taken(client):
    resp = client.responses.create(model=MODEL_NAME, input=QUESTION, max_output_tokens=4, store=True,
                                   prompt_cache_key="k", safety_identifier="u", service_tier="auto",
                                   top_logprobs=2, stream_options=None)
    assert resp.status == "incomplete" and resp.store is True
