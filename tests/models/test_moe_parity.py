"""Tessera's Mixtral and Qwen3-MoE against transformers' on tiny random checkpoints.

Both are the Llama (Qwen3) stack with a sparse mixture-of-experts MLP swapped in
(tessera/ops/moe.py): 4 experts, top-2. Mixtral always renormalises the top-k weights;
Qwen3-MoE only with norm_topk_prob, so one case has it off. One Qwen3-MoE case keeps a
dense MLP in a layer (mlp_only_layers). Router weights are drawn large enough that tokens
really spread over experts; norms are randomised. Same float32 tolerance as test_llama_parity.py (FP32_ATOL, tests/models/parity.py).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tessera import LLM
from tessera.models.registry import router_classes
from tessera.ops.moe import SparseMoE
from tessera.weights import WeightLoadError, load_weights
from tessera.weights.safetensors import iter_hf_weights

from tests.models.parity import (VOCAB, Case, check_greedy_alone_and_batched,
                                 check_prefill_and_decode_logits)

pytestmark = pytest.mark.usefixtures("one_thread")

NUM_KV_BLOCKS = 64
PROMPT_LENGTHS = (5, 23, 47)

BASE = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
            bos_token_id=1, eos_token_id=2, initializer_range=0.1, tie_word_embeddings=False,
            num_experts_per_tok=2)
CASES = {
    "mixtral": ("mixtral", dict(num_local_experts=4, intermediate_size=96)),
    # norm_topk_prob off, layer 1 dense (intermediate_size), head_dim not hidden / heads
    "qwen3_moe-dense-layer": ("qwen3_moe", dict(num_experts=4, moe_intermediate_size=48,
                                                intermediate_size=80, norm_topk_prob=False,
                                                mlp_only_layers=[1], head_dim=24)),
    "qwen3_moe-renorm-tied": ("qwen3_moe", dict(num_experts=4, moe_intermediate_size=48,
                                                intermediate_size=80, norm_topk_prob=True,
                                                tie_word_embeddings=True)),
}


def make_tiny_moe(folder: Path, tokenizer_dir: Path, kind: str, seed: int = 0,
                  **overrides) -> torch.nn.Module:
    """Saves a random transformers Mixtral/Qwen3MoeForCausalLM (+ the tiny tokenizer) to
    `folder`; returns the float32 eval-mode model."""
    from transformers import (AutoTokenizer, MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig,
                              Qwen3MoeForCausalLM)

    config_cls, model_cls = {"mixtral": (MixtralConfig, MixtralForCausalLM),
                             "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM)}[kind]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**BASE, **overrides})).eval()
    g = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith(".gate.weight"):  # the router: decisive, varied choices
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(folder)
    return model


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def case(request, tmp_path_factory, tiny_tokenizer_dir) -> Case:
    kind, overrides = CASES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    hf = make_tiny_moe(folder, tiny_tokenizer_dir, kind, seed=len(request.param), **overrides)
    llm = LLM(folder, dtype="float32", num_kv_blocks=NUM_KV_BLOCKS, show_progress=False)
    return Case(request.param, folder, hf, llm)


def hf_moe_block(hf_layer: torch.nn.Module) -> torch.nn.Module | None:
    block = getattr(hf_layer, "block_sparse_moe", None) or hf_layer.mlp
    return block if hasattr(block, "experts") else None


def test_checkpoint_has_what_the_case_claims(case: Case):
    """Guards the fixtures: stacked experts equal transformers' fused ones, dense layers
    stay dense, and the checkpoint really stores one tensor per expert."""
    model = case.llm.engine.runner.model
    kind, overrides = CASES[case.name]
    assert type(model).__name__ == type(case.hf).__name__
    names = [n for n, _ in iter_hf_weights(case.folder)]
    assert any(".experts.3." in n for n in names)
    for ours, theirs in zip(model.model.layers, case.hf.model.layers):
        block = hf_moe_block(theirs)
        assert isinstance(ours.mlp, SparseMoE) == (block is not None)
        if block is None:
            continue
        assert ours.mlp.renormalize == (kind == "mixtral" or overrides["norm_topk_prob"])
        torch.testing.assert_close(ours.mlp.experts.w13_weight, block.experts.gate_up_proj)
        torch.testing.assert_close(ours.mlp.experts.w2_weight, block.experts.down_proj)
        torch.testing.assert_close(ours.mlp.gate.weight, block.gate.weight)
    dense = overrides.get("mlp_only_layers", [])
    assert [i for i, l in enumerate(model.model.layers) if not isinstance(l.mlp, SparseMoE)] == dense


def test_prefill_and_decode_logits_match(case: Case, monkeypatch):
    check_prefill_and_decode_logits(case.llm, case.hf, case.name, monkeypatch)


def test_greedy_matches_hf_generate_alone_and_batched(case: Case):
    check_greedy_alone_and_batched(case.llm, case.hf, PROMPT_LENGTHS)


def test_missing_expert_is_a_load_error(case: Case):
    model = case.llm.engine.runner.model
    weights = [(n, t) for n, t in iter_hf_weights(case.folder) if ".layers.0." not in n
               or ".experts.2." not in n or not n.endswith(("w3.weight", "up_proj.weight"))]
    with pytest.raises(WeightLoadError, match=r"layers\.0\.mlp\.experts\.w13_weight \(shards \['\(2, 1\)'\]\)"):
        load_weights(model, weights)


def test_routed_by_model_type():
    routers = router_classes()
    assert routers["mixtral"].__name__ == "MixtralRouter" and routers["mixtral"].is_moe
    assert routers["qwen3_moe"].__name__ == "Qwen3MoeRouter" and routers["qwen3_moe"].is_moe


def test_mixtral_sliding_window_config_is_refused(tmp_path, tiny_tokenizer_dir):
    make_tiny_moe(tmp_path, tiny_tokenizer_dir, "mixtral", **CASES["mixtral"][1], sliding_window=16)
    with pytest.raises(ValueError, match="sliding window attention is not supported yet"):
        LLM(tmp_path, dtype="float32", num_kv_blocks=NUM_KV_BLOCKS, show_progress=False)
