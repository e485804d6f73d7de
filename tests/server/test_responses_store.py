"""Stored responses through the real `openai` client: a response continued by
`previous_response_id` is the chat completion of the whole conversation, a response can be
fetched again and deleted, `store: false` keeps nothing, and the store keeps only the
newest --responses-store-size responses."""
from __future__ import annotations

import httpx
import openai
import pytest

from tessera.server.responses_store import ResponseStore
from tests.server.conftest import MODEL_NAME
from tests.server.test_responses_tools import TIME, create


def test_previous_response_id_continues_the_conversation(client, server):
    first = create(client, input="Paged attention", instructions="Answer briefly.", max_output_tokens=6)
    assert first.store is True and client.responses.retrieve(first.id).model_dump() == first.model_dump()
    second = create(client, input="And then?", previous_response_id=first.id, max_output_tokens=6)
    chat = client.chat.completions.create(model=MODEL_NAME, max_tokens=6, temperature=0, messages=[
        {"role": "user", "content": "Paged attention"}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And then?"}])  # the first instructions are not carried over
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.output_text == chat.choices[0].message.content
    # a chain: the third turn sees both earlier ones
    third = create(client, input="Why?", previous_response_id=second.id, max_output_tokens=2)
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens
    server.assert_idle()


def test_a_function_call_answered_by_previous_response_id(client, server):
    call = create(client, tools=[TIME], tool_choice={"type": "function", "name": "get_time"})
    (item,) = call.output
    result = create(client, previous_response_id=call.id, tools=[TIME], tool_choice="none", max_output_tokens=4,
                    input=[{"type": "function_call_output", "call_id": item.call_id, "output": "noon"}])
    assert result.output[0].type == "message" and result.usage.input_tokens > call.usage.input_tokens
    server.assert_idle()


def test_streamed_responses_are_stored_and_store_false_keeps_nothing(client, server):
    events = list(client.responses.create(model=MODEL_NAME, input="Paged attention", max_output_tokens=4,
                                          temperature=0, stream=True))
    assert events[0].response.store is True
    assert client.responses.retrieve(events[-1].response.id).model_dump() == events[-1].response.model_dump()
    unstored = create(client, max_output_tokens=2, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.BadRequestError) as err:
        create(client, previous_response_id=unstored.id, max_output_tokens=2)
    assert err.value.body["param"] == "previous_response_id" and "not found" in err.value.body["message"]
    server.assert_idle()


def test_delete_and_the_store_size(client, server, monkeypatch):
    kept = create(client, max_output_tokens=2)
    client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(kept.id)
    monkeypatch.setattr(server.state, "responses", ResponseStore(2))
    ids = [create(client, max_output_tokens=1).id for _ in range(3)]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[0])  # the oldest went
    assert [client.responses.retrieve(rid).id for rid in ids[1:]] == ids[1:]
    monkeypatch.setattr(server.state, "responses", ResponseStore(0))
    assert create(client, max_output_tokens=1).store is False


def test_input_items_list_the_conversation_a_response_answered(client, server):
    first = create(client, input="Paged attention", max_output_tokens=3)
    second = create(client, previous_response_id=first.id, max_output_tokens=3, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "And then?"}]},
        {"role": "assistant", "content": "It pages."}, {"role": "user", "content": "Why?"}])
    listed = client.responses.input_items.list(second.id, order="asc")
    from pydantic import TypeAdapter
    from openai.types.responses import ResponseItem
    raw = httpx.get(f"{str(client.base_url)}responses/{second.id}/input_items", params={"order": "asc"}).json()
    assert [TypeAdapter(ResponseItem).validate_python(item).id for item in raw["data"]] == [i.id for i in listed.data]
    kinds = [(item.type, getattr(item, "role", None)) for item in listed.data]
    assert kinds == [("message", "user"), ("message", "assistant"), ("message", "user"), ("message", "assistant"),
                     ("message", "user")]
    assert listed.data[0].content[0].text == "Paged attention" and listed.data[1].id == first.output[0].id
    assert len({item.id for item in listed.data}) == 5
    newest = client.responses.input_items.list(second.id, limit=2)  # desc by default, in pages
    assert [item.id for item in newest.data] == [item.id for item in listed.data[::-1][:2]] and newest.has_more
    rest = client.responses.input_items.list(second.id, after=newest.data[-1].id)
    assert [item.id for item in rest.data] == [item.id for item in listed.data[::-1][2:]]
    assert client.responses.input_items.list(first.id).data[0].content[0].text == "Paged attention"
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_nope")
    server.assert_idle()
