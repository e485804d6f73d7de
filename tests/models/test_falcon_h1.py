"""Tessera's Falcon-H1 (falcon_h1) against transformers on tiny random checkpoints: Mamba-2 and
attention side by side in every layer, with every muP multiplier set away from 1 (the
mixer's input and its five projection parts, keys, the attention's input and output, the
MLP's gate and output, embeddings, logits), and the three ways the mixer's gate meets its
output (alone, around an RMSNorm per group before or after it)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.models.parity import VOCAB, Case, RecurrentStateChecks, draw_hybrid_parameters, make_tiny, recurrent_case

pytestmark = pytest.mark.usefixtures("one_thread")

BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
            mamba_n_heads=4, mamba_d_head=16, mamba_d_ssm=64, mamba_d_state=16, mamba_n_groups=2,
            tie_word_embeddings=False, lm_head_multiplier=0.5, embedding_multiplier=3.0, mlp_multipliers=[0.7, 1.3],
            key_multiplier=0.8, attention_out_multiplier=0.9, attention_in_multiplier=1.1,
            ssm_multipliers=[0.5, 1.5, 0.8, 1.2, 0.6], ssm_in_multiplier=1.4, ssm_out_multiplier=0.7)
CASES = {"falcon-h1-gate-only": dict(mamba_rms_norm=False),
         "falcon-h1-norm-then-gate": dict(mamba_rms_norm=True, mamba_norm_before_gate=True),
         "falcon-h1-gate-then-norm": dict(mamba_rms_norm=True, mamba_norm_before_gate=False, mamba_n_groups=1)}


def make_tiny_falcon_h1(case: str, folder: Path, tokenizer_dir: Path, seed: int = 0) -> torch.nn.Module:
    from transformers import FalconH1Config, FalconH1ForCausalLM

    return make_tiny(folder, tokenizer_dir, FalconH1Config, FalconH1ForCausalLM, seed=seed,
                     base={**BASE, **CASES[case]}, tweak=draw_hybrid_parameters)


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def case(request, tmp_path_factory, tiny_tokenizer_dir) -> Case:
    return recurrent_case(request.param, tmp_path_factory, tiny_tokenizer_dir, make_tiny_falcon_h1)


def test_every_layer_holds_both_mixers(case: Case):
    runner = case.llm.engine.runner
    assert len(runner.attn_layers) == len(runner.state_layers) == 2


class TestParity(RecurrentStateChecks):
    pass
