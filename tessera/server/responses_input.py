"""A Responses API request as the chat request it runs as: `instructions` the system
message, `input` items the conversation, function tools and `tool_choice` in chat's shape.

Input items: messages (parts input_text / input_image / output_text), `function_call`
items (a call the model made, sent back) and `function_call_output` items (its result).
Consecutive calls join the assistant turn before them, as chat templates expect one
assistant message holding its text and all its calls; a result is a `tool` message
naming its call. Reasoning items are skipped (chat templates drop earlier turns'
reasoning). Anything that needs stored state or OpenAI's hosted tools is refused by name."""
from __future__ import annotations

from typing import Any

from tessera.server.errors import ValidationFailed
from tessera.server.openai_validation import MAX_LOGPROBS
from tessera.server.protocol import ChatCompletionRequest, ResponsesRequest

# Responses fields the endpoint refuses, with why
UNSUPPORTED = {"prompt": "stored prompts are not supported: send the text as `input` or `instructions`",
               "background": "background responses are not supported"}
TEXT_PARTS = ("input_text", "output_text", "text")
LOGPROBS = "message.output_text.logprobs"  # the `include` value that asks for the message's logprobs
# what `include` may name (OpenAI's values); only LOGPROBS adds anything here: the others
# are of hosted tools' items, image URLs and encrypted reasoning, none of which a reply has
INCLUDABLE = {LOGPROBS, "reasoning.encrypted_content", "message.input_image.image_url", "file_search_call.results",
              "web_search_call.results", "web_search_call.action.sources", "code_interpreter_call.outputs",
              "computer_call_output.output.image_url"}


def input_items(body: ResponsesRequest) -> list:
    """The request's own input as items (a string is one user message)."""
    return [{"role": "user", "content": body.input}] if isinstance(body.input, str) else list(body.input)


def chat_request(body: ResponsesRequest, items: list | None = None) -> ChatCompletionRequest:
    """The chat request a Responses request is (validated as one). `items`: the whole
    conversation (earlier turns of a previous response first); by default the input's."""
    for field, why in UNSUPPORTED.items():
        if getattr(body, field) not in (None, [], False):
            raise ValidationFailed(why, param=field)
    messages = [{"role": "system", "content": body.instructions}] if body.instructions else []
    items = input_items(body) if items is None else items
    calls: dict[str, str] = {}  # call_id -> function name, for the results that answer them
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else type(item).__name__
        if kind == "reasoning":
            continue
        if kind == "function_call":
            _add_call(messages, item, where, calls)
        elif kind == "function_call_output":
            messages.append(_call_output(item, where, calls))
        elif kind == "message" and isinstance(item, dict) and "role" in item:
            messages.append(_message(item, where))
        else:
            raise ValidationFailed(f"{where}: input items are messages, function_call and function_call_output "
                                   f"(and reasoning, skipped), got {kind!r}", param="input")
    chat: dict[str, Any] = {"model": body.model, "messages": messages, "max_tokens": body.max_output_tokens,
                            "temperature": body.temperature, "top_p": body.top_p,
                            "parallel_tool_calls": body.parallel_tool_calls,
                            "logprobs": logprobs_wanted(body), "top_logprobs": body.top_logprobs}
    if body.tools:
        chat["tools"] = [_chat_tool(tool, i) for i, tool in enumerate(body.tools)]
    if body.tool_choice is not None:
        chat["tool_choice"] = _chat_tool_choice(body.tool_choice)
    effort = (body.reasoning or {}).get("effort") if isinstance(body.reasoning, dict) else None
    if effort is not None:
        chat["reasoning_effort"] = effort
    fmt = (body.text or {}).get("format")
    if fmt is not None:
        chat["response_format"] = _response_format(fmt)
    unknown = set(body.include or ()) - INCLUDABLE
    if unknown:
        raise ValidationFailed(f"`include` takes {sorted(INCLUDABLE)}, got {sorted(unknown)}", param="include")
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValueError as exc:
        raise ValidationFailed(str(exc), param="input") from None


def logprobs_wanted(body: ResponsesRequest) -> bool:
    """Whether the message's logprobs are asked for: `include` names them, or `top_logprobs`
    is set (as vLLM reads it)."""
    if body.top_logprobs is not None and not 0 <= body.top_logprobs <= MAX_LOGPROBS:
        raise ValidationFailed(f"`top_logprobs` must be in [0, {MAX_LOGPROBS}]", param="top_logprobs")
    return LOGPROBS in (body.include or ()) or body.top_logprobs is not None


