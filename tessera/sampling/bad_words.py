"""vLLM's `bad_words`: words the output must not contain. Each word is tokenized as it
would start a text and as it would follow a space (a different token sequence in most
vocabularies); a sequence's last token is banned whenever the output so far ends with the
rest of it (a one-token word is banned always)."""
from __future__ import annotations

from typing import Sequence


def bad_words_token_ids(tokenizer, words: Sequence[str]) -> list[list[int]]:
    """The token sequences to keep out of the output, without duplicates."""
    sequences: list[list[int]] = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = list(tokenizer(text, add_special_tokens=False).input_ids)
            if ids and ids not in sequences:
                sequences.append(ids)
    return sequences


def banned_next_tokens(sequences: Sequence[Sequence[int]], output_ids: Sequence[int]) -> list[int]:
    """The tokens that would complete one of `sequences` after `output_ids`."""
    banned = []
    for seq in sequences:
        prefix = len(seq) - 1
        if prefix == 0 or (len(output_ids) >= prefix and list(output_ids[-prefix:]) == list(seq[:-1])):
            banned.append(seq[-1])
    return banned
