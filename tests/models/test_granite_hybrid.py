"""Tessera's Granite 4.0 hybrids (granitemoehybrid) against transformers on tiny random
checkpoints: Mamba-2 layers (two groups of heads, or one group whose B and C every head
shares; decay, time steps and skips drawn to matter) around an attention layer without
rotary (the -H releases) or with it, Granite's four multipliers, and experts with a shared
MLP, or the shared MLP alone. The recurrent state's life (chunks, batches, preemption,
prefix-cache snapshots) is tested with Qwen3.5 in test_qwen3_next.py; here the same
machinery carries Mamba-2's state."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.models.parity import VOCAB, Case, RecurrentStateChecks, draw_hybrid_parameters, make_tiny, recurrent_case

pytestmark = pytest.mark.usefixtures("one_thread")

BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
            layer_types=["mamba", "attention", "mamba", "mamba"], mamba_n_heads=4, mamba_d_head=32,
            mamba_d_state=16, mamba_expand=2, shared_intermediate_size=48, tie_word_embeddings=False,
            embedding_multiplier=2.0, attention_multiplier=0.2, residual_multiplier=0.5, logits_scaling=3.0)
CASES = {
    "granite-4.0-h-moe-nope": dict(num_local_experts=4, num_experts_per_tok=2, mamba_n_groups=2,
                                   position_embedding_type=None),
    "granite-hybrid-dense-rope": dict(num_local_experts=0, mamba_n_groups=1, position_embedding_type="rope"),
}


def make_tiny_granite_hybrid(case: str, folder: Path, tokenizer_dir: Path, seed: int = 0) -> torch.nn.Module:
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    return make_tiny(folder, tokenizer_dir, GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM, seed=seed,
                     base={**BASE, **CASES[case]}, tweak=draw_hybrid_parameters)


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def case(request, tmp_path_factory, tiny_tokenizer_dir) -> Case:
    return recurrent_case(request.param, tmp_path_factory, tiny_tokenizer_dir, make_tiny_granite_hybrid)


def test_layers(case: Case):
    engine = case.llm.engine
    layers = engine.runner.model.model.layers
    assert [layer.is_mamba for layer in layers] == [True, False, True, True]
    assert len(engine.runner.attn_layers) == 1 and len(engine.runner.state_layers) == 3
    conv, ssm = engine.runner.state_layers[0].state
    assert ssm.shape[1:] == (4, 32, 16) and ssm.dtype == torch.float32
    torch.testing.assert_close(layers[0].mamba.D, case.hf.model.layers[0].mamba.D)


class TestParity(RecurrentStateChecks):
    pass