def _message(item: dict, where: str) -> dict:
    role = {"developer": "system"}.get(item["role"], item["role"])
    content = item.get("content")
    if isinstance(content, str) or content is None:
        return {"role": role, "content": content or ""}
    return {"role": role, "content": _parts(content, where, images=True)}


def _parts(content: Any, where: str, images: bool, param: str = "input") -> list[dict]:
    if not isinstance(content, list):
        raise ValidationFailed(f"{where}: content must be a string or a list of parts", param=param)
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in TEXT_PARTS:
            if not isinstance(part.get("text"), str):
                raise ValidationFailed(f"{where}.content[{j}].text must be a string", param=param)
            parts.append({"type": "text", "text": part["text"]})
        elif images and kind == "input_image" and isinstance(part.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            taken = "input_text, input_image (with an image_url) or output_text" if images else "input_text"
            raise ValidationFailed(f"{where}.content[{j}]: parts are {taken}, got {kind!r}", param=param)
    return parts


def _text(item: dict, key: str, where: str, param: str = "input") -> str:
    value = item.get(key)
    if not isinstance(value, str) or (key != "arguments" and not value):
        raise ValidationFailed(f"{where}: a {item.get('type')} item needs `{key}` as a string", param=param)
    return value


ROLES = ("user", "assistant", "system", "developer")


def check_items(items: list, param: str) -> None:
    """Each item's shape, as `chat_request` reads it (a result's call may be in items sent
    before: not matched here)."""
    for i, item in enumerate(items):
        where = f"{param}[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else type(item).__name__
        if kind == "message" and isinstance(item, dict):
            if item.get("role") not in ROLES:
                raise ValidationFailed(f"{where}: a message's role is one of {', '.join(ROLES)}", param=param)
            if not (isinstance(item.get("content"), str) or item.get("content") is None):
                _parts(item.get("content"), where, images=True, param=param)
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                _text(item, key, where, param)
        elif kind == "function_call_output":
            _text(item, "call_id", where, param)
            if not isinstance(item.get("output"), str):
                _parts(item.get("output"), f"{where}.output", images=False, param=param)
        elif kind != "reasoning":
            raise ValidationFailed(f"{where}: items are messages, function_call, function_call_output and "
                                   f"reasoning, got {kind!r}", param=param)


def _add_call(messages: list[dict], item: dict, where: str, calls: dict[str, str]) -> None:
    """A call the model made: one more call of the assistant turn it belongs to."""
    call_id, name = _text(item, "call_id", where), _text(item, "name", where)
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": _text(item, "arguments", where)}}
    calls[call_id] = name
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})


def _call_output(item: dict, where: str, calls: dict[str, str]) -> dict:
    call_id, output = _text(item, "call_id", where), item.get("output")
    if call_id not in calls:
        raise ValidationFailed(f"{where}: no function_call with call_id {call_id!r} comes before this output",
                               param="input")
    if not isinstance(output, str):  # a list of parts: their text (images and files are not taken here)
        output = "".join(part["text"] for part in _parts(output, f"{where}.output", images=False))
    # some templates name the function a result answers
    return {"role": "tool", "tool_call_id": call_id, "content": output, "name": calls[call_id]}


def _chat_tool(tool: Any, i: int) -> dict:
    """A Responses function tool (its fields beside `type`) as chat's nested form."""
    if not isinstance(tool, dict):
        raise ValidationFailed(f"`tools[{i}]` must be an object", param="tools")
    kind = tool.get("type")
    if kind == "custom":
        raise ValidationFailed(f"`tools[{i}]`: custom tools (free-form input) are not served; function tools "
                               "(`parameters`, a JSON schema) are", param="tools")
    if kind != "function":
        raise ValidationFailed(f"`tools[{i}]`: only function tools are served (the model's own calls, run by the "
                               f"client); {kind!r} is one of OpenAI's hosted tools", param="tools")
    function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if tool.get(key) is not None}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: Any) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    kind = choice.get("type") if isinstance(choice, dict) else choice
    raise ValidationFailed(f"`tool_choice` must be \"none\", \"auto\", \"required\" or "
                           f"{{\"type\": \"function\", \"name\": ...}}, got {kind!r}", param="tool_choice")


def _response_format(fmt: Any) -> dict:
    """Responses' text.format (name and schema beside the type) as chat's response_format."""
    if not isinstance(fmt, dict):
        raise ValidationFailed("`text.format` must be an object with a `type`", param="text")
    if fmt.get("type") == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise ValidationFailed("`text.format` of type json_schema needs a `schema` object", param="text")
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    return {"type": fmt.get("type")}
