"""OpenAI's Conversations API through the real `openai` client: a conversation's items are
kept on the server, a response naming it is the chat completion of those items and its
input, and the turn (input, then output) joins the conversation; items are added, listed
in pages, fetched and deleted; bad requests are refused with the parameter named."""
from __future__ import annotations

import openai
import pytest

from tests.server.conftest import MODEL_NAME
from tests.server.test_responses_tools import create

FIRST = [{"type": "message", "role": "user", "content": "Paged attention"},
         {"type": "message", "role": "assistant", "content": "stores the KV cache in blocks"}]


def test_a_response_continues_its_conversation(client, server):
    conv = client.conversations.create(items=FIRST, metadata={"topic": "kv"})
    assert conv.id.startswith("conv_") and conv.metadata == {"topic": "kv"}
    assert client.conversations.retrieve(conv.id).id == conv.id
    reply = create(client, input="And then?", conversation=conv.id, max_output_tokens=6)
    chat = client.chat.completions.create(model=MODEL_NAME, max_tokens=6, temperature=0, messages=[
        {"role": "user", "content": "Paged attention"}, {"role": "assistant", "content": "stores the KV cache in blocks"},
        {"role": "user", "content": "And then?"}])
    assert reply.output_text == chat.choices[0].message.content
    assert reply.usage.input_tokens == chat.usage.prompt_tokens and reply.conversation.id == conv.id
    items = client.conversations.items.list(conv.id, order="asc").data
    assert [i.type for i in items] == ["message"] * 4
    assert [i.role for i in items] == ["user", "assistant", "user", "assistant"]
    assert items[-1].content[0].text == reply.output_text and items[-1].id == reply.output[0].id
    # a streamed turn joins it too, and sees every earlier item
    stream = client.responses.create(model=MODEL_NAME, input="Why?", conversation={"id": conv.id},
                                     max_output_tokens=4, temperature=0, stream=True)
    done = [e for e in stream if e.type in ("response.completed", "response.incomplete")][0].response
    assert done.usage.input_tokens > reply.usage.input_tokens + reply.usage.output_tokens
    assert len(client.conversations.items.list(conv.id).data) == 6
    server.assert_idle()


def test_items_are_added_listed_fetched_and_deleted(client):
    conv = client.conversations.create()
    added = client.conversations.items.create(conv.id, items=[
        {"type": "message", "role": "user", "content": f"turn {i}"} for i in range(5)])
    ids = [item.id for item in added.data]
    assert len(set(ids)) == 5
    newest = client.conversations.items.list(conv.id, limit=2)  # newest first by default
    assert [i.id for i in newest.data] == ids[::-1][:2] and newest.has_more
    after = client.conversations.items.list(conv.id, order="asc", after=ids[1], limit=10)
    assert [i.id for i in after.data] == ids[2:] and not after.has_more
    assert client.conversations.items.retrieve(ids[3], conversation_id=conv.id).content[0].text == "turn 3"
    client.conversations.items.delete(ids[3], conversation_id=conv.id)
    assert ids[3] not in [i.id for i in client.conversations.items.list(conv.id).data]
    updated = client.conversations.update(conv.id, metadata={"k": "v"})
    assert updated.metadata == {"k": "v"}
    assert client.conversations.delete(conv.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(conv.id)
    with pytest.raises(openai.NotFoundError):
        create(client, conversation=conv.id)


@pytest.mark.parametrize("kwargs, param", [
    (dict(items=[{"type": "message", "role": "wizard", "content": "hi"}]), "items"),
    (dict(items=[{"type": "function_call", "call_id": "c1"}]), "items"),
    (dict(items=[{"type": "web_search_call"}]), "items"),
    (dict(items=[{"type": "message", "role": "user", "content": "x"}] * 21), "items"),
    (dict(metadata={"k": 1}), "metadata"),
])
def test_bad_conversations_are_refused(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.conversations.create(**kwargs)
    assert err.value.body["param"] == param


def test_a_conversation_and_a_previous_response_do_not_go_together(client):
    conv = client.conversations.create()
    first = create(client, max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as err:
        create(client, conversation=conv.id, previous_response_id=first.id)
    assert err.value.body["param"] == "conversation"
