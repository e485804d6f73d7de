"""Structured outputs: output constrained to a JSON schema, any JSON object, a regular
expression, one of a list of strings, or an EBNF grammar (vLLM's `structured_outputs`;
TGI's `grammar`; OpenAI's `response_format`).

xgrammar compiles the constraint against the tokenizer's vocabulary once (its compiler
caches by constraint); each sequence gets its own matcher, which gives the tokens allowed
next as a bitmask and advances with every sampled token. The sampler sets the disallowed
logits to -inf before anything else chooses; when the constraint is complete the matcher
allows only the end-of-sequence tokens. xgrammar is imported on the first constrained
request, so an engine that never gets one does not need it.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from tessera.platform import to_device
from tessera.sampling.params import SamplingParamsError

KINDS = ("json", "regex", "choice", "grammar", "json_object")
CACHE_LIMIT_BYTES = 256 * 2**20


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one constraint: `json` (a JSON schema, as a dict or its text), `regex`,
    `choice` (the output is one of these strings), `grammar` (EBNF in xgrammar's / GBNF
    syntax, start symbol `root`) or `json_object=True` (any JSON object)."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) for c in self.choice):
                raise SamplingParamsError("`choice` must be a list of strings")
            if not self.choice:
                raise SamplingParamsError("`choice` must not be empty")
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise SamplingParamsError("`json` must be a JSON schema (an object or its text)")
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise SamplingParamsError(f"`{name}` must be a string")
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise SamplingParamsError(
                f"structured outputs take exactly one of {', '.join(KINDS)}; got "
                f"{', '.join(given) if given else 'none'}")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))


class StructuredOutputError(ValueError):
    """The constraint does not compile (an invalid schema, regex or grammar)."""


class GrammarCompiler:
    """Compiles constraints for one tokenizer and vocabulary (thread-safe; xgrammar caches
    compiled constraints); `matcher(compiled)` gives a fresh per-sequence matcher."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Sequence[int]):
        try:
            import xgrammar
        except ImportError as exc:  # a dependency of tessera; missing only in odd installs
            raise StructuredOutputError(
                "structured outputs need the xgrammar package (pip install xgrammar)") from exc
        self._xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=sorted(stop_token_ids))
        self.vocab_size = vocab_size
        # bounded: every distinct schema a client sends stays cached (~55 KB each at 49k tokens)
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=2, cache_limit_bytes=CACHE_LIMIT_BYTES)

    def compile(self, spec: StructuredOutputsParams):
        compiler = self._compiler
        try:
            if spec.json is not None:
                schema = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
                # no free whitespace: small models otherwise fill the budget with newlines
                compiled = compiler.compile_json_schema(schema, any_whitespace=False)
            elif spec.json_object:
                compiled = compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            elif spec.regex is not None:
                compiled = compiler.compile_regex(spec.regex)
            elif spec.choice is not None:
                alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice)
                compiled = compiler.compile_grammar(f"root ::= {alternatives}")
            else:
                compiled = compiler.compile_grammar(spec.grammar)
        except Exception as exc:  # xgrammar reports bad input as RuntimeError / ValueError
            # drop xgrammar's "[time] file.cc:line: " prefix from what the client reads
            reason = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(exc)).strip()
            raise StructuredOutputError(f"invalid {spec.kind} constraint: {reason}") from exc
        first = self._xgr.allocate_token_bitmask(1, self.vocab_size)
        self.matcher(compiled).fill_next_token_bitmask(first, 0)
        if not first.any():  # e.g. a regex of an empty class, a left-recursive grammar
            raise StructuredOutputError(f"the {spec.kind} constraint matches nothing: no output can follow it")
        return compiled

    def matcher(self, compiled):
        return self._xgr.GrammarMatcher(compiled)


class AlsoAllowing:
    """A matcher's mask with one more token allowed next: a reasoning model's opening tag
    beside the constraint's first tokens (the output may reason first, or answer at once)."""

    def __init__(self, matcher, token_id: int):
        self.matcher, self.token_id = matcher, token_id

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)
        word, bit = divmod(self.token_id, 32)
        bitmask[row, word] |= (1 << bit) - (1 << 32 if bit == 31 else 0)  # int32 words


def mask_logits(logits: torch.Tensor, matchers: list) -> torch.Tensor:
    """A copy of `logits` with every token a row's matcher does not allow next at -inf
    (rows whose matcher is None are left alone)."""
    import xgrammar

    rows = [i for i, m in enumerate(matchers) if m is not None]
    bitmask = xgrammar.allocate_token_bitmask(len(matchers), logits.shape[1])
    for i in rows:
        matchers[i].fill_next_token_bitmask(bitmask, i)
    out = logits.clone()
    xgrammar.apply_token_bitmask_inplace(out, to_device(bitmask, out.device), indices=rows)
    return out
