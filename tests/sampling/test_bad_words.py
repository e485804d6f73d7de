"""vLLM's bad_words: which next tokens are banned after a given output."""
from __future__ import annotations

from transformers import AutoTokenizer

from tessera.sampling.bad_words import bad_words_token_ids, banned_next_tokens


def test_a_word_is_banned_at_its_last_token_once_the_rest_is_written():
    words = [[7], [3, 4, 5]]
    assert banned_next_tokens(words, []) == [7]
    assert banned_next_tokens(words, [1, 3, 4]) == [7, 5]
    assert banned_next_tokens(words, [3, 4, 1]) == [7]
    assert banned_next_tokens(words, [4]) == [7]


def test_words_are_tokenized_alone_and_after_a_space(tiny_tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    sequences = bad_words_token_ids(tokenizer, ["fox", " fox"])
    alone = tokenizer("fox", add_special_tokens=False).input_ids
    spaced = tokenizer(" fox", add_special_tokens=False).input_ids
    assert alone != spaced and sequences == [alone, spaced]
