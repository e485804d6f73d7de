"""OpenAI tool calls through the openai package over real HTTP: a named function and
"required" constrain the output, so even the tiny random model makes valid calls (streamed
and not); "none" writes text; "auto" and malformed tools are clear 400s."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from tessera.server.tool_calls import ToolCallStream, plan_tool_calls, tool_calls
from tessera.server.tool_parsers import PARSERS
from tests.server.conftest import CHAT, MODEL_NAME
from tests.server.test_http_wire import openai_error

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                                    "metric": {"type": "boolean"}},
                   "required": ["city", "metric"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}


def weather_args_valid(arguments: str) -> bool:
    args = json.loads(arguments)
    return set(args) == {"city", "metric"} and args["city"] in ("Paris", "Oslo") and isinstance(args["metric"], bool)


def call_valid(call) -> bool:
    if call.function.name == "get_weather":
        return weather_args_valid(call.function.arguments)
    return call.function.name == "get_time" and json.loads(call.function.arguments)["zone"] in ("UTC", "CET")


def chat(client, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 80)
    return client.chat.completions.create(model=MODEL_NAME, messages=CHAT, **kw)


def test_named_function_stream_and_not(client, server):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    full = chat(client, tools=[WEATHER, TIME], tool_choice=choice).choices[0]
    assert full.message.content is None and full.finish_reason == "stop"
    (call,) = full.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    assert weather_args_valid(call.function.arguments), call.function.arguments
    arguments, ids, names = "", set(), set()
    for chunk in chat(client, tools=[WEATHER, TIME], tool_choice=choice, stream=True):
        for delta_call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            assert delta_call.index == 0
            arguments += delta_call.function.arguments or ""
            ids.add(delta_call.id) if delta_call.id else None
            names.add(delta_call.function.name) if delta_call.function.name else None
    assert arguments == call.function.arguments and len(ids) == 1 and names == {"get_weather"}
    server.assert_idle()


@pytest.mark.parametrize("parallel", [None, False])
def test_required_makes_valid_calls_stream_and_not(client, parallel):
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    full = chat(client, tools=[WEATHER, TIME], tool_choice="required", temperature=0.9, seed=11, **extra).choices[0]
    assert full.finish_reason == "tool_calls" and full.message.content is None
    calls = full.message.tool_calls
    assert calls and all(call_valid(c) for c in calls)
    if parallel is False:
        assert len(calls) == 1
    streamed = {}
    for chunk in chat(client, tools=[WEATHER, TIME], tool_choice="required", temperature=0.9, seed=11,
                      stream=True, **extra):
        for c in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            streamed[c.index] = (c.function.name, c.function.arguments)
    assert list(streamed.values()) == [(c.function.name, c.function.arguments) for c in calls]


def test_tool_choice_none_writes_text_and_tool_messages_render(client):
    messages = CHAT + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                                                               "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00 UTC"}]
    out = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=5, temperature=0,
                                         tools=[TIME], tool_choice="none").choices[0]
    assert out.message.tool_calls is None and isinstance(out.message.content, str)


@pytest.mark.parametrize("body,message", [
    ({"tools": [WEATHER]}, "without --tool-call-parser"),
    ({"tools": [WEATHER], "tool_choice": "auto"}, "without --tool-call-parser"),
    ({"tool_choice": "required"}, "`tool_choice` needs `tools`"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among `tools`"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "`tool_choice` must be"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}], "tool_choice": "required"},
     "`tools[0].function.name`"),
    ({"tools": [{"type": "retrieval"}], "tool_choice": "required"}, "`tools[0]` must be"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "define the function 'get_weather' twice"),
    ({"stream_options": {"include_usage": True}}, "only for `stream: true`"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "one output constraint"),
])
def test_tool_errors_are_400(url, server, body, message):
    r = httpx.post(url + "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 5, **body})
    err = openai_error(r, 400)
    assert message in err["message"]
    server.assert_idle()


# --- "auto" with the hermes parser ----------------------------------------------------------

HERMES_OUTPUT = ('Let me check. <tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>\n'
                 '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "metric": true}}</tool_call>')
HERMES_CALLS = [("get_time", '{"zone": "UTC"}'), ("get_weather", '{"city": "Oslo", "metric": true}')]


LLAMA3_OUTPUT = ('{"name": "get_time", "parameters": {"zone": "UTC"}}; '
                 '{"name": "get_weather", "parameters": {"city": "Oslo", "metric": true}}')


def stream_pieces(text: str, size: int, parser: str = "hermes", deltas: list | None = None) -> tuple[str, list, str]:
    """The content, calls and finish a client puts together from the deltas of `text` sent
    `size` characters at a time (each call's name from its first delta, its arguments
    concatenated, as the openai SDK does); `deltas` collects the tool-call deltas."""
    plan = plan_tool_calls([WEATHER, TIME], "auto", None, parser)
    stream, content, calls, finish = ToolCallStream(plan), "", {}, None
    pieces = [text[i:i + size] for i in range(0, len(text), size)]
    for i, piece in enumerate(pieces):
        delta, finish = stream.delta(piece, "stop" if i == len(pieces) - 1 else None)
        content += delta.get("content", "")
        for c in delta.get("tool_calls", []):
            if c["index"] not in calls:
                assert c["index"] == len(calls) and c["id"] and c["function"]["name"]
                calls[c["index"]] = (c["function"]["name"], "")
            name, arguments = calls[c["index"]]
            calls[c["index"]] = (name, arguments + c["function"].get("arguments", ""))
            if deltas is not None:
                deltas.append(c)
    return content, list(calls.values()), finish


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_hermes_stream_pieces_give_the_calls_and_the_content_before_them(size):
    deltas = []
    assert stream_pieces(HERMES_OUTPUT, size, deltas=deltas) == ("Let me check.", HERMES_CALLS, "tool_calls")
    if size < 1000:  # streamed as written: each call opens with its name, then its arguments in pieces
        assert len([d for d in deltas if d["index"] == 0]) > 3 and deltas[0]["function"] == {
            "name": "get_time", "arguments": ""}
    plain = "No tools needed <tool but not a tag"
    assert stream_pieces(plain, size) == (plain, [], "stop")
    broken = 'Hm <tool_call>{"name": "get_time", "arguments": {</tool_call>'
    # malformed: whole, all of it is content; streamed, the call's valid beginning was sent
    # before the model broke it off, and stands
    content, calls, finish = stream_pieces(broken, size)
    if size == 1000:
        assert (content, calls, finish) == (broken, [], "stop")
    else:  # what was valid when it came: the name, and "{" unless "</" came with it
        assert (content, [name for name, _ in calls], finish) == ("Hm", ["get_time"], "tool_calls")
        assert "{".startswith(calls[0][1])
    unnamed = 'Hm <tool_call>{"nam</tool_call>'  # a call whose name never came is never sent
    assert stream_pieces(unnamed, size) == (unnamed, [], "stop")


@pytest.mark.parametrize("size", [1, 5, 1000])
def test_llama3_json_stream_pieces(size):
    assert stream_pieces(LLAMA3_OUTPUT, size, "llama3_json") == ("", HERMES_CALLS, "tool_calls")
    tagged = "<|python_tag|>" + LLAMA3_OUTPUT.split(";")[0]
    assert stream_pieces(tagged, size, "llama3_json") == ("", HERMES_CALLS[:1], "tool_calls")
    for text in ("The weather is fine {not a call}", '{"no_name": 1}'):
        assert stream_pieces(text, size, "llama3_json") == (text, [], "stop")
    cut = '{"name": "get_time", "parameters": {"zone"'  # (max_tokens): whole, content; streamed, begun
    assert stream_pieces(cut, size, "llama3_json") == ((cut, [], "stop") if size == 1000 else
                                                      ("", [("get_time", '{"zone"')], "tool_calls"))


def test_hermes_parse_of_a_finished_output():
    plan = plan_tool_calls([WEATHER, TIME], "auto", None, "hermes")
    content, calls = tool_calls(plan, HERMES_OUTPUT)
    assert content == "Let me check." and [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == HERMES_CALLS
    assert tool_calls(plan, "just text") == ("just text", None)
    assert tool_calls(plan, "<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", None)


def streamed_calls(chunks) -> tuple[str, list[tuple[str, str]]]:
    """A streamed choice's content and calls as the openai SDK puts them together: a call's
    name from its first delta, its arguments concatenated."""
    content, calls = "", {}
    for chunk in chunks:
        if chunk.choices:
            content += chunk.choices[0].delta.content or ""
            for c in chunk.choices[0].delta.tool_calls or []:
                name, arguments = calls.get(c.index, (c.function.name, ""))
                calls[c.index] = (name, arguments + (c.function.arguments or ""))
    return content, list(calls.values())


def test_auto_with_the_hermes_parser_over_http(client, server, monkeypatch):
    monkeypatch.setattr(server.state, "tool_call_parser", "hermes")
    # the tiny model is made to write a hermes call by a structured output
    forced = {"guided_choice": [HERMES_OUTPUT]}
    full = chat(client, tools=[WEATHER, TIME], extra_body=forced, max_tokens=400).choices[0]
    assert full.finish_reason == "tool_calls" and full.message.content == "Let me check."
    assert [(c.function.name, c.function.arguments) for c in full.message.tool_calls] == HERMES_CALLS
    chunks = list(chat(client, tools=[WEATHER, TIME], tool_choice="auto", extra_body=forced, stream=True,
                       max_tokens=400))
    assert streamed_calls(chunks) == ("Let me check.", HERMES_CALLS)
    assert sum(bool(c.choices and c.choices[0].delta.tool_calls) for c in chunks) > 4  # as the model writes them
    text = chat(client, tools=[WEATHER], extra_body={"guided_choice": ["plain answer"]}).choices[0]
    assert text.message.content == "plain answer" and text.message.tool_calls is None and text.finish_reason == "stop"


def test_huggingface_hub_client_named_tool_choice_without_type(url):
    """TGI's clients send tool_choice as {"function": {"name"}} (no "type")."""
    from huggingface_hub import InferenceClient

    hub = InferenceClient(base_url=url, timeout=30)
    out = hub.chat_completion(CHAT, model=MODEL_NAME, max_tokens=80, temperature=0, tools=[WEATHER],
                              tool_choice={"function": {"name": "get_weather"}})
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and weather_args_valid(call.function.arguments)
    required = hub.chat_completion(CHAT, model=MODEL_NAME, max_tokens=80, temperature=0, tools=[WEATHER, TIME],
                                   tool_choice="required")
    assert required.choices[0].message.tool_calls and required.choices[0].finish_reason == "tool_calls"


