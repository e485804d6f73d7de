"""`--load-format dummy`: a folder holding only config.json (no weights) serves at its
real shapes with seeded random weights: every parameter filled, finite outputs, the same
tokens twice, and nothing read from a checkpoint."""
from __future__ import annotations

import pytest
import torch

from tessera import LLM
from tessera.sampling.params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def config_only(tmp_path, make_tiny_llama):
    """A tiny llama's config.json alone, plus a separate tokenizer folder."""
    folder, _ = make_tiny_llama(seed=4)
    bare = tmp_path / "config-only"
    bare.mkdir()
    (bare / "config.json").write_text((folder / "config.json").read_text())
    return bare, folder


def test_config_alone_serves_with_dummy_weights(config_only):
    bare, tokenizer_folder = config_only
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    runs = []
    for _ in range(2):
        llm = LLM(bare, tokenizer=str(tokenizer_folder), load_format="dummy", dtype="float32",
                  num_kv_blocks=32, show_progress=False)
        model = llm.engine.model
        assert all(p.abs().sum() > 0 and torch.isfinite(p).all() for p in model.parameters())
        assert all(p.abs().max() <= 0.02 for p in model.parameters())
        out = llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)[0].outputs[0]
        assert len(out.token_ids) == 12
        runs.append(out.token_ids)
    assert runs[0] == runs[1]  # seeded


def test_without_dummy_a_folder_without_weights_is_an_error(config_only):
    bare, tokenizer_folder = config_only
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        LLM(bare, tokenizer=str(tokenizer_folder), dtype="float32", num_kv_blocks=8, show_progress=False)


def test_bad_load_format_is_a_config_error():
    from tessera.config import ModelConfig

    with pytest.raises(ValueError, match="load_format must be one of"):
        ModelConfig(load_format="pt")


def test_cli_generate_with_dummy_weights(config_only, capsys):
    from tessera.cli import main

    bare, tokenizer_folder = config_only
    assert main(["generate", "hello", "--model", str(bare), "--tokenizer", str(tokenizer_folder),
                 "--load-format", "dummy", "--dtype", "float32", "--num-kv-blocks", "16",
                 "--max-new-tokens", "3", "--ignore-eos"]) == 0
    assert "[1 prompts, 3 tokens generated" in capsys.readouterr().err


def test_fallback_model_from_its_config_alone(tmp_path, tiny_tokenizer_dir):
    from tests.models.parity import make_tiny
    from tests.models.test_transformers_fallback import _olmo

    config_cls, model_cls, overrides = _olmo()
    folder = tmp_path / "olmo"
    make_tiny(folder, tiny_tokenizer_dir, config_cls, model_cls, **overrides)
    bare = tmp_path / "olmo-config"
    bare.mkdir()
    (bare / "config.json").write_text((folder / "config.json").read_text())
    llm = LLM(bare, tokenizer=str(folder), load_format="dummy", dtype="float32", num_kv_blocks=16,
              show_progress=False)
    assert type(llm.engine.router).__name__ == "TransformersRouter"
    assert all(p.abs().max() <= 0.02 for p in llm.engine.model.parameters())
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 4
