"""gpt-oss's "harmony" replies (`--reasoning-parser openai_gptoss`, with `--tool-call-parser
openai` for function calls), read from the text with its special tokens kept.

The prompt ends by opening an assistant message (`<|start|>assistant`); the model writes
one or more messages, each a header, `<|message|>`, a body and an end marker:

    <|channel|>analysis<|message|>We need the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>
    ... or <|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>

The header names the channel (`analysis`: the reasoning; `final`: the answer; `commentary`:
text for the user, or a tool call) and, for a call, the recipient (`to=functions.NAME`,
before or after the channel). `<|return|>` and `<|call|>` end the generation (they are the
model's stop tokens, so they seldom reach the text).

`HarmonyStream` splits a reply, a piece at a time, into reasoning (analysis bodies) and
content (final and commentary bodies), and writes each call into the content in one form,
`<|start|>assistant to=functions.NAME<|message|>ARGUMENTS<|call|>`, which the `openai`
tool-call parser reads (tool_parsers/marker_calls.py). A reply that writes no harmony markup at all (a
constrained output, or another model) is content as written.
"""
from __future__ import annotations

import re

MESSAGE, START = "<|message|>", "<|start|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
CALL_OPEN, CALL_END = f"{START}assistant to=", "<|call|>"
# how a reply's first header may begin (the prompt ends by opening the assistant's message;
# the recipient may come before the channel)
HEADER_STARTS = ("<|channel|>", "<|constrain|>", "<|message|>", START, "to=")
_CHANNEL = re.compile(r"<\|channel\|>\s*([\w.-]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


def _partial_marker(text: str, markers: tuple[str, ...]) -> int:
    """How many trailing characters of `text` may begin one of `markers`."""
    for k in range(min(max(map(len, markers)) - 1, len(text)), 0, -1):
        if any(m.startswith(text[-k:]) for m in markers):
            return k
    return 0


class HarmonyStream:
    """One reply's text in pieces -> (new reasoning, new content) per piece, the interface
    of reasoning.ReasoningStream. Text that may still become a marker is held back until it
    is one or the reply ends; each piece is looked at once."""

    def __init__(self) -> None:
        self.phase = "header"  # "body" after <|message|>; "plain": no harmony markup at all
        self.held = ""
        self.started = False   # anything but whitespace seen
        self.target = "content"  # where the current body goes: "reasoning", "content", "call"
        self.recipient = ""      # a call's function name

    def delta(self, text: str, final: bool) -> tuple[str, str]:
        held = self.held + text
        self.held = ""
        reasoning, content = [], []
        while True:
            if self.phase == "plain":
                content.append(held)
                break
            if self.phase == "header":
                if not self.started:
                    body = held.lstrip()
                    if not body:
                        self.held = held
                        break
                    if not any(body.startswith(m) for m in HEADER_STARTS):
                        if not final and any(m.startswith(body) for m in HEADER_STARTS):
                            self.held = held  # may still become a header: wait
                            break
                        self.phase = "plain"  # no markup: the reply is content as written
                        continue
                    self.started = True
                at = held.find(MESSAGE)
                if at < 0:
                    if final:  # a header never finished (cut): nothing of it is for the client
                        self.held = ""
                    else:
                        self.held = held
                    break
                self._open(held[:at])
                if self.target == "call":
                    content.append(f"{CALL_OPEN}{self.recipient}{MESSAGE}")
                held, self.phase = held[at + len(MESSAGE):], "body"
            # body: up to the first end marker
            ends = [(held.find(m), m) for m in ENDS if m in held]
            out = content if self.target != "reasoning" else reasoning
            if ends:
                at, marker = min(ends)
                out.append(held[:at])
                if self.target == "call":
                    content.append(CALL_END)
                held, self.phase = held[at + len(marker):], "header"
                continue
            keep = 0 if final else _partial_marker(held, ENDS + (START,))
            out.append(held[:len(held) - keep])
            if final and self.target == "call":
                content.append(CALL_END)  # cut by max_tokens or ended by its stop token
            self.held = held[len(held) - keep:]
            break
        return "".join(reasoning), "".join(content)

    def _open(self, header: str) -> None:
        """A message's header is whole: where its body goes."""
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        if recipient is not None:
            name = recipient.group(1)
            self.target, self.recipient = "call", name.removeprefix("functions.")
        elif channel is not None and channel.group(1) == "analysis":
            self.target = "reasoning"
        else:  # final, commentary for the user, or a channel harmony does not name
            self.target = "content"


def split_harmony(text: str) -> tuple[str | None, str | None]:
    """(reasoning, content) of a finished reply; None for a part that is empty."""
    reasoning, content = HarmonyStream().delta(text, final=True)
    return reasoning or None, content or None