def test_parsers_keep_numbers_as_written_and_take_an_unclosed_complete_last_block():
    hermes, llama3 = PARSERS["hermes"], PARSERS["llama3_json"]
    # the arguments as written (what a stream sent): 1e999 as a float is Infinity, which is
    # not JSON; digits beyond a double's are kept, spacing too
    assert hermes.parse('<tool_call>{"name": "f", "arguments": {"x": 1e999, "y": 0.12345678901234567890123}}'
                        '</tool_call>') == (None, [("f", '{"x": 1e999, "y": 0.12345678901234567890123}')])
    assert llama3.parse('{"name": "f", "parameters": {"x":1e999}}') == (None, [("f", '{"x":1e999}')])
    assert hermes.parse('<tool_call>{"name": "g", "arguments": {}}') == (None, [("g", "{}")])
    cut = 'A<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g", "argu'
    assert hermes.parse(cut) == (cut, None)  # a call cut short: all content, as in vLLM
    deep = '<tool_call>{"name": "f", "arguments": ' + "[" * 100_000 + "]" * 100_000 + "}</tool_call>"
    assert hermes.parse(deep) == (deep, None)  # too deep for json: content, not an error
    alone_cut = '<tool_call>{"name": "g", "arguments": {'
    assert hermes.parse(alone_cut) == (alone_cut, None)


