"""A GGUF's byte-level BPE vocabulary splits text as its `tokenizer.ggml.pre` says, where
transformers' conversion would split as GPT-2 (weights/gguf_pretokenizers.py): DeepSeek-V3's
numbers three digits a piece and CJK runs apart, SmolLM's digits one by one, GLM-4's; names
nobody knows are logged; a name transformers knows keeps its split."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as QT
from transformers import AutoTokenizer

from tessera.weights.gguf import gguf_metadata_folder
from tests.weights.gguf_writer import write_llama_gguf
from tests.weights.test_gguf import tiny_llama

TEXT = "Pay 1234567 now,\n你好世界 ok"


@pytest.fixture(scope="module")
def model(make_tiny_llama):
    return tiny_llama(make_tiny_llama, seed=3)


def _pieces(model, tiny_tokenizer_dir: Path, tmp_path: Path, pre: str | None) -> list[str]:
    metadata = {} if pre is None else {"tokenizer.ggml.pre": pre}
    path = write_llama_gguf(tmp_path / f"tiny-{pre}.gguf", model, Path(tiny_tokenizer_dir) / "tokenizer.json", QT.F32,
                            extra_metadata=metadata)
    tokenizer = AutoTokenizer.from_pretrained(gguf_metadata_folder(path, tmp_path / "cache"))
    return [piece for piece, _ in tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str(TEXT)]


def _text(pieces: list[str]) -> list[str]:
    """Byte-level pieces (Ġ a space, Ċ a newline, ...) back to text."""
    from tokenizers import decoders

    return [decoders.ByteLevel().decode([piece]) for piece in pieces]


def test_deepseek_v3_splits_numbers_by_three_and_cjk_apart(model, tiny_tokenizer_dir, tmp_path):
    got = _text(_pieces(model, tiny_tokenizer_dir, tmp_path, "deepseek-v3"))
    assert got == ["Pay", " ", "123", "456", "7", " now", ",\n", "你好世界", " ok"]
    gpt2 = _text(_pieces(model, tiny_tokenizer_dir, tmp_path, None))  # what the name changes
    assert " 1234567" in gpt2 and "123" not in gpt2


def test_smollm_splits_every_digit(model, tiny_tokenizer_dir, tmp_path):
    got = _text(_pieces(model, tiny_tokenizer_dir, tmp_path, "smollm"))
    assert got[:9] == ["Pay", " ", "1", "2", "3", "4", "5", "6", "7"]


def test_glm4_and_deepseek_llm_and_coder(model, tiny_tokenizer_dir, tmp_path):
    assert _text(_pieces(model, tiny_tokenizer_dir, tmp_path, "glm4"))[:4] == ["Pay", " ", "123", "456"]
    assert _text(_pieces(model, tiny_tokenizer_dir, tmp_path, "deepseek-llm"))[:3] == ["Pay", " ", "1234567"]
    assert _text(_pieces(model, tiny_tokenizer_dir, tmp_path, "deepseek-coder"))[:4] == ["Pay", " ", "1", "2"]


def test_a_name_transformers_knows_keeps_its_split(model, tiny_tokenizer_dir, tmp_path):
    assert _text(_pieces(model, tiny_tokenizer_dir, tmp_path, "qwen2"))[:4] == ["Pay", " ", "1", "2"]


def test_an_unknown_name_is_logged(model, tiny_tokenizer_dir, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="tessera.weights.gguf_pretokenizers"):
        _pieces(model, tiny_tokenizer_dir, tmp_path, "kimi-k2")
    assert "'kimi-k2' is unknown" in caplog.text
