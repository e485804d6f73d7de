"""What the transformers fallback refuses, and head scalings it must apply as each model's
own forward does: models whose attention bypasses transformers' attention interface
(Falcon, Mamba) and hybrids with state-space layers (Granite 4) are refused before loading; attention sinks (gpt-oss) are refused rather
than dropped; HyperCLOVAX multiplies its logits by logits_scaling where Granite divides."""
from __future__ import annotations

import pytest
import torch

from tessera import LLM
from tests.models.parity import BASE, check_greedy_and_logprobs, make_tiny, prompt_ids

pytestmark = pytest.mark.usefixtures("one_thread")


def load(folder, **options) -> LLM:
    return LLM(folder, dtype="float32", num_kv_blocks=32, show_progress=False, **options)


@pytest.mark.parametrize("kind", ["falcon", "mamba"])
def test_models_that_compute_attention_themselves_are_refused(kind, tiny_tokenizer_dir, tmp_path):
    import transformers as T

    config_cls, model_cls = {"falcon": (T.FalconConfig, T.FalconForCausalLM),
                             "mamba": (T.MambaConfig, T.MambaForCausalLM)}[kind]
    make_tiny(tmp_path, tiny_tokenizer_dir, config_cls, model_cls, base=dict(
        vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4))
    with pytest.raises(ValueError, match="attention interface"):
        load(tmp_path)


def test_hybrid_state_space_models_are_refused_before_loading(tiny_tokenizer_dir, tmp_path):
    """Granite 4's hybrid (Mamba-2 and attention layers; native, tests/models/test_granite_hybrid.py):
    the fallback would run its Mamba layers without their state between steps, so it
    refuses from the config, naming them."""
    import transformers as T

    make_tiny(tmp_path, tiny_tokenizer_dir, T.GraniteMoeHybridConfig, T.GraniteMoeHybridForCausalLM, base={
        **BASE, "layer_types": ["mamba", "attention"], "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_state": 16,
        "mamba_n_groups": 1, "mamba_expand": 1, "num_local_experts": 0, "shared_intermediate_size": 96})
    with pytest.raises(ValueError, match="recurrent state between steps"):
        load(tmp_path, model_impl="transformers")


def test_attention_sinks_are_refused_not_dropped(tiny_tokenizer_dir, tmp_path):
    import transformers as T

    make_tiny(tmp_path, tiny_tokenizer_dir, T.GptOssConfig, T.GptOssForCausalLM,
              base={**BASE, "num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 16,
                    "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]})
    # gpt-oss is native (tests/models/test_gpt_oss.py); its fallback must still refuse
    with pytest.raises(ValueError, match="attention sinks"):
        load(tmp_path, model_impl="transformers")


@pytest.mark.parametrize("kind", ["hyperclovax", "granite"])
def test_logits_scaling_follows_the_models_own_forward(kind, tiny_tokenizer_dir, tmp_path):
    import transformers as T

    config_cls, model_cls = {"hyperclovax": (T.HyperCLOVAXConfig, T.HyperCLOVAXForCausalLM),
                             "granite": (T.GraniteConfig, T.GraniteForCausalLM)}[kind]
    hf = make_tiny(tmp_path, tiny_tokenizer_dir, config_cls, model_cls, base={**BASE, "logits_scaling": 4.0})
    with torch.no_grad():
        assert hf.config.logits_scaling == 4.0
    check_greedy_and_logprobs(load(tmp_path), hf, [prompt_ids(9, 1), prompt_ids(20, 2)], 6)
