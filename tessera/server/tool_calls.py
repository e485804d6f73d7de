"""OpenAI tool calls for the chat route. A structured-output constraint makes them work
with any model: `tool_choice` naming a function constrains the output to that function's
parameters schema (the output *is* the arguments); `"required"` constrains it to a JSON
array of `{"name", "parameters"}` objects, one per call. `"none"` generates text. `"auto"`
(OpenAI's default when tools are given) lets the model choose, so its own tool-call syntax
must be parsed: the server's `--tool-call-parser` names it (tool_parsers/: `hermes`,
`llama3_json`, `mistral`, `pythonic`, `openai`, `deepseek_v3`, `qwen3_coder`), and a stream sends each call as it
is written;
without one, "auto" is refused, as vLLM refuses it. The tools are passed to the chat
template in every case, so the model sees them as it was trained to.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from tessera.server.errors import ValidationFailed
from tessera.server.tool_parsers import PARSERS, ToolCallParser, json_text, loads

NO_PARAMETERS = {"type": "object", "properties": {}}




@dataclass
class ToolPlan:
    """How the output becomes tool calls: one named function's arguments (`function`), a
    constrained list ("required"), or the model's own syntax read by `parser` ("auto")."""

    function: str | None = None
    constraint: dict[str, Any] | None = None  # structured_outputs
    parser: str | None = None
    single: bool = False  # parallel_tool_calls false: the first parsed call only ("auto")
    functions: dict[str, dict[str, Any]] | None = None  # the tools' parameter schemas ("auto")

    @cached_property
    def syntax(self) -> ToolCallParser:
        """The parser of the model's calls ("auto"), bound to the request's tools where it
        reads them (qwen3_coder types its values by their schemas)."""
        parser = PARSERS[self.parser]
        bind = getattr(parser, "for_tools", None)
        return bind(self.functions or {}) if bind is not None else parser

    @property
    def finish_reason(self) -> str:
        # vLLM's: a named function is a forced choice ("stop"); otherwise calls end it
        return "stop" if self.function is not None else "tool_calls"