def test_required_with_definitions_in_function_schemas(client):
    """Function schemas with $defs are combined under one root for "required", where their
    #/$defs/... references resolve."""
    address = {"type": "object", "properties": {"zip": {"enum": ["111", "222"]}}, "required": ["zip"],
               "additionalProperties": False}
    ship = {"type": "function", "function": {"name": "ship", "parameters": {
        "type": "object", "$defs": {"Address": address}, "properties": {"to": {"$ref": "#/$defs/Address"}},
        "required": ["to"], "additionalProperties": False}}}
    out = chat(client, tools=[ship, TIME], tool_choice="required", parallel_tool_calls=False, temperature=0.9,
               seed=3).choices[0]
    (call,) = out.message.tool_calls
    args = json.loads(call.function.arguments)
    assert (call.function.name == "ship" and args["to"]["zip"] in ("111", "222")) or call_valid(call)
    clash = {"type": "function", "function": {"name": "other", "parameters": {
        "type": "object", "$defs": {"Address": {"type": "string"}}, "properties": {}}}}
    with pytest.raises(openai.BadRequestError, match="differently"):
        chat(client, tools=[ship, clash], tool_choice="required")


def test_an_open_parameters_schema_still_gives_an_object(client):
    """OpenAI's arguments are a JSON object; "parameters": {} alone would allow any value."""
    anything = {"type": "function", "function": {"name": "anything", "parameters": {}}}
    for seed in range(4):
        out = chat(client, tools=[anything], tool_choice={"type": "function", "function": {"name": "anything"}},
                   temperature=1.0, seed=seed, max_tokens=60).choices[0]
        if out.finish_reason == "stop":
            assert isinstance(json.loads(out.message.tool_calls[0].function.arguments), dict)
        else:
            assert out.message.tool_calls[0].function.arguments.startswith("{")


