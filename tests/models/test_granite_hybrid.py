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

from tessera import LLM

from tests.models.parity import (VOCAB, Case, check_bf16_close, check_chunked_prefill,
                                 check_greedy_alone_and_batched, check_prefill_and_decode_logits,
                                 check_second_turn_restores_state, draw_hybrid_parameters, make_tiny)

pytestmark = pytest.mark.usefixtures("one_thread")

NUM_KV_BLOCKS = 64
PROMPT_LENGTHS = (5, 23, 90)  # 90: two scan blocks of 64 in one prefill
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
    folder = tmp_path_factory.mktemp(request.param)
    hf = make_tiny_granite_hybrid(request.param, folder, tiny_tokenizer_dir, seed=len(request.param))
    # without prefix caching, which cuts prompts at a block boundary (the checks assert steps)
    llm = LLM(folder, dtype="float32", num_kv_blocks=NUM_KV_BLOCKS, enable_prefix_caching=False, show_progress=False)
    return Case(request.param, folder, hf, llm)


def test_layers(case: Case):
    engine = case.llm.engine
    layers = engine.runner.model.model.layers
    assert [layer.is_mamba for layer in layers] == [True, False, True, True]
    assert len(engine.runner.attn_layers) == 1 and len(engine.runner.state_layers) == 3
    conv, ssm = engine.runner.state_layers[0].state
    assert ssm.shape[1:] == (4, 32, 16) and ssm.dtype == torch.float32
    torch.testing.assert_close(layers[0].mamba.D, case.hf.model.layers[0].mamba.D)


def test_prefill_and_decode_logits_match(case: Case, monkeypatch):
    check_prefill_and_decode_logits(case.llm, case.hf, case.name, monkeypatch)


def test_greedy_matches_hf_generate_alone_and_batched(case: Case):
    check_greedy_alone_and_batched(case.llm, case.hf, PROMPT_LENGTHS)


def test_chunked_prefill_matches(case: Case, monkeypatch):
    check_chunked_prefill(case.folder, case.llm, case.hf, case.name, monkeypatch, NUM_KV_BLOCKS, PROMPT_LENGTHS)


def test_second_turn_restores_the_mamba_state(case: Case):
    check_second_turn_restores_state(case.folder, case.hf, NUM_KV_BLOCKS)

def test_bf16_stays_close(case: Case):
    check_bf16_close(case.folder, case.hf, NUM_KV_BLOCKS, prompt_len=80, new_tokens=8)