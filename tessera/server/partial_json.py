"""The object a JSON text cut short already holds: its complete members, a value still
being written left out (as the anthropic SDK's partial parser reads a streamed tool
input), so that a tool call cut by max_tokens or a stop sequence has the same input
whole as streamed."""
from __future__ import annotations

import json

from tessera.server.json_spans import string_end

CLOSERS = {"{": "}", "[": "]"}


def partial_object(text: str) -> dict:
    """`text`'s complete members as an object; {} when it holds none (or is no object)."""
    cuts: list[tuple[int, str]] = []  # (end, closers): where a prefix ends with complete values
    stack: list[str] = []
    i, in_string = 0, False
    while i < len(text):
        ch = text[i]
        if ch == '"':  # strings skipped whole, as json_spans skips them
            end = string_end(text, i)
            if end is None:
                in_string = True
                break
            i = end
            continue
        if ch in CLOSERS:
            stack.append(CLOSERS[ch])
            cuts.append((i + 1, "".join(reversed(stack))))
        elif ch in "}]" and stack:
            stack.pop()
            cuts.append((i + 1, "".join(reversed(stack))))
        elif ch == ",":
            cuts.append((i, "".join(reversed(stack))))
        i += 1
    if not in_string:  # the text may end with a complete value (a number, true, a closed string)
        cuts.append((len(text), "".join(reversed(stack))))
    for end, closers in reversed(cuts):
        try:
            value = json.loads(text[:end] + closers)
        except ValueError:
            continue
        return value if isinstance(value, dict) else {}
    return {}