MISTRAL_OUTPUTS = [
    'Let me check.[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}}, '
    '{"name": "get_weather", "arguments": {"city": "Oslo", "metric": true}}]',
    'Let me check.[TOOL_CALLS]get_time[ARGS]{"zone": "UTC"}[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo", "metric": true}',
    'Let me check. [TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{"zone": "UTC"}'
    '[TOOL_CALLS]get_weather[CALL_ID]f5g6h7i8j[ARGS]{"city": "Oslo", "metric": true}',
]
PYTHONIC_OUTPUT = '[get_time(zone="UTC"), get_weather(city="Oslo", metric=True)]'


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_mistral_stream_pieces_both_syntaxes(size):
    for text in MISTRAL_OUTPUTS:
        assert stream_pieces(text, size, "mistral") == ("Let me check.", HERMES_CALLS, "tool_calls")
    for text in ("No tools [TOOL but not a tag", '[TOOL_CALLS][{"arguments": {}}]', "[TOOL_CALLS]"):
        assert stream_pieces(text, size, "mistral") == (text, [], "stop")
    for text in ('A[TOOL_CALLS][{"name": "get_time", "arguments": {', "A[TOOL_CALLS]get_time[ARGS]{not json}"):
        # cut or broken: whole, all content; streamed, the valid beginning of the call stands
        assert stream_pieces(text, size, "mistral") == ((text, [], "stop") if size == 1000 else
                                                       ("A", [("get_time", "{")], "tool_calls"))


@pytest.mark.parametrize("size", [1, 6, 1000])
def test_pythonic_stream_pieces(size):
    assert stream_pieces(PYTHONIC_OUTPUT, size, "pythonic") == ("", HERMES_CALLS, "tool_calls")
    wrapped = "<|python_start|>" + PYTHONIC_OUTPUT + "<|python_end|>"
    assert stream_pieces(wrapped, size, "pythonic") == ("", HERMES_CALLS, "tool_calls")
    for text in ("The answer is [1, 2]", "[get_time(zone=", '[get_time("UTC")]', "[]",
                 '[get_time(zone=__import__("os").getcwd())]', "[get_time(**{'zone': 'UTC'})]",
                 "[get_time(zone=1+2)]"):
        assert stream_pieces(text, size, "pythonic") == (text, [], "stop")


DEEPSEEK_OUTPUTS = [  # V3 / R1 (a json fence per call), then V3.1 on
    'Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{"zone": "UTC"}'
    '\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n'
    '{"city": "Oslo", "metric": true}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    'Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"zone": "UTC"}<｜tool▁call▁end｜>'
    '<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Oslo", "metric": true}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
]


@pytest.mark.parametrize("size", [1, 5, 1000])
@pytest.mark.parametrize("parser", ["deepseek_v3", "deepseek_v31"])
def test_deepseek_stream_pieces_both_syntaxes(size, parser):
    for text in DEEPSEEK_OUTPUTS:
        assert stream_pieces(text, size, parser) == ("Let me check.", HERMES_CALLS, "tool_calls")
    assert stream_pieces("No calls <｜tool▁calls", size, parser) == ("No calls <｜tool▁calls", [], "stop")
    not_object = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>[1]"
    # arguments that are no object: whole, all content; streamed, the call opened by name stands
    assert stream_pieces(not_object, size, parser) == ((not_object, [], "stop") if size == 1000 else
                                                       ("", [("get_time", "")], "tool_calls"))
    cut = "A<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{\"zone\": "
    # cut mid-arguments: whole, all content; streamed, the valid beginning of the call stands
    assert stream_pieces(cut, size, parser) == ((cut, [], "stop") if size == 1000 else
                                                ("A", [("get_time", '{"zone": ')], "tool_calls"))


