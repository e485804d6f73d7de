"""Tessera's Cohere 2 (Command R7B's shape) against transformers' on tiny random checkpoints:
parallel blocks over one bias-free LayerNorm, interleaved rotary on the sliding-window (8)
layers and none on the full ones, logits scaled. Same float32 tolerance as
test_llama_parity.py (FP32_ATOL, tests/models/parity.py); norm weights are randomised
(parity.make_tiny)."""
from __future__ import annotations

import pytest

from tessera import LLM
from tessera.models.registry import router_classes

from tests.models.parity import (Case, check_chunked_prefill, check_greedy_alone_and_batched,
                                 check_prefill_and_decode_logits, make_tiny)

pytestmark = pytest.mark.usefixtures("one_thread")

NUM_KV_BLOCKS = 64
PROMPT_LENGTHS = (5, 23, 47)
CASES = {
    "cohere2-window8-tied": dict(num_hidden_layers=4, sliding_window=8, tie_word_embeddings=True, logit_scale=0.25),
    "cohere2-untied-alternate": dict(num_hidden_layers=4, sliding_window=8, logit_scale=2.0,
                                     layer_types=["sliding_attention", "full_attention"] * 2),
}


def make_tiny_cohere2(folder, tokenizer_dir, seed: int = 0, name: str = "cohere2-window8-tied"):
    from transformers import Cohere2Config, Cohere2ForCausalLM

    return make_tiny(folder, tokenizer_dir, Cohere2Config, Cohere2ForCausalLM, seed=seed, pad_token_id=0,
                     **CASES[name])


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def case(request, tmp_path_factory, tiny_tokenizer_dir) -> Case:
    folder = tmp_path_factory.mktemp(request.param)
    hf = make_tiny_cohere2(folder, tiny_tokenizer_dir, seed=len(request.param), name=request.param)
    llm = LLM(folder, dtype="float32", num_kv_blocks=NUM_KV_BLOCKS, show_progress=False)
    return Case(request.param, folder, hf, llm)


def test_prefill_and_decode_logits_match(case: Case, monkeypatch):
    layers = case.llm.engine.runner.model.model.layers
    assert [layer.self_attn.attn.sliding_window for layer in layers] == [
        8 if kind == "sliding_attention" else None for kind in case.hf.config.layer_types]
    check_prefill_and_decode_logits(case.llm, case.hf, case.name, monkeypatch)


def test_greedy_matches_hf_generate_alone_and_batched(case: Case):
    check_greedy_alone_and_batched(case.llm, case.hf, PROMPT_LENGTHS)


def test_chunked_prefill_matches(case: Case, monkeypatch):
    check_chunked_prefill(case.folder, case.llm, case.hf, case.name, monkeypatch, NUM_KV_BLOCKS, PROMPT_LENGTHS)


def test_routed_by_model_type():
    assert router_classes()["cohere2"].__name__ == "Cohere2Router"
