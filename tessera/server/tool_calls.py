"""OpenAI tool calls for the chat route. A structured-output constraint makes them work
with any model: `tool_choice` naming a function constrains the output to that function's
parameters schema (the output *is* the arguments); `"required"` constrains it to a JSON
array of `{"name", "parameters"}` objects, one per call. `"none"` generates text. `"auto"`
(OpenAI's default when tools are given) lets the model choose, so its own tool-call syntax
must be parsed: the server's `--tool-call-parser` names it (tool_parsers.py: `hermes`,
`llama3_json`); without one, "auto" is refused, as vLLM refuses it. The tools are passed to the chat
template in every case, so the model sees them as it was trained to.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from tessera.server.errors import ValidationFailed
from tessera.server.tool_parsers import PARSERS, json_text, loads

NO_PARAMETERS = {"type": "object", "properties": {}}




@dataclass
class ToolPlan:
    """How the output becomes tool calls: one named function's arguments (`function`), a
    constrained list ("required"), or the model's own syntax read by `parser` ("auto")."""

    function: str | None = None
    constraint: dict[str, Any] | None = None  # structured_outputs
    parser: str | None = None
    single: bool = False  # parallel_tool_calls false: the first parsed call only ("auto")

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
        return ToolPlan(parser=parser, single=parallel_tool_calls is False)
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
        content, found = PARSERS[plan.parser].parse(text) if plan.parser is not None else (None, _parse_list(text))
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
    "required" list of calls once it is complete (a partial list is not a call yet)."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.text = ""
        self.sent = 0  # characters of text already sent as content ("auto")
        self.call_id: str | None = None

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
            end = PARSERS[plan.parser].content_end(self.text)
            rest = self.text[self.sent:end] if end > self.sent else ""
            self.sent = max(self.sent, end)
            return ({"content": rest} if rest else {}), None
        if finish is None:
            return {}, None
        content, made = tool_calls(plan, self.text)
        if made is None:  # no calls: whatever content is not out yet
            rest = self.text[self.sent:]
            return ({"content": rest} if rest else {}), finish
        delta: dict[str, Any] = {"tool_calls": [{"index": i, **call} for i, call in enumerate(made)]}
        rest = (content or "")[self.sent:]
        if rest:
            delta["content"] = rest
        return delta, plan.finish_reason if finish == "stop" else finish
