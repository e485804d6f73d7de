"""Reasoning parsers (`tessera serve --reasoning-parser NAME`): a reasoning model's chat
answer split into its reasoning (the `<think>...</think>` part) and its content (what
follows). The reasoning goes out as `reasoning_content` (DeepSeek's API, SGLang, older
vLLM) and as `reasoning` (vLLM since late 2025), so clients of either find it.

Where the reasoning starts: an output that starts with `<think>` opens it itself. A prompt
whose rendered chat template ends inside `<think>` (DeepSeek-R1's, QwQ's, Qwen3 Thinking
2507's) has opened it already, so the output starts inside the reasoning; a template that
closes it in the prompt (Qwen3 with `enable_thinking: false`) leaves an output that is all
content. `</think>` ends the reasoning; an output that never writes it (cut by max_tokens)
is all reasoning.

- `qwen3`: as above (Qwen3, QwQ, Qwen3 Thinking 2507).
- `deepseek_r1`: as above, and an output is taken to start inside the reasoning whatever
  the prompt says (vLLM's rule for R1, which may leave out the opening tag).
- `openai_gptoss`: gpt-oss's harmony channels (harmony.py): the analysis channel is the
  reasoning, the final and commentary ones the content. Its markers are special tokens, so
  its requests keep special tokens in their text; the parser takes them out.
- `gemma4`: as `qwen3` with Gemma 4's tags, `<|channel>thought` ... `<channel|>` (special
  tokens: its requests keep special tokens in their text).

Structured outputs (`response_format`, a required tool call) constrain the content: the
reasoning before `</think>` is the model's own (vLLM's behaviour), and an output the
prompt has not opened a reasoning for either opens one with `<think>` or is the answer
from its first token. That needs the tags to be tokens of their own, kept in the text (they
are for Qwen3, QwQ and DeepSeek-R1; Gemma 4's `<|channel>` and `<channel|>` are special
tokens its parser keeps); otherwise, and when the prompt closes the reasoning itself, the
output is the constraint's from its first token.

Tool calls (`--tool-call-parser`) are read from the content only.
"""
from __future__ import annotations

from dataclasses import dataclass

from tessera.server.harmony import HarmonyStream

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningSyntax:
    always_opened: bool  # the output starts inside the reasoning whatever the prompt says
    harmony: bool = False  # gpt-oss's channels, read from text with its special tokens
    start: str = START
    end: str = END
    special_tags: bool = False  # the tags are special tokens: kept in the text
    # the token a start tag of several tokens opens with (Gemma 4's <|channel>, then
    # "thought"): what a structured output's first token may be to reason first
    opening_token: str | None = None

    @property
    def opening(self) -> str:
        return self.opening_token or self.start


REASONING_PARSERS = {"deepseek_r1": ReasoningSyntax(always_opened=True),
                     "qwen3": ReasoningSyntax(always_opened=False),
                     "openai_gptoss": ReasoningSyntax(always_opened=False, harmony=True),
                     "gemma4": ReasoningSyntax(always_opened=False, start="<|channel>thought", end="<channel|>",
                                               special_tags=True, opening_token="<|channel>")}


def keeps_special_tokens(parser: str | None) -> bool:
    """Whether parser `parser` reads markers that are special tokens (harmony's, Gemma 4's)."""
    return parser is not None and (REASONING_PARSERS[parser].harmony or REASONING_PARSERS[parser].special_tags)


def reasoning_stream(parser: str, opened: bool) -> ReasoningStream | HarmonyStream:
    """The splitter of one choice's text under reasoning parser `parser`."""
    syntax = REASONING_PARSERS[parser]
    return HarmonyStream() if syntax.harmony else ReasoningStream(opened, syntax.start, syntax.end)


def prompt_opens_reasoning(prompt: str, parser: str = "qwen3") -> bool:
    """Whether a rendered chat prompt ends inside the reasoning's opening tag (the generation
    prompt opened it)."""
    return prompt.rstrip().endswith(REASONING_PARSERS[parser].start)


