"""Tessera's Bamba against transformers on tiny random checkpoints: Mamba-2 layers (one or
two groups; decay, time steps and skips drawn to matter) around Llama attention layers
with rotary over half of each head, SwiGLU MLPs after every layer. The recurrent state's
life is tested with Qwen3.5 (test_qwen3_next.py); the same machinery carries it here."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.models.parity import VOCAB, Case, RecurrentStateChecks, draw_hybrid_parameters, make_tiny, recurrent_case

pytestmark = pytest.mark.usefixtures("one_thread")

BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0,
            mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16, mamba_expand=2, tie_word_embeddings=False)
CASES = {
    "bamba-two-groups": dict(attn_layer_indices=[1], mamba_n_groups=2),
    "bamba-one-group-tied": dict(attn_layer_indices=[0, 3], mamba_n_groups=1, tie_word_embeddings=True),
}


def make_tiny_bamba(case: str, folder: Path, tokenizer_dir: Path, seed: int = 0) -> torch.nn.Module:
    from transformers import BambaConfig, BambaForCausalLM

    return make_tiny(folder, tokenizer_dir, BambaConfig, BambaForCausalLM, seed=seed, base={**BASE, **CASES[case]},
                     tweak=draw_hybrid_parameters)


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def case(request, tmp_path_factory, tiny_tokenizer_dir) -> Case:
    return recurrent_case(request.param, tmp_path_factory, tiny_tokenizer_dir, make_tiny_bamba)


def test_layers(case: Case):
    engine = case.llm.engine
    layers = engine.runner.model.model.layers
    attention = case.hf.config.attn_layer_indices
    assert [not layer.is_mamba for layer in layers] == [i in attention for i in range(4)]
    assert len(engine.runner.attn_layers) == len(attention)
    rotary = next(layer.self_attn.rotary for layer in layers if not layer.is_mamba)
    assert rotary.rotary_dim == 8  # half of each 16-wide head
    torch.testing.assert_close(layers[1].feed_forward.down_proj.weight, case.hf.model.layers[1].feed_forward.down_proj.weight)


class TestParity(RecurrentStateChecks):
    pass