QWEN3_XML_OUTPUT = ("Let me check.\n<tool_call>\n<function=get_time>\n<parameter=zone>\nUTC\n</parameter>\n"
                    "</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n"
                    "</parameter>\n<parameter=metric>\ntrue\n</parameter>\n</function>\n</tool_call>")


@pytest.mark.parametrize("size", [1, 4, 1000])
@pytest.mark.parametrize("parser", ["qwen3_coder", "qwen3_xml"])
def test_qwen3_xml_stream_pieces(size, parser):
    """Qwen3-Coder's and Qwen3.5's XML calls: values typed by the tools' schemas (metric is
    a boolean, city untyped: a string), each parameter sent once closed."""
    deltas = []
    assert stream_pieces(QWEN3_XML_OUTPUT, size, parser, deltas) == ("Let me check.", HERMES_CALLS, "tool_calls")
    if size == 1:  # the weather call's arguments came in three final pieces
        pieces = [d["function"].get("arguments") for d in deltas if d["index"] == 1]
        assert [p for p in pieces if p] == ['{"city": "Oslo"', ', "metric": true', "}"]
    unwrapped = "<function=get_time>\n<parameter=zone>\nCET\n</parameter>\n</function>"
    assert stream_pieces(unwrapped, size, parser) == ("", [("get_time", '{"zone": "CET"}')], "tool_calls")
    ended = "<tool_call>\n<function=get_time>\n<parameter=zone>\nUTC\n</parameter>\n"  # ended before </function>
    assert stream_pieces(ended, size, parser) == ("", [("get_time", '{"zone": "UTC"}')], "tool_calls")
    cut = "A <tool_call>\n<function=get_time>\n<parameter=zone>\nUT"  # cut inside a value
    assert stream_pieces(cut, size, parser) == ((cut, [], "stop") if size == 1000 else ("A", [("get_time", "")], "tool_calls"))
    plain = "No <function but no call"
    assert stream_pieces(plain, size, parser) == (plain, [], "stop")


def test_qwen3_xml_values_follow_the_schema_types():
    from tessera.server.tool_parsers import PARSERS as ALL

    schema = {"type": "object", "properties": {
        "n": {"type": "integer"}, "x": {"type": "number"}, "ok": {"type": "boolean"}, "tags": {"type": "array"},
        "opts": {"type": "object"}, "id": {"type": "string"}, "maybe": {"type": ["integer", "null"]}}}
    parser = ALL["qwen3_coder"].for_tools({"f": schema})

    def args(body: str) -> dict:
        content, calls = parser.parse(f"<tool_call>\n<function=f>\n{body}</function>\n</tool_call>")
        assert content is None and len(calls) == 1
        return json.loads(calls[0][1])

    assert args("<parameter=n>\n42\n</parameter>\n<parameter=x>\n2.50\n</parameter>\n") == {"n": 42, "x": 2.5}
    assert args("<parameter=ok>\nTrue\n</parameter>\n<parameter=id>\n007\n</parameter>\n") == {"ok": True, "id": "007"}
    assert args("<parameter=tags>\n['a', 'b']\n</parameter>\n<parameter=opts>\n{\"k\": [1, 2]}\n</parameter>\n") == {
        "tags": ["a", "b"], "opts": {"k": [1, 2]}}
    assert args("<parameter=n>\n4.5\n</parameter>\n<parameter=maybe>\nnull\n</parameter>\n") == {"n": "4.5", "maybe": None}
    assert args("<parameter=free>\nline one\nline two\n</parameter>\n") == {"free": "line one\nline two"}
    # numbers keep their digits as written
    assert parser.parse("<function=f>\n<parameter=x>\n1e999\n</parameter>\n</function>")[1] == [("f", '{"x": 1e999}')]


def test_pythonic_values_become_json_with_their_digits():
    pythonic = PARSERS["pythonic"]
    content, calls = pythonic.parse(
        '[api.search(q="caf\\u00e9", n=10**0 if False else 3, x=1)]')
    assert (content, calls) == ('[api.search(q="caf\\u00e9", n=10**0 if False else 3, x=1)]', None)  # not literal
    assert pythonic.parse('[api.search(q="café", limit=-3, ratio=2.5e-3, big=123456789012345678901234567890, '
                          'tags=("a", None), opts={"deep": [True, False]}, neg=-0.0)]') == (None, [(
        "api.search", '{"q": "café", "limit": -3, "ratio": 0.0025, "big": 123456789012345678901234567890, '
                      '"tags": ["a", null], "opts": {"deep": [true, false]}, "neg": -0.0}')])
    assert pythonic.parse("[f(x=float('inf'))]")[1] is None
    assert pythonic.parse("[f(x=1e999)]")[1] is None  # infinite: no JSON number for it