def output_opens_inside(parser: str | None, prompt: str) -> bool:
    """Whether, under reasoning parser `parser` (None: none), the output starts inside the
    reasoning: the parser says it always does, or the rendered prompt opened it."""
    return parser is not None and (REASONING_PARSERS[parser].always_opened or prompt_opens_reasoning(prompt, parser))


def prompt_closes_reasoning(prompt: str, parser: str = "qwen3") -> bool:
    """Whether a rendered chat prompt ends just after the reasoning's closing tag (a template
    that turns thinking off writes an empty reasoning itself): the output is all content."""
    return prompt.rstrip().endswith(REASONING_PARSERS[parser].end)


def tag_token(tokenizer, tag: str, kept_special: bool = False) -> int | None:
    """`tag` (`<think>`, `</think>`) as one token of this tokenizer that decodes to the tag
    in the text the client gets (Qwen3's, QwQ's, DeepSeek-R1's are), or None. A
    structured-output constraint waits for `</think>` only where it is such a token: a tag
    split over tokens could end inside one, mid-way into the answer, and a special token
    skipped in the text would leave no tag to split the answer at (`kept_special`: the
    parser keeps special tokens in the text, as Gemma 4's does)."""
    token_id = tokenizer.convert_tokens_to_ids(tag)
    if not isinstance(token_id, int) or token_id == tokenizer.unk_token_id:
        return None
    if tokenizer.encode(tag, add_special_tokens=False) != [token_id]:
        return None
    return token_id if tokenizer.decode([token_id], skip_special_tokens=not kept_special) == tag else None


def reasoning_tag_tokens(tokenizer, parser: str) -> tuple[int | None, int | None]:
    """(the token that opens parser `parser`'s reasoning, the token that ends it) where each
    is a token of its own kept in the text (tag_token), else None; (None, None) for
    harmony's channels, which a constraint does not wait through."""
    syntax = REASONING_PARSERS[parser]
    if syntax.harmony:
        return None, None
    return (tag_token(tokenizer, syntax.opening, syntax.special_tags),
            tag_token(tokenizer, syntax.end, syntax.special_tags))


def _partial_suffix(text: str, tag: str) -> int:
    """How many trailing characters of `text` may be the start of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


def split_reasoning(text: str, opened: bool, parser: str = "qwen3") -> tuple[str | None, str | None]:
    """(reasoning, content) of a finished output; None for a part that is empty. `opened`:
    the output starts inside the reasoning (the prompt opened it)."""
    reasoning, content = reasoning_stream(parser, opened).delta(text, final=True)
    return reasoning or None, content or None


class ReasoningStream:
    """One choice's text, a piece at a time (a stream), or whole (split_reasoning): each
    call returns what of the reasoning and of the content is new. Text that may still become
    a tag is held back until it is one or the output ends; each piece is looked at once (a
    long reasoning costs no more per token at its end than at its start)."""

    def __init__(self, opened: bool, start: str = START, end: str = END):
        self.opened, self.start, self.end = opened, start, end
        self.phase = "start"  # then "reasoning", then "content"
        self.held = ""        # text not yet placed

    def delta(self, text: str, final: bool) -> tuple[str, str]:
        """(new reasoning, new content) once `text` is appended; `final`: the output ended."""
        held = self.held + text
        self.held = ""
        if self.phase == "start":
            body = held.lstrip()
            if not final and self.start.startswith(body):  # nothing yet, or maybe the tag: wait
                self.held = held
                return "", ""
            if body.startswith(self.start):
                held = body[len(self.start):]
            elif not self.opened:
                self.phase = "content"
                return "", held
            self.phase = "reasoning"
        if self.phase == "content":
            return "", held
        end = held.find(self.end)
        if end >= 0:
            self.phase = "content"
            return held[:end], held[end + len(self.end):]
        keep = 0 if final else _partial_suffix(held, self.end)
        self.held = held[len(held) - keep:]
        return held[:len(held) - keep], ""
