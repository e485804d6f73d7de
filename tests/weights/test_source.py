"""Where a model comes from, and the name it is served under: the --model string exactly as
given (vLLM's default served_model_name)."""
from __future__ import annotations

import pytest

from tessera.weights.source import ModelNotFoundError, resolve_model_source


def test_a_model_is_served_under_the_name_it_was_given(make_tiny_llama, monkeypatch, tmp_path):
    folder, _ = make_tiny_llama()
    assert resolve_model_source(str(folder)).name == str(folder)
    assert resolve_model_source(str(folder) + "/").name == str(folder) + "/"  # exactly, as vLLM
    monkeypatch.chdir(folder.parent)
    assert resolve_model_source(folder.name).name == folder.name


def test_a_gguf_in_capitals_is_a_gguf(default_gguf, tmp_path):
    upper = tmp_path / "model.GGUF"
    upper.symlink_to(default_gguf)
    assert resolve_model_source(str(upper)).kind == "gguf"
    assert resolve_model_source(str(tmp_path)).kind == "gguf"  # a folder holding one


def test_a_missing_model_says_tessera_does_not_download(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not download"):
        resolve_model_source("meta-llama/Llama-3-8B")