GEMMA4_OUTPUT = ('Let me check.<|tool_call>call:get_time{zone:<|"|>UTC<|"|>}<tool_call|>'
                 '<|tool_call>call:get_weather{city:<|"|>Oslo<|"|>,metric:true}<tool_call|>')


def test_auto_with_the_mistral_pythonic_qwen3_xml_and_gemma4_parsers_over_http(client, server, monkeypatch):
    for parser, output, content in (("mistral", MISTRAL_OUTPUTS[1], "Let me check."),
                                    ("pythonic", PYTHONIC_OUTPUT, None),
                                    ("qwen3_coder", QWEN3_XML_OUTPUT, "Let me check."),
                                    ("gemma4", GEMMA4_OUTPUT, "Let me check.")):
        monkeypatch.setattr(server.state, "tool_call_parser", parser)
        forced = {"guided_choice": [output]}  # the tiny model is made to write the calls
        full = chat(client, tools=[WEATHER, TIME], extra_body=forced, max_tokens=400).choices[0]
        assert full.finish_reason == "tool_calls" and full.message.content == content
        assert [(c.function.name, c.function.arguments) for c in full.message.tool_calls] == HERMES_CALLS
        chunks = chat(client, tools=[WEATHER, TIME], extra_body=forced, stream=True, max_tokens=400)
        assert streamed_calls(chunks) == (content or "", HERMES_CALLS)


def test_parser_edge_cases_numbers_duplicates_and_arguments_that_are_not_objects():
    mistral, pythonic, hermes = PARSERS["mistral"], PARSERS["pythonic"], PARSERS["hermes"]
    # floats keep their source digits; ints beyond Python's 4300-digit str limit stay exact
    assert pythonic.parse("[f(x=0.12345678901234567890123, y=1_000.5)]") == (
        None, [("f", '{"x": 0.12345678901234567890123, "y": 1000.5}')])
    huge = "9" * 5000
    assert hermes.parse('<tool_call>{"name": "f", "arguments": {"n": ' + huge + "}}</tool_call>") == (
        None, [("f", '{"n": ' + huge + "}")])
    assert mistral.parse('[TOOL_CALLS][{"name": "f", "arguments": {"n": ' + huge + "}}]")[1] == [("f", '{"n": ' + huge + "}")]
    assert pythonic.parse("[f(x=1, x=2)]")[1] is None  # an argument given twice
    # the JSON list is read as JSON whatever its strings hold
    assert mistral.parse('[TOOL_CALLS][{"name": "f", "arguments": {"s": "a[ARGS]b"}}]') == (
        None, [("f", '{"s": "a[ARGS]b"}')])
    for text in ('[TOOL_CALLS]f[ARGS]"x"', "[TOOL_CALLS]f", "[TOOL_CALLS]f[ARGS][1]"):
        assert mistral.parse(text) == (text, None)  # arguments must be an object


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_each_calls_pieces_come_before_the_next_call_opens(size):
    """A call whose arguments cannot stream (a JSON string, none) comes whole at the end,
    and the calls after it wait: the Responses and Messages streams close a call's item
    when the next opens. A key given twice in a call is malformed (json reads the last,
    a stream would have gone by the first)."""
    text = ('<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}</tool_call>'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "metric": true}}</tool_call>'
            '<tool_call>{"name": "get_time"}</tool_call>')
    deltas = []
    content, calls, finish = stream_pieces(text, size, deltas=deltas)
    whole = tool_calls(plan_tool_calls([WEATHER, TIME], "auto", None, "hermes"), text)[1]
    assert calls == [(c["function"]["name"], c["function"]["arguments"]) for c in whole] == [
        ("get_time", '{"zone": "UTC"}'), ("get_weather", '{"city": "Oslo", "metric": true}'), ("get_time", "{}")]
    indexes = [d["index"] for d in deltas]
    assert indexes == sorted(indexes) and finish == "tool_calls"
    twice = '<tool_call>{"name": "get_time", "name": "get_weather", "arguments": {}}</tool_call>'
    assert PARSERS["hermes"].parse(twice) == (twice, None)
