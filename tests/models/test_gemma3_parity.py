"""Tessera's Gemma 3 (text) against transformers' Gemma3ForCausalLM on tiny random checkpoints:
Gemma 2's layer plus a (1 + w) RMSNorm on every query and key head, and one rotary table per
layer type (sliding layers theta 10k; full layers another theta and linear scaling), with a
sliding window (8) shorter than prompt + generation. The rotary choices are made to matter:
a model that used one table for every layer, or swapped them, fails (checked below). Same
float32 tolerance as the other parity tests (tests/models/parity.py). transformers' Gemma 3
ignores attn_logit_softcapping (only the final soft-cap applies), and so does tessera's."""
from __future__ import annotations

import pytest
import torch

from tessera.models.registry import router_classes
from tests.models.parity import (VOCAB, Case, check_chunked_prefill, check_greedy_alone_and_batched,
                                 check_prefill_and_decode_logits, make_tiny, tiny_case)

pytestmark = pytest.mark.usefixtures("one_thread")

NUM_KV_BLOCKS = 64
PROMPT_LENGTHS = (5, 23, 47)
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100.0}}
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
            rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.1,
            query_pre_attn_scalar=24, sliding_window=8, layer_types=LAYER_TYPES, rope_parameters=ROPE)
CASES = {
    "gemma3-tied": {},
    "gemma3-untied-softcap": dict(tie_word_embeddings=False, attn_logit_softcapping=1.5,
                                  final_logit_softcapping=2.0),
}


def make(folder, tokenizer_dir, name: str, **overrides):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    return make_tiny(folder, tokenizer_dir, Gemma3TextConfig, Gemma3ForCausalLM, seed=len(name), base=BASE,
                     attn_implementation="eager", **{**CASES.get(name, {}), **overrides})


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def case(request, tmp_path_factory, tiny_tokenizer_dir) -> Case:
    return tiny_case(request.param, tmp_path_factory, tiny_tokenizer_dir, make, NUM_KV_BLOCKS)


def test_checkpoint_has_what_the_case_claims(case: Case):
    model = case.llm.engine.runner.model
    assert type(model).__name__ == "Gemma3ForCausalLM"
    windows = [layer.self_attn.attn.sliding_window for layer in model.model.layers]
    assert windows == [8, 8, None, 8]
    assert model.model.layers[0].self_attn.attn.scale == 24 ** -0.5
    hf_norm = case.hf.model.layers[1].self_attn.k_norm.weight
    torch.testing.assert_close(model.model.layers[1].self_attn.k_norm.weight, 1 + hf_norm)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == case.hf.config.tie_word_embeddings


def test_prefill_and_decode_logits_match(case: Case, monkeypatch):
    check_prefill_and_decode_logits(case.llm, case.hf, case.name, monkeypatch)


def test_greedy_matches_hf_generate_alone_and_batched(case: Case):
    check_greedy_alone_and_batched(case.llm, case.hf, PROMPT_LENGTHS)


def test_chunked_prefill_matches(case: Case, monkeypatch):
    check_chunked_prefill(case.folder, case.llm, case.hf, case.name, monkeypatch, NUM_KV_BLOCKS,
                          PROMPT_LENGTHS)


def test_per_layer_rotary_matters(tmp_path, tiny_tokenizer_dir):
    """The same weights with one rotary table for every layer give other logits, so the
    parity above really checks that each layer type gets its own."""
    from tessera.ops.rotary import rope_parameters

    hf = make(tmp_path / "a", tiny_tokenizer_dir, "gemma3-tied")
    same = make(tmp_path / "b", tiny_tokenizer_dir, "gemma3-tied",
                rope_parameters={kind: ROPE["sliding_attention"] for kind in ROPE})
    same.load_state_dict(hf.state_dict())
    ids = torch.randint(3, VOCAB, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (hf(ids).logits - same(ids).logits).abs().max() > 1e-2
    assert rope_parameters(hf.config) is not None  # a nested config still reads as a dict


def test_transformers4_style_config(tmp_path, tiny_tokenizer_dir):
    """Older Gemma 3 configs: rope_theta + rope_scaling for full layers, rope_local_base_freq
    for sliding ones."""
    from types import SimpleNamespace

    from tessera.models.gemma3.modeling import layer_rope_parameters

    old = SimpleNamespace(rope_theta=1e6, rope_scaling={"rope_type": "linear", "factor": 8.0},
                          rope_local_base_freq=10000.0, max_position_embeddings=512)
    params = layer_rope_parameters(old)
    assert params["sliding_attention"]["rope_type"] == "default"
    assert params["sliding_attention"]["rope_theta"] == 10000.0
    assert (params["full_attention"]["rope_type"], params["full_attention"]["factor"],
            params["full_attention"]["rope_theta"]) == ("linear", 8.0, 1e6)


def test_routed_by_model_type():
    assert router_classes()["gemma3_text"].__name__ == "Gemma3Router"
