"""Incremental detokenization with prefix and read offsets.

Decoding a sliding window of tokens (rather than each token alone) keeps spaces and merged
characters right; text ending in U+FFFD is held back until the rest of a multi-byte
character arrives, so no delta ever carries half a UTF-8 character. `end` leaves trailing
tokens out (a stop token whose text the caller does not want).
"""
from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from tessera.engine.sequence import Sequence


def _advance(tokenizer: PreTrainedTokenizerBase, seq: Sequence, final: bool, end: int | None) -> str:
    skip = seq.params.skip_special_tokens
    ids = seq.token_ids if end is None else seq.token_ids[:end]
    if len(ids) <= seq.read_offset:
        return ""
    prefix_text = tokenizer.decode(ids[seq.prefix_offset:seq.read_offset], skip_special_tokens=skip)
    full_text = tokenizer.decode(ids[seq.prefix_offset:], skip_special_tokens=skip)
    if len(full_text) <= len(prefix_text) or (full_text.endswith("\ufffd") and not final):
        return ""
    delta = full_text[len(prefix_text):]
    seq.prefix_offset, seq.read_offset = seq.read_offset, len(ids)
    seq.text += delta
    return delta


def detokenize_incrementally(tokenizer: PreTrainedTokenizerBase, seq: Sequence,
                             end: int | None = None) -> str:
    """Append to `seq.text` what the newest tokens (up to `end`) add, and return that delta."""
    return _advance(tokenizer, seq, final=False, end=end)


def flush(tokenizer: PreTrainedTokenizerBase, seq: Sequence, end: int | None = None) -> str:
    """At the end of a sequence, emit whatever was held back (an incomplete character is
    emitted as U+FFFD rather than lost)."""
    return _advance(tokenizer, seq, final=True, end=end)
