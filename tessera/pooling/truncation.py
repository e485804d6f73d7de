"""Truncating a prompt to fit, keeping the tokenizer's special tokens: a cut body between
BERT's [CLS] and [SEP] (what CLS pooling and classifiers read), or before a decoder
embedder's closing EOS (what last-token pooling reads), as the tokenizer's own truncation
keeps them. Cutting the raw ids would drop them and pool an ordinary token instead."""
from __future__ import annotations

from functools import lru_cache


class TruncationError(ValueError):
    pass


@lru_cache(maxsize=8)
def _layout(tokenizer) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ids the tokenizer puts before and after one text (found by encoding a probe
    with and without special tokens)."""
    probe = "hello"
    full = list(tokenizer(probe).input_ids)
    body = list(tokenizer(probe, add_special_tokens=False).input_ids)
    for start in range(len(full) - len(body) + 1):
        if full[start:start + len(body)] == body:
            return tuple(full[:start]), tuple(full[start + len(body):])
    return (), ()


def truncate_ids(tokenizer, ids: list[int], keep: int, side: str = "left") -> list[int]:
    """`ids` cut to `keep` tokens from the `side` ("left": keep the end, as vLLM's
    truncate_prompt_tokens; "right": keep the start, TEI's default), keeping the leading and
    trailing special tokens the tokenizer adds when `ids` has them."""
    if len(ids) <= keep:
        return ids
    prefix, suffix = _layout(tokenizer)
    framed = bool(prefix or suffix) and tuple(ids[:len(prefix)]) == prefix and (
        not suffix or tuple(ids[len(ids) - len(suffix):]) == suffix)
    if not framed:
        return ids[-keep:] if side == "left" else ids[:keep]
    room = keep - len(prefix) - len(suffix)
    if room < 1:
        raise TruncationError(f"truncating to {keep} tokens leaves no room for the text between the tokenizer's "
                              f"{len(prefix) + len(suffix)} special tokens")
    body = ids[len(prefix):len(ids) - len(suffix)]
    body = body[-room:] if side == "left" else body[:room]
    return list(prefix) + body + list(suffix)
