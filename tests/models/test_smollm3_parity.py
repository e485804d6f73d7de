"""Tessera's SmolLM3 against transformers' on tiny random checkpoints: Llama whose NoPE
layers (no_rope_layers 0) skip rotary; 4 layers with the default interval of 4 (the last
is NoPE), every other layer NoPE, and a sliding window (8) on the NoPE layers as
use_sliding_window asks. Same float32 tolerance as test_llama_parity.py (FP32_ATOL,
tests/models/parity.py); norm weights are randomised (parity.make_tiny)."""
from __future__ import annotations

import pytest
import torch

from tessera import LLM
from tessera.models.registry import router_classes

from tests.models.parity import (Case, check_chunked_prefill, check_greedy_alone_and_batched,
                                 check_prefill_and_decode_logits, hf_logits, make_tiny, prompt_ids)

pytestmark = pytest.mark.usefixtures("one_thread")

NUM_KV_BLOCKS = 64
PROMPT_LENGTHS = (5, 23, 47)

CASES = {
    "smollm3-interval4": dict(num_hidden_layers=4, pad_token_id=0),
    "smollm3-alternate-tied": dict(num_hidden_layers=4, no_rope_layers=[1, 0, 1, 0], tie_word_embeddings=True,
                                   pad_token_id=0),
    "smollm3-window8": dict(num_hidden_layers=4, no_rope_layers=[1, 0, 1, 0], use_sliding_window=True, pad_token_id=0,
                            sliding_window=8),
}


def make_tiny_smollm3(folder, tokenizer_dir, seed: int = 0, name: str = "smollm3-alternate-tied"):
    from transformers import SmolLM3Config, SmolLM3ForCausalLM

    return make_tiny(folder, tokenizer_dir, SmolLM3Config, SmolLM3ForCausalLM, seed=seed, **CASES[name])


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def case(request, tmp_path_factory, tiny_tokenizer_dir) -> Case:
    folder = tmp_path_factory.mktemp(request.param)
    hf = make_tiny_smollm3(folder, tiny_tokenizer_dir, seed=len(request.param), name=request.param)
    llm = LLM(folder, dtype="float32", num_kv_blocks=NUM_KV_BLOCKS, show_progress=False)
    return Case(request.param, folder, hf, llm)


def test_checkpoint_has_what_the_case_claims(case: Case):
    model = case.llm.engine.runner.model
    assert type(model).__name__ == "SmolLM3ForCausalLM"
    config = case.hf.config
    assert [layer.self_attn.uses_rope for layer in model.model.layers] == [bool(x) for x in config.no_rope_layers]
    assert not all(config.no_rope_layers)
    windows = [layer.self_attn.attn.sliding_window for layer in model.model.layers]
    assert windows == [8 if kind == "sliding_attention" else None for kind in config.layer_types] \
        if config.use_sliding_window else windows == [None] * 4
    # NoPE really changes transformers' answer: all-rope differs
    prompt = prompt_ids(40, seed=9)
    roped = type(case.hf)(type(config)(**{**config.to_dict(), "no_rope_layers": [1] * 4, "layer_types": None}))
    roped.load_state_dict(case.hf.state_dict())
    assert not torch.allclose(hf_logits(roped.eval(), prompt), hf_logits(case.hf, prompt), atol=1e-3)


def test_prefill_and_decode_logits_match(case: Case, monkeypatch):
    check_prefill_and_decode_logits(case.llm, case.hf, case.name, monkeypatch)


def test_greedy_matches_hf_generate_alone_and_batched(case: Case):
    check_greedy_alone_and_batched(case.llm, case.hf, PROMPT_LENGTHS)


def test_chunked_prefill_matches(case: Case, monkeypatch):
    check_chunked_prefill(case.folder, case.llm, case.hf, case.name, monkeypatch, NUM_KV_BLOCKS,
                          PROMPT_LENGTHS)


def test_routed_by_model_type():
    assert router_classes()["smollm3"].__name__ == "SmolLM3Router"
