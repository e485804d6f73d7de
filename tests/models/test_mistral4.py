"""Tessera's Mistral 4 against transformers' on tiny random checkpoints: DeepSeek-V3's latent
attention (with and without a query LoRA, interleaved or half-split rotary) under Mistral's
softmax router (group choice by each group's two best scores, renormalised or not, scaled),
shared experts, a dense first layer, and Llama 4's attention temperature past YaRN's
original context; experts saved as transformers holds them (stacked)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tessera.models.deepseek.mla import MLAttention
from tessera.models.mistral4.modeling import Mistral4MoE

from tests.models.parity import (VOCAB, Case, LogitParity, check_bf16_close, hf_logits, make_tiny, prompt_ids,
                                 tiny_case)

pytestmark = pytest.mark.usefixtures("one_thread")

NUM_KV_BLOCKS = 64
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, num_experts_per_tok=2, n_routed_experts=8,
            first_k_dense_replace=1, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=24,
            max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0,
            initializer_range=0.1, tie_word_embeddings=False)
# a short original context, so that prompts and decodes cross it and the temperature shows
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "mscale": 1.0,
        "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0, "rope_theta": 10000.0,
        "llama_4_scaling_beta": 0.5}
CASES = {
    "yarn-temperature-qlora": dict(q_lora_rank=24, n_group=4, topk_group=2, norm_topk_prob=True,
                                   routed_scaling_factor=2.0, rope_parameters=YARN),
    # (transformers' Mistral 4 turns a partial head only under YaRN, as its checkpoints have it)
    "no-temperature-halves-unnormalised": dict(
        q_lora_rank=None, n_group=1, topk_group=1, norm_topk_prob=False, rope_interleave=False, n_shared_experts=2,
        rope_parameters={**YARN, "factor": 2.0, "original_max_position_embeddings": 256, "llama_4_scaling_beta": 0.0}),
}


def _decisive_routers(model: torch.nn.Module, g: torch.Generator) -> None:
    for name, p in model.named_parameters():
        if name.endswith("mlp.gate.weight"):  # decisive, varied choices
            p.copy_(0.5 * torch.randn(p.shape, generator=g))


def make_tiny_mistral4(folder: Path, tokenizer_dir: Path, seed: int = 0, **overrides) -> torch.nn.Module:
    from transformers import Mistral4Config, Mistral4ForCausalLM

    return make_tiny(folder, tokenizer_dir, Mistral4Config, Mistral4ForCausalLM, seed=seed, base=BASE,
                     tweak=_decisive_routers, **overrides)


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def case(request, tmp_path_factory, tiny_tokenizer_dir) -> Case:
    return tiny_case(request.param, tmp_path_factory, tiny_tokenizer_dir, lambda folder, tokenizer_dir, name:
                     make_tiny_mistral4(folder, tokenizer_dir, seed=len(name), **CASES[name]), NUM_KV_BLOCKS)


class TestParity(LogitParity):
    num_kv_blocks = NUM_KV_BLOCKS


def test_latent_cache_and_layers(case: Case):
    model = case.llm.engine.runner.model
    for i, layer in enumerate(model.model.layers):
        assert isinstance(layer.self_attn, MLAttention) and layer.self_attn.attn.num_kv_heads == 1
        assert isinstance(layer.mlp, Mistral4MoE) == (i >= 1)
    _, ids = model.model.layers[-1].mlp.gate(torch.randn(64, 64))
    assert len(ids.unique()) >= 4


def test_bf16_stays_close(case: Case):
    check_bf16_close(case.folder, case.hf, NUM_KV_BLOCKS)


def test_the_temperature_and_the_groups_matter(case: Case):
    """transformers without the temperature gives other logits, and the group choice picks
    other experts than a plain top k would: the parity above checks both."""
    if case.name != "yarn-temperature-qlora":
        pytest.skip("the case with a temperature and expert groups")
    prompt = prompt_ids(40, seed=4)
    with_temperature = hf_logits(case.hf, prompt)
    case.hf.config.rope_parameters["llama_4_scaling_beta"] = 0.0
    try:
        assert (hf_logits(case.hf, prompt) - with_temperature).abs().max() > 1e-3
    finally:
        case.hf.config.rope_parameters["llama_4_scaling_beta"] = YARN["llama_4_scaling_beta"]
    gate = case.llm.engine.runner.model.model.layers[-1].mlp.gate
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(5))
    _, ids = gate(x)
    plain = torch.nn.functional.linear(x, gate.weight).topk(2, dim=-1)[1]
    assert (ids.sort(-1)[0] != plain.sort(-1)[0]).any(-1).sum() > 0  # (8 of 256 tokens here)
