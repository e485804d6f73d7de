"""An Anthropic Messages request (`POST /v1/messages`, as the `anthropic` SDK and Claude
Code send it) as the chat request it runs as.

`system` is the system message; a message's content blocks become chat's: text and image
blocks its parts, an assistant's `tool_use` blocks its `tool_calls`, a user's
`tool_result` blocks `tool` messages (before the user's own text, where Anthropic puts
them). Thinking blocks sent back are skipped, as chat templates drop earlier turns'
reasoning. A conversation that ends with an assistant's text is continued from it
(Anthropic's prefill). Tools are custom tools (`name`, `description`, `input_schema`);
`tool_choice` auto / any / tool / none is chat's auto / required / a named function / none.
What needs Anthropic's servers (server tools, documents, MCP) is refused by name."""
from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict

from tessera.server.errors import ValidationFailed
from tessera.server.protocol import ChatCompletionRequest


class MessagesRequest(BaseModel):
    """Anthropic's /v1/messages body (and /v1/messages/count_tokens', without max_tokens)."""

    model_config = ConfigDict(extra="forbid")

    model: str
    messages: list[Any]
    max_tokens: int | None = None  # required by /v1/messages (checked there)
    system: str | list[Any] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None  # its `format` (a JSON schema) constrains the text
    # {"type": "enabled" | "disabled"}: the chat template's enable_thinking (Qwen3's and
    # SmolLM3's switch; templates without one ignore it); an enabled one's `budget_tokens`
    # is the thinking budget (chat completions' thinking_token_budget), enforced where the
    # server's reasoning parser has tags that are tokens (clients always send one)
    thinking: dict[str, Any] | None = None
    # taken and ignored: hints for Anthropic's service
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    cache_control: dict[str, Any] | None = None  # prefix caching needs no marks here
    diagnostics: dict[str, Any] | None = None
    inference_geo: str | None = None
    speed: str | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None


def chat_request(body: MessagesRequest) -> ChatCompletionRequest:
    """The chat request a Messages request is (validated as one)."""
    if body.temperature is not None and not 0 <= body.temperature <= 1:
        raise ValidationFailed("temperature: must be between 0 and 1", param="temperature")
    messages: list[dict] = []
    if body.system:
        messages.append({"role": "system", "content": body.system if isinstance(body.system, str)
                         else _joined_text(body.system, "system")})
    names: dict[str, str] = {}  # tool_use id -> its tool, for the results that answer it
    unanswered: list[str] = []  # the last assistant turn's tool_use ids
    for i, message in enumerate(body.messages):
        where = f"messages[{i}]"
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("user", "assistant"):
            raise ValidationFailed(f"{where}.role must be \"user\" or \"assistant\" (the system prompt is "
                                   "`system`)", param="messages")
        content = message.get("content")
        if isinstance(content, str):
            turn = [{"role": role, "content": content}]
        elif role == "user":
            turn = _user_turn(content, where, names)
        else:
            turn = [_assistant_turn(content, where, names)]
        answered = [m["tool_call_id"] for m in turn if m["role"] == "tool"]
        if sorted(answered) != sorted(unanswered) or any(m["role"] != "tool" for m in turn[:len(answered)]):
            raise ValidationFailed(f"{where}: the tool_use ids {unanswered} need their tool_result blocks, and only "
                                   f"those, first in the next user message (got {answered})", param="messages")
        unanswered = [c["id"] for c in turn[0].get("tool_calls", [])] if role == "assistant" else []
        messages += turn
    if unanswered:
        raise ValidationFailed(f"the tool_use ids {unanswered} of the last assistant turn have no tool_result",
                               param="messages")
    last = messages[-1] if messages else None
    # Anthropic's prefill: a last assistant turn of text is continued, not answered
    prefill = last is not None and last["role"] == "assistant" and "tool_calls" not in last
    chat: dict[str, Any] = {"model": body.model, "messages": messages, "max_tokens": body.max_tokens,
                            "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k,
                            "stop": body.stop_sequences, "add_generation_prompt": not prefill,
                            "continue_final_message": prefill}
    thinking = (body.thinking or {}).get("type")
    if thinking in ("enabled", "disabled"):
        chat["chat_template_kwargs"] = {"enable_thinking": thinking == "enabled"}
    budget = (body.thinking or {}).get("budget_tokens")
    if thinking == "enabled" and budget is not None:
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
            raise ValidationFailed(f"thinking.budget_tokens must be an integer >= 0, got {budget!r}",
                                   param="thinking.budget_tokens")
        chat["thinking_token_budget"] = budget
    if body.tools:
        chat["tools"] = [_chat_tool(tool, i) for i, tool in enumerate(body.tools)]
    if body.tool_choice is not None:
        chat["tool_choice"], parallel = _chat_tool_choice(body.tool_choice)
        chat["parallel_tool_calls"] = parallel
    fmt = (body.output_config or {}).get("format")
    if fmt is not None:
        if not (isinstance(fmt, dict) and fmt.get("type") == "json_schema" and isinstance(fmt.get("schema"), dict)):
            raise ValidationFailed("`output_config.format` must be {\"type\": \"json_schema\", \"schema\": {...}}",
                                   param="output_config")
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValueError as exc:
        raise ValidationFailed(str(exc), param="messages") from None


