"""`tessera bench --preset`: published configs written locally (nothing downloaded), loadable
by transformers and by tessera's router with the default model's tokenizer; the baseline
builds the same shapes from the config when the engine runs dummy weights."""
from __future__ import annotations

import pytest
import torch
from PIL import Image
from transformers import AutoConfig, AutoTokenizer

from tessera.bench.presets import IMAGE_PRESETS, PRESETS, write_preset
from tessera.bench.transformers_baseline import load_transformers_model
from tessera.cli import main
from tessera.config import ModelConfig
from tessera.weights.source import ModelSource


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_write_a_loadable_config_and_tokenizer(name, tmp_path, default_gguf):
    # the tokenizer comes from the default model's metadata in the usual cache
    folder = write_preset(name, ModelConfig().cache_dir, folder=tmp_path / name)
    assert folder == tmp_path / name
    config = AutoConfig.from_pretrained(folder)
    text = config.get_text_config()  # a multimodal config keeps these in its text_config
    published = PRESETS[name].get("text_config", PRESETS[name])
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_key_value_heads", "vocab_size"):
        if key in published:  # (encoders have no key-value head count)
            assert getattr(text, key) == published[key]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer.encode("hello") != []
    if name in IMAGE_PRESETS:  # its image tokens are the tokenizer's, and its processor loads
        tokens = IMAGE_PRESETS[name].tokens
        assert {getattr(config, key) for key in tokens} == {tokenizer.convert_tokens_to_ids(t) for t in tokens.values()}
        assert len(set(tokenizer.convert_tokens_to_ids(t) for t in tokens.values())) == len(tokens)
        from tessera.models.registry import get_router
        router = get_router(ModelConfig(model=str(folder)))
        ids, images = router.image_prompts(f"a {router.image_prompts.placeholder}", [Image.new("RGB", (448, 448))])
        # Qwen: (448 / 14 / 2) ** 2; Gemma 3: 256 whatever the size
        assert images.num_features == 256 == ids.count(router.image_token_id)


def test_llama_3_8b_has_its_published_shapes():
    c = PRESETS["llama-3-8b"]
    assert (c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]) == (4096, 14336, 32)
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["vocab_size"]) == (32, 8, 128256)


def test_unknown_preset_and_preset_with_model_are_errors(tmp_path):
    with pytest.raises(ValueError, match="llama-3-8b"):
        write_preset("llama-9", tmp_path)
    with pytest.raises(SystemExit, match="--preset"):
        main(["bench", "latency", "--preset", "llama-3.2-1b", "--model", str(tmp_path)])


def test_dummy_baseline_builds_the_config_without_weights(make_tiny_llama, tmp_path):
    folder, _ = make_tiny_llama(seed=1)
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((folder / "config.json").read_text())
    model = load_transformers_model(ModelSource("hf", bare, "bare"), torch.float32, dummy=True)
    assert model.config.hidden_size == 64 and not model.training
