"""Tessera's Nemotron-H (nemotron_h) against transformers on tiny random checkpoints: blocks
of one mixer each (Mamba-2 with two groups of heads or one, attention without rotary, a
relu-squared MLP without gate), float32 norm weights, a time-step floor (time_step_min)
that clamps, the checkpoint's backbone.* names, and Nemotron 3's mixture of experts (DeepSeek-V3
routing, gateless experts, with and without a latent width, a shared expert). Mamba-2 itself, and the recurrent
state's life, are tested with Granite 4.0 and Qwen3.5 (test_granite_hybrid.py,
test_qwen3_next.py)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.models.parity import VOCAB, Case, RecurrentStateChecks, draw_hybrid_parameters, make_tiny, recurrent_case

pytestmark = pytest.mark.usefixtures("one_thread")

BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, mamba_num_heads=4,
            mamba_head_dim=32, ssm_state_size=16, tie_word_embeddings=False, time_step_min=0.3,
            layers_block_type=["linear_attention", "mlp", "full_attention", "linear_attention", "mlp"])
MOE = dict(layers_block_type=["linear_attention", "moe", "full_attention", "linear_attention", "moe"], n_routed_experts=8,
           num_experts_per_tok=2, moe_intermediate_size=32, moe_shared_expert_intermediate_size=48, n_group=2,
           topk_group=1, routed_scaling_factor=2.5)
CASES = {"nemotron-h-two-groups": dict(n_groups=2), "nemotron-h-one-group": dict(n_groups=1),
         # Nemotron 3: DeepSeek-V3 routing over gateless experts, in a latent width of 24, and a shared one
         "nemotron-3-moe-latent": dict(MOE, n_groups=1, moe_latent_size=24),
         "nemotron-3-moe": dict(MOE, n_groups=2)}


def make_tiny_nemotron_h(case: str, folder: Path, tokenizer_dir: Path, seed: int = 0, **overrides) -> torch.nn.Module:
    from transformers import NemotronHConfig, NemotronHForCausalLM

    return make_tiny(folder, tokenizer_dir, NemotronHConfig, NemotronHForCausalLM, seed=seed,
                     base={**BASE, **CASES[case], **overrides}, tweak=draw_hybrid_parameters)


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def case(request, tmp_path_factory, tiny_tokenizer_dir) -> Case:
    return recurrent_case(request.param, tmp_path_factory, tiny_tokenizer_dir, make_tiny_nemotron_h)


def test_blocks_and_the_time_step_floor(case: Case):
    model = case.llm.engine.runner.model
    ffn = "NemotronHMoE" if "moe" in case.name else "NemotronHMLP"
    assert [type(b.mixer).__name__ for b in model.model.layers] == [
        "Mamba2Mixer", ffn, "NemotronHAttention", "Mamba2Mixer", ffn]
    assert model.model.layers[0].mixer.core.limits == (pytest.approx(0.3), float("inf"))
    torch.testing.assert_close(model.model.layers[0].norm.weight, case.hf.model.layers[0].norm.weight.float())


class TestParity(RecurrentStateChecks):
    pass
