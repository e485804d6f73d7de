"""Tessera's LFM2 (lfm2) and LFM2-MoE (lfm2_moe) against transformers on tiny random
checkpoints: gated short convolutions (biased, their last inputs kept per sequence as
recurrent state) between attention layers with per-head q / k norms, the SwiGLU MLP sized
by transformers' block_auto_adjust_ff_dim rule, or experts routed by sigmoid scores with a
choice bias. The state's life (chunks, snapshots) is tested at length
with Qwen3.5 (test_qwen3_next.py); here the same machinery carries the convolution's."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.models.parity import VOCAB, Case, RecurrentStateChecks, draw_hybrid_parameters, make_tiny, recurrent_case

pytestmark = pytest.mark.usefixtures("one_thread")

BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
            layer_types=["conv", "full_attention", "conv", "conv"], block_multiple_of=32)
CASES = {"lfm2-biased-conv": dict(conv_bias=True, tie_word_embeddings=False),
         "lfm2-tied": dict(conv_bias=False, tie_word_embeddings=True),
         # LFM2-MoE: a dense first layer, then experts routed by sigmoid scores plus a choice bias
         "lfm2-moe": dict(tie_word_embeddings=False, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                          num_dense_layers=1, routed_scaling_factor=1.5)}


def make_tiny_lfm2(case: str, folder: Path, tokenizer_dir: Path, seed: int = 0, **overrides) -> torch.nn.Module:
    import transformers

    kind = "Lfm2Moe" if case.endswith("moe") else "Lfm2"
    return make_tiny(folder, tokenizer_dir, getattr(transformers, f"{kind}Config"),
                     getattr(transformers, f"{kind}ForCausalLM"), seed=seed, base={**BASE, **CASES[case]},
                     tweak=draw_hybrid_parameters, **overrides)


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def case(request, tmp_path_factory, tiny_tokenizer_dir) -> Case:
    return recurrent_case(request.param, tmp_path_factory, tiny_tokenizer_dir, make_tiny_lfm2)


def test_layers_and_feed_forward_size(case: Case):
    runner = case.llm.engine.runner
    assert len(runner.attn_layers) == 1 and len(runner.state_layers) == 3
    assert runner.state_layers[0].state[0].shape[1:] == (64, 2)  # conv_L_cache 3: the last 2 inputs
    # LFM2: int(2 * 96 / 3) = 64, rounded up to block_multiple_of 32; LFM2-MoE's dense layer: 96
    assert runner.model.model.layers[0].mlp.down_proj.weight.shape[-1] == case.hf.model.layers[0].feed_forward.w2.in_features


class TestParity(RecurrentStateChecks):
    pass