def _blocks(content: Any, where: str) -> list[dict]:
    if not isinstance(content, list) or not all(isinstance(block, dict) for block in content):
        raise ValidationFailed(f"{where}.content must be a string or a list of content blocks", param="messages")
    if not content:
        raise ValidationFailed(f"{where}.content cannot be empty", param="messages")
    return content


def _text(block: dict, where: str) -> str:
    if not isinstance(block.get("text"), str):
        raise ValidationFailed(f"{where}: a text block's `text` must be a string", param="messages")
    return block["text"]


def _joined_text(content: Any, where: str) -> str:
    texts = []
    for j, block in enumerate(_blocks(content, where)):
        if block.get("type") != "text":
            raise ValidationFailed(f"{where}[{j}]: only text blocks are taken here, got {block.get('type')!r}",
                                   param="messages")
        texts.append(_text(block, f"{where}[{j}]"))
    return "\n".join(texts)


def _image_part(block: dict, where: str) -> dict:
    source = block.get("source") if isinstance(block.get("source"), dict) else {}
    if source.get("type") == "base64" and isinstance(source.get("data"), str):
        url = f"data:{source.get('media_type', 'image/png')};base64,{source['data']}"
    elif source.get("type") == "url" and isinstance(source.get("url"), str):
        url = source["url"]
    else:
        raise ValidationFailed(f"{where}: an image's source is base64 (`media_type`, `data`) or a `url`",
                               param="messages")
    return {"type": "image_url", "image_url": {"url": url}}


def _user_turn(content: Any, where: str, names: dict[str, str]) -> list[dict]:
    """A user's blocks: its tool results as tool messages, its text and images as a message."""
    turn, parts = [], []
    for j, block in enumerate(_blocks(content, where)):
        kind, at = block.get("type"), f"{where}.content[{j}]"
        if kind == "text":
            parts.append({"type": "text", "text": _text(block, at)})
        elif kind == "image":
            parts.append(_image_part(block, at))
        elif kind == "tool_result":
            if parts:  # text before a result stays before it
                turn.append({"role": "user", "content": parts})
                parts = []
            result = block.get("content", "")
            tool_use_id = block.get("tool_use_id")
            if not isinstance(tool_use_id, str):
                raise ValidationFailed(f"{at}: a tool_result needs `tool_use_id`", param="messages")
            text = result if isinstance(result, str) else _joined_text(result, f"{at}.content") if result else ""
            message = {"role": "tool", "tool_call_id": tool_use_id, "content": text,
                       "name": names.get(tool_use_id)}
            if block.get("is_error"):  # for templates that mark a failed call (the text says why)
                message["is_error"] = True
            turn.append(message)
        else:
            raise ValidationFailed(f"{at}: user blocks are text, image and tool_result, got {kind!r}",
                                   param="messages")
    if parts:
        turn.append({"role": "user", "content": parts})
    return turn


def _assistant_turn(content: Any, where: str, names: dict[str, str]) -> dict:
    texts, calls = [], []
    for j, block in enumerate(_blocks(content, where)):
        kind, at = block.get("type"), f"{where}.content[{j}]"
        if kind == "text":
            texts.append(_text(block, at))
        elif kind == "tool_use":
            if not (isinstance(block.get("id"), str) and isinstance(block.get("name"), str)
                    and isinstance(block.get("input", {}), dict)):
                raise ValidationFailed(f"{at}: a tool_use needs `id`, `name` and an `input` object", param="messages")
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": json.dumps(block.get("input", {}))}})
            names[block["id"]] = block["name"]
        elif kind not in ("thinking", "redacted_thinking"):
            raise ValidationFailed(f"{at}: assistant blocks are text, tool_use and thinking, got {kind!r}",
                                   param="messages")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        message["tool_calls"] = calls
    return message


def _chat_tool(tool: Any, i: int) -> dict:
    if not isinstance(tool, dict):
        raise ValidationFailed(f"`tools[{i}]` must be an object (`name`, `description`, `input_schema`)",
                               param="tools")
    if tool.get("type", "custom") != "custom":
        raise ValidationFailed(f"`tools[{i}]`: only custom tools (`name`, `description`, `input_schema`) are "
                               f"served; {tool.get('type')!r} is one of Anthropic's server tools", param="tools")
    if not isinstance(tool.get("name"), str) or not isinstance(tool.get("input_schema"), dict):
        raise ValidationFailed(f"`tools[{i}]` needs a `name` and an `input_schema` object", param="tools")
    function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: dict) -> tuple[Any, bool | None]:
    """Chat's tool_choice and parallel_tool_calls for Anthropic's tool_choice."""
    parallel = False if choice.get("disable_parallel_tool_use") else None
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise ValidationFailed("`tool_choice.type` must be \"auto\", \"any\", \"none\" or \"tool\" (with `name`)",
                           param="tool_choice")