def _functions(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    functions = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type") != "function" or not isinstance(function, dict):
            raise ValidationFailed(f"`tools[{i}]` must be {{\"type\": \"function\", \"function\": {{...}}}}",
                                   param="tools")
        name, parameters = function.get("name"), function.get("parameters", NO_PARAMETERS)
        if not isinstance(name, str) or not name:
            raise ValidationFailed(f"`tools[{i}].function.name` must be a non-empty string", param="tools")
        if not isinstance(parameters, dict):
            raise ValidationFailed(f"`tools[{i}].function.parameters` must be a JSON schema object",
                                   param="tools")
        # arguments are a JSON object (OpenAI); an open schema such as {} would allow any value
        if name in functions:
            raise ValidationFailed(f"`tools` define the function {name!r} twice", param="tools")
        functions[name] = parameters if "type" in parameters else {**parameters, "type": "object"}
    return functions


def plan_tool_calls(tools: list[dict[str, Any]] | None, tool_choice: Any,
                    parallel_tool_calls: bool | None, parser: str | None = None) -> ToolPlan | None:
    """The constraint for this request's tool choice, or None for plain text."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise ValidationFailed("`tool_choice` needs `tools`", param="tool_choice")
        return None
    functions = _functions(tools)
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return None
    if choice == "auto" and parser is not None:
        return ToolPlan(parser=parser, single=parallel_tool_calls is False, functions=functions)
    if choice == "auto":
        raise ValidationFailed("`tool_choice` \"auto\" needs a parser of the model's tool-call syntax, "
                               "and this server was started without --tool-call-parser; use \"required\" or "
                               "name a function",
                               param="tool_choice")
    if choice == "required":
        schemas, definitions = _hoist_definitions(functions)
        calls = [{"type": "object", "properties": {"name": {"const": name}, "parameters": schema},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for name, schema in schemas.items()]
        array = {**definitions, "type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if parallel_tool_calls is False:
            array["maxItems"] = 1
        return ToolPlan(constraint={"json": array})
    # OpenAI's {"type": "function", "function": {"name"}}; TGI's clients leave out "type"
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not (isinstance(name, str) and choice.get("type", "function") == "function"):
        raise ValidationFailed("`tool_choice` must be \"none\", \"auto\", \"required\" or "
                               "{\"type\": \"function\", \"function\": {\"name\": ...}}", param="tool_choice")
    if name not in functions:
        raise ValidationFailed(f"`tool_choice` names {name!r}, which is not among `tools`", param="tool_choice")
    return ToolPlan(function=name, constraint={"json": functions[name]})


def _hoist_definitions(functions: dict[str, dict[str, Any]]) -> tuple[dict[str, dict[str, Any]], dict]:
    """Each function's `$defs` / `definitions`, moved to the root of the combined schema:
    references such as "#/$defs/Address" resolve from the root."""
    schemas, definitions = {}, {}
    for name, schema in functions.items():
        schema = dict(schema)
        for key in ("$defs", "definitions"):
            found = schema.pop(key, None) or {}
            if not isinstance(found, dict):
                raise ValidationFailed(f"`{key}` of function {name!r} must be an object", param="tools")
            merged = definitions.setdefault(key, {})
            for ref, value in found.items():
                if merged.get(ref, value) != value:
                    raise ValidationFailed(f"functions define `{key}/{ref}` differently; with "
                                           "tool_choice \"required\" they share one schema", param="tools")
                merged[ref] = value
        schemas[name] = schema
    return schemas, {key: value for key, value in definitions.items() if value}


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def tool_calls(plan: ToolPlan, text: str) -> tuple[str | None, list[dict[str, Any]] | None]:
    """A finished output as (content, calls). The calls are None when the output makes
    none, or not a complete list of them (cut by max_tokens or a stop string): then all
    of it is content."""
    if plan.function is not None:
        if not text:  # nothing after the reasoning (cut, or ended): no call, not one with "" arguments
            return None, None
        calls = [(plan.function, text)]
        content = None
    else:
        content, found = plan.syntax.parse(text) if plan.parser is not None else (None, _parse_list(text))
        if not found:
            return text, None
        calls = found[:1] if plan.single else found  # vLLM keeps the first when parallel calls are off
    return content, [{"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}
                     for name, arguments in calls]


def _parse_list(text: str) -> list[tuple[str, str]] | None:
    try:
        items = loads(text)
    except (ValueError, RecursionError):  # JSONDecodeError is a ValueError
        return None
    return [(item["name"], json_text(item["parameters"])) for item in items]


class ToolCallStream:
    """A streamed choice's deltas: a named function's arguments as they are generated; a
    "required" list of calls once it is complete (a partial list is not a call yet); under
    a parser ("auto"), the content before the calls as it comes, then each call as the
    model writes it: its id and name once the name is whole, its arguments (an object, as
    written) piece by piece; what a parser cannot follow comes whole at the end."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.text = ""
        self.sent = 0  # characters of text already sent as content ("auto")
        self.call_id: str | None = None
        self.calls: list[tuple[str, int]] = []  # calls streamed so far ("auto"): (id, argument characters sent)

    def delta(self, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
        """The delta for `text` and the finish reason to report (None while running)."""
        self.text += text
        plan = self.plan
        if plan.function is not None:
            finish = plan.finish_reason if finish == "stop" else finish
            if not text:  # (a reasoning model's thinking so far): the call opens with its first text
                return {}, finish
            call: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
            if self.call_id is None:
                self.call_id = new_call_id()
                call = {"index": 0, "id": self.call_id, "type": "function",
                        "function": {"name": plan.function, "arguments": text}}
            return {"tool_calls": [call]}, finish
        if plan.parser is not None and finish is None:
            parser = plan.syntax
            end = parser.content_end(self.text)
            rest = self.text[self.sent:end] if end > self.sent else ""
            self.sent = max(self.sent, end)
            delta: dict[str, Any] = {"content": rest} if rest else {}
            calls = self._grown(parser.partial(self.text))
            if calls:
                delta["tool_calls"] = calls
            return delta, None
        if finish is None:
            return {}, None
        content, made = tool_calls(plan, self.text)
        if made is None:
            if self.calls:  # calls already streamed, then the model broke one off (or was cut):
                # they stand as sent, with what of them is valid in this last piece
                grown = self._grown(plan.syntax.partial(self.text))
                return ({"tool_calls": grown} if grown else {}), plan.finish_reason if finish == "stop" else finish
            rest = self.text[self.sent:]  # no calls: whatever content is not out yet
            return ({"content": rest} if rest else {}), finish
        delta = {"tool_calls": self._rest(made)} if made else {}
        rest = (content or "")[self.sent:]
        if rest:
            delta["content"] = rest
        return delta, plan.finish_reason if finish == "stop" else finish

    def _grown(self, partials: list) -> list[dict[str, Any]]:
        """The calls' new pieces: a call opens (id, name) once its name is whole, and
        those after it wait for it, so the indexes stay in order (the first alone when
        parallel calls are off)."""
        out = []
        for i, partial in enumerate(partials[:1] if self.plan.single else partials):
            if i == len(self.calls):
                if partial.name is None:
                    break
                self.calls.append((new_call_id(), 0))
                out.append({"index": i, "id": self.calls[i][0], "type": "function",
                            "function": {"name": partial.name, "arguments": ""}})
            call_id, sent = self.calls[i]
            if len(partial.arguments) > sent:
                out.append({"index": i, "function": {"arguments": partial.arguments[sent:]}})
                self.calls[i] = (call_id, len(partial.arguments))
            if not (partial.done and partial.arguments):
                # still being written, or arguments that come whole at the end (a JSON
                # string, none): the next call waits, so that each call's pieces come
                # before the next one opens (an item or block closes when the next opens)
                break
        return out

    def _rest(self, made: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The finished calls' deltas: what the stream has not sent of each."""
        out = []
        for i, call in enumerate(made):
            if i >= len(self.calls):
                out.append({"index": i, **call})
                continue
            call_id, sent = self.calls[i]
            arguments = call["function"]["arguments"]
            if len(arguments) > sent:
                out.append({"index": i, "function": {"arguments": arguments[sent:]}})
        return out
