"""The object a JSON text cut short already holds: its complete members, a value still
being written left out (as the anthropic SDK's partial parser reads a streamed tool
input), so that a tool call cut by max_tokens or a stop sequence has the same input
whole as streamed."""
from __future__ import annotations

import json

CLOSERS = {"{": "}", "[": "]"}


def partial_object(text: str) -> dict:
    """`text`'s complete members as an object; {} when it holds none (or is no object)."""
    cuts: list[tuple[int, str]] = []  # (end, closers): where a prefix ends with complete values
    stack: list[str] = []
    in_string = escaped = False
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
            continue
        if ch == '"':
            in_string = True
        elif ch in CLOSERS:
            stack.append(CLOSERS[ch])
            cuts.append((i + 1, "".join(reversed(stack))))
        elif ch in "}]" and stack:
            stack.pop()
            cuts.append((i + 1, "".join(reversed(stack))))
        elif ch == ",":
            cuts.append((i, "".join(reversed(stack))))
    if not in_string:  # the text may end with a complete value (a number, true, a closed string)
        cuts.append((len(text), "".join(reversed(stack))))
    for end, closers in reversed(cuts):
        try:
            value = json.loads(text[:end] + closers)
        except ValueError:
            continue
        return value if isinstance(value, dict) else {}
    return {}
