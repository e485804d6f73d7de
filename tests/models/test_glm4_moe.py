"""Tessera's GLM-4.5 family (glm4_moe) against transformers' on tiny random checkpoints:
GQA attention with Q / K / V biases and rotary over half of each head (rotate-half), with and
without the per-head query / key norms, a dense first layer, DeepSeek-V3's sigmoid routing
(correction bias, group choice, renormalised and scaled weights) with shared experts, and
the multi-token-prediction layer skipped at load. Router weights and biases are drawn large
enough that tokens spread over experts and groups; norms are randomised."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tessera import LLM
from tessera.models.deepseek.moe import DeepseekMoE
from tessera.models.glm4_moe.modeling import Glm4MoeHeadNormAttention
from tests.models.parity import VOCAB, Case, LogitParity, check_prefill_and_decode_logits, make_tiny, tiny_case
from tests.models.test_deepseek import _decisive_routers

pytestmark = pytest.mark.usefixtures("one_thread")

NUM_KV_BLOCKS = 64
PROMPT_LENGTHS = (5, 23, 47)
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts_per_tok=2, n_routed_experts=8,
            n_shared_experts=1, first_k_dense_replace=1, max_position_embeddings=512, rms_norm_eps=1e-6,
            bos_token_id=1, eos_token_id=2, initializer_range=0.1, tie_word_embeddings=False, attention_bias=True,
            num_nextn_predict_layers=0,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
CASES = {  # GLM-4.5 / 4.6's shape (one group, renormalised, scaled); qk norm as GLM-4.5's config can ask
    "glm45": dict(n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5, use_qk_norm=False),
    "qk-norm-groups": dict(n_group=4, topk_group=2, norm_topk_prob=False, routed_scaling_factor=1.0,
                           use_qk_norm=True),
}


def _routers_and_biases(model: torch.nn.Module, g: torch.Generator) -> None:
    _decisive_routers(model, g)
    for name, p in model.named_parameters():
        if name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
            p.copy_(0.2 * torch.randn(p.shape, generator=g))


def make_tiny_glm4_moe(folder: Path, tokenizer_dir: Path, seed: int = 0, **overrides) -> torch.nn.Module:
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    return make_tiny(folder, tokenizer_dir, Glm4MoeConfig, Glm4MoeForCausalLM, seed=seed, base=BASE,
                     tweak=_routers_and_biases, **overrides)


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def case(request, tmp_path_factory, tiny_tokenizer_dir) -> Case:
    return tiny_case(request.param, tmp_path_factory, tiny_tokenizer_dir, lambda folder, tokenizer_dir, name:
                     make_tiny_glm4_moe(folder, tokenizer_dir, seed=len(name), **CASES[name]), NUM_KV_BLOCKS)


def test_layers_are_what_the_config_says(case: Case):
    """A dense first layer, experts after; head norms where use_qk_norm; half of each head
    turned; the routers spread tokens over several experts."""
    model = case.llm.engine.runner.model
    for i, layer in enumerate(model.model.layers):
        assert isinstance(layer.mlp, DeepseekMoE) == (i >= 1)
        assert isinstance(layer.self_attn, Glm4MoeHeadNormAttention) == case.hf.config.use_qk_norm
        assert layer.self_attn.rotary.rotary_dim == 8
    _, ids = model.model.layers[-1].mlp.gate(torch.randn(64, 64))
    assert len(ids.unique()) >= 4


class TestParity(LogitParity):
    num_kv_blocks, prompt_lengths = NUM_KV_BLOCKS, PROMPT_LENGTHS


def test_multi_token_prediction_layers_are_skipped(tmp_path, tiny_tokenizer_dir, monkeypatch):
    """The released checkpoints carry their MTP module as layer num_hidden_layers (with its
    own eh_proj / enorm / hnorm / shared_head tensors); it is not loaded."""
    hf = make_tiny_glm4_moe(tmp_path, tiny_tokenizer_dir, seed=3, **CASES["glm45"])
    tensors = load_file(tmp_path / "model.safetensors")
    mtp = {name.replace("model.layers.2.", "model.layers.3."): t.clone() for name, t in tensors.items()
           if name.startswith("model.layers.2.")}
    save_file({**tensors, **mtp, "model.layers.3.eh_proj.weight": torch.zeros(64, 128),
               "model.layers.3.enorm.weight": torch.ones(64)}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (tmp_path / "config.json").write_text(json.dumps(config))
    llm = LLM(tmp_path, dtype="float32", num_kv_blocks=NUM_KV_BLOCKS, show_progress=False)
    check_prefill_and_decode_logits(llm, hf, "glm4_moe-mtp", monkeypatch)
