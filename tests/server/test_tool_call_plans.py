"""Tool-call plans on their own (server/tool_calls.py): a named function with no answer text
makes no call (a reasoning model cut before </think>), its stream opens the call with the
first answer text, and parallel_tool_calls false keeps the first parsed call, as vLLM does."""
from __future__ import annotations

from tessera.server.tool_calls import ToolCallStream, plan_tool_calls, tool_calls

TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
NAMED = {"type": "function", "function": {"name": "weather"}}


def test_a_named_function_without_answer_text_makes_no_call():
    plan = plan_tool_calls(TOOLS, NAMED, None)
    assert tool_calls(plan, "") == (None, None)
    content, calls = tool_calls(plan, '{"city": "Paris"}')
    assert content is None and calls[0]["function"] == {"name": "weather", "arguments": '{"city": "Paris"}'}


def test_a_named_functions_stream_opens_with_its_first_text():
    stream = ToolCallStream(plan_tool_calls(TOOLS, NAMED, None))
    assert stream.delta("", None) == ({}, None)  # reasoning so far: no empty call deltas
    opened, _ = stream.delta('{"city"', None)
    call = opened["tool_calls"][0]
    assert call["id"] and call["function"] == {"name": "weather", "arguments": '{"city"'}
    more, _ = stream.delta(': "Paris"}', None)
    assert more["tool_calls"][0] == {"index": 0, "function": {"arguments": ': "Paris"}'}}
    assert stream.delta("", "stop") == ({}, "stop")
    cut = ToolCallStream(plan_tool_calls(TOOLS, NAMED, None))
    assert cut.delta("", "length") == ({}, "length")  # never opened: no call at all


def test_parallel_tool_calls_false_keeps_the_first_parsed_call():
    text = '<tool_call>{"name": "weather", "arguments": {"city": "A"}}</tool_call>' \
           '<tool_call>{"name": "weather", "arguments": {"city": "B"}}</tool_call>'
    both = tool_calls(plan_tool_calls(TOOLS, "auto", None, parser="hermes"), text)[1]
    first = tool_calls(plan_tool_calls(TOOLS, "auto", False, parser="hermes"), text)[1]
    assert len(both) == 2 and len(first) == 1 and '"A"' in first[0]["function"]["arguments"]
