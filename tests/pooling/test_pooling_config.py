"""Which checkpoints pool and how: sentence-transformers module files, bare backbones,
--runner and --pooler-config, and the refusals."""
from __future__ import annotations

import json

import pytest

from tessera.config import ConfigError
from tessera.pooling.config import PoolerConfig, looks_like_embedding_model, pooler_config_for
from transformers import PretrainedConfig

from tests.pooling.checkpoints import ST_MODULES, write_sentence_transformers


def hf_config(**kwargs) -> PretrainedConfig:
    return PretrainedConfig(**kwargs)


@pytest.mark.parametrize("pooling", ["LAST", "MEAN", "CLS"])
@pytest.mark.parametrize("normalize", [True, False])
def test_sentence_transformers_modules(tmp_path, pooling, normalize):
    write_sentence_transformers(tmp_path, pooling, normalize)
    config = hf_config(architectures=["Qwen3ForCausalLM"])
    assert looks_like_embedding_model(tmp_path, config)
    assert pooler_config_for(tmp_path, config) == PoolerConfig(pooling, normalize)


def test_runner_auto_pools_bare_backbones_only(tmp_path):
    assert looks_like_embedding_model(tmp_path, hf_config(architectures=["MistralModel"]))
    assert not looks_like_embedding_model(tmp_path, hf_config(architectures=["LlamaForCausalLM"]))
    assert not looks_like_embedding_model(tmp_path, hf_config())
    # nothing said: the last token, normalized (decoder embedders)
    assert pooler_config_for(tmp_path, hf_config()) == PoolerConfig("LAST", True)


def test_override_and_matryoshka(tmp_path):
    write_sentence_transformers(tmp_path, "MEAN", True)
    config = pooler_config_for(tmp_path, hf_config(), {"pooling_type": "cls", "normalize": False,
                                                       "is_matryoshka": True})
    assert config == PoolerConfig("CLS", False, is_matryoshka=True)
    listed = pooler_config_for(tmp_path, hf_config(matryoshka_dimensions=[32, 64]))
    assert listed.is_matryoshka and listed.matryoshka_dimensions == (32, 64)
    with pytest.raises(ConfigError, match="unknown --pooler-config keys"):
        pooler_config_for(tmp_path, hf_config(), {"pooling": "MEAN"})
    with pytest.raises(ConfigError, match="pooling_type must be one of"):
        pooler_config_for(tmp_path, hf_config(), {"pooling_type": "MAX"})
    with pytest.raises(ConfigError, match="normalize must be true or false"):
        pooler_config_for(tmp_path, hf_config(), {"normalize": "yes"})


def test_modules_tessera_does_not_compute_are_refused(tmp_path):
    dense = {"idx": 3, "name": "3", "path": "3_Dense", "type": ST_MODULES + "Dense"}
    write_sentence_transformers(tmp_path, "MEAN", True, extra=[dense])
    with pytest.raises(ConfigError, match="Dense"):
        pooler_config_for(tmp_path, hf_config())


def test_pooling_modes_tessera_does_not_compute_are_refused(tmp_path):
    write_sentence_transformers(tmp_path, "MEAN", False)
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(ConfigError, match="pooling_mode_max_tokens"):
        pooler_config_for(tmp_path, hf_config())
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({}))
    with pytest.raises(ConfigError, match="exactly one pooling mode"):
        pooler_config_for(tmp_path, hf_config())
    (tmp_path / "1_Pooling" / "config.json").unlink()
    with pytest.raises(ConfigError, match="is missing"):
        pooler_config_for(tmp_path, hf_config())


def test_engine_refusals(make_embedder, make_tiny_llama):
    from tessera import LLM

    embedder = make_embedder("qwen3", "LAST", True)
    with pytest.raises(ConfigError, match="speculate"):
        LLM(embedder.folder, dtype="float32", show_progress=False,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    folder, _ = make_tiny_llama(seed=6)
    with pytest.raises(ConfigError, match="--pooler-config applies to embedding models"):
        LLM(folder, dtype="float32", show_progress=False, pooler_config={"normalize": False})
    with pytest.raises(ConfigError, match="run native models"):
        LLM(folder, dtype="float32", show_progress=False, runner="pooling", model_impl="transformers")


def test_named_prompts(tmp_path):
    prompts = {"query": "Instruct: retrieve\nQuery:", "document": ""}
    (tmp_path / "config_sentence_transformers.json").write_text(json.dumps({"prompts": prompts}))
    assert pooler_config_for(tmp_path, hf_config()).prompts == prompts
    (tmp_path / "config_sentence_transformers.json").write_text(json.dumps({"prompts": {"query": 3}}))
    with pytest.raises(ConfigError, match="should map names to texts"):
        pooler_config_for(tmp_path, hf_config())
