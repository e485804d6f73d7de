"""OpenAI tool calls for the chat route, where a structured-output constraint makes them
work with any model: `tool_choice` naming a function constrains the output to that
function's parameters schema (the output *is* the arguments); `"required"` constrains it
to a JSON array of `{"name", "parameters"}` objects, one per call. `"none"` generates
text. `"auto"` (OpenAI's default when tools are given) needs a parser of the model's own
tool-call syntax, which this server does not have: it is refused with a clear error, as
vLLM refuses it without `--tool-call-parser`. The tools are passed to the chat template
either way, so the model sees them as it was trained to.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from tessera.server.errors import ValidationFailed

NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass
class ToolPlan:
    """How the output becomes tool calls: one named function's arguments, or a list."""

    function: str | None  # the named function; None: "required" (the output is a list)
    constraint: dict[str, Any]  # structured_outputs

    @property
    def finish_reason(self) -> str:
        # vLLM's: a named function is a forced choice ("stop"), "required" ends in calls
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
        functions[name] = parameters
    return functions


def plan_tool_calls(tools: list[dict[str, Any]] | None, tool_choice: Any,
                    parallel_tool_calls: bool | None) -> ToolPlan | None:
    """The constraint for this request's tool choice, or None for plain text."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise ValidationFailed("`tool_choice` needs `tools`", param="tool_choice")
        return None
    functions = _functions(tools)
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return None
    if choice == "auto":
        raise ValidationFailed("`tool_choice` \"auto\" needs a parser of the model's tool-call syntax, "
                               "which this server does not have; use \"required\" or name a function",
                               param="tool_choice")
    if choice == "required":
        calls = [{"type": "object", "properties": {"name": {"const": name}, "parameters": schema},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for name, schema in functions.items()]
        array = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if parallel_tool_calls is False:
            array["maxItems"] = 1
        return ToolPlan(None, {"json": array})
    name = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
    if not (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(name, str)):
        raise ValidationFailed("`tool_choice` must be \"none\", \"auto\", \"required\" or "
                               "{\"type\": \"function\", \"function\": {\"name\": ...}}", param="tool_choice")
    if name not in functions:
        raise ValidationFailed(f"`tool_choice` names {name!r}, which is not among `tools`", param="tool_choice")
    return ToolPlan(name, {"json": functions[name]})


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def tool_calls(plan: ToolPlan, text: str) -> list[dict[str, Any]] | None:
    """The calls a finished output makes, or None when it is not a complete call list (cut
    by max_tokens or a stop string): then it is returned as content."""
    if plan.function is not None:
        calls = [(plan.function, text)]
    else:
        try:
            items = json.loads(text)
        except json.JSONDecodeError:
            return None
        calls = [(item["name"], json.dumps(item["parameters"], ensure_ascii=False)) for item in items]
    return [{"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}
            for name, arguments in calls]


class ToolCallStream:
    """A streamed choice's deltas: a named function's arguments as they are generated; a
    "required" list of calls once it is complete (a partial list is not a call yet)."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.text = ""
        self.call_id: str | None = None

    def delta(self, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
        """The delta for `text` and the finish reason to report (None while running)."""
        self.text += text
        plan = self.plan
        if plan.function is not None:
            call: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
            if self.call_id is None:
                self.call_id = new_call_id()
                call = {"index": 0, "id": self.call_id, "type": "function",
                        "function": {"name": plan.function, "arguments": text}}
            return {"tool_calls": [call]}, plan.finish_reason if finish == "stop" else finish
        if finish is None:
            return {}, None
        made = tool_calls(plan, self.text)
        if made is None:
            return ({"content": self.text} if self.text else {}), finish
        return ({"tool_calls": [{"index": i, **call} for i, call in enumerate(made)]},
                plan.finish_reason if finish == "stop" else finish)
