"""Reasoning parsers (`tessera serve --reasoning-parser NAME`): a reasoning model's chat
answer split into `reasoning_content` (its `<think>...</think>` part) and `content` (what
follows), as vLLM, SGLang and DeepSeek's API return them.

- `deepseek_r1`: DeepSeek-R1 and its distills, whose chat template ends the prompt with
  `<think>`: the output starts inside the reasoning (a `<think>` it writes anyway is
  dropped) and `</think>` ends it; an output that never writes `</think>` (cut by
  max_tokens) is all reasoning.
- `qwen3`: Qwen3 writes `<think>` itself; an output that does not start with it is all
  content (e.g. `chat_template_kwargs: {"enable_thinking": false}`, whose template closes
  the reasoning in the prompt); one that opens it and never closes it is all reasoning.

Tool calls (`--tool-call-parser`) are read from the content only.
"""
from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningSyntax:
    opened_by_template: bool  # the prompt already holds `<think>`


REASONING_PARSERS = {"deepseek_r1": ReasoningSyntax(opened_by_template=True),
                     "qwen3": ReasoningSyntax(opened_by_template=False)}


def _partial_suffix(text: str, tag: str) -> int:
    """How many trailing characters of `text` may be the start of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


def split_reasoning(syntax: ReasoningSyntax, text: str,
                    final: bool = True) -> tuple[str | None, str | None]:
    """(reasoning, content) of an output; None for a part that is empty. With
    `final=False` (a stream) text that may still turn out to be part of a tag is held back
    from both, so each part only grows as the output does."""
    body = text.lstrip()
    if not final and START.startswith(body):  # nothing yet, or maybe the start of `<think>`: wait
        return None, None
    if body.startswith(START):
        text = body[len(START):]
    elif not syntax.opened_by_template:
        return None, text or None
    end = text.find(END)
    if end >= 0:
        return text[:end] or None, text[end + len(END):] or None
    if not final:
        text = text[:len(text) - _partial_suffix(text, END)]
    return text or None, None


class ReasoningStream:
    """One streamed choice: each call takes the text generated so far and returns what of
    the reasoning and of the content is new (never what a later token may take back)."""

    def __init__(self, syntax: ReasoningSyntax):
        self.syntax = syntax
        self.text = ""
        self.sent_reasoning = 0
        self.sent_content = 0

    def delta(self, text: str, final: bool) -> tuple[str, str]:
        """(new reasoning, new content) once `text` is appended."""
        self.text += text
        reasoning, content = split_reasoning(self.syntax, self.text, final)
        reasoning, content = reasoning or "", content or ""
        new = reasoning[self.sent_reasoning:], content[self.sent_content:]
        self.sent_reasoning, self.sent_content = len(reasoning), len(content)
        return new
