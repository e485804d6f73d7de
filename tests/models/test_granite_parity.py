"""Tessera's Granite against transformers' on tiny random checkpoints whose multipliers are
far from 1 (embeddings x 12, attention scale 0.02 in place of 1/sqrt(16), residual
branches x 0.22, logits / 8), so a missed one moves the logits well past the float32
tolerance of test_llama_parity.py (FP32_ATOL, tests/models/parity.py); norm weights are
randomised (parity.make_tiny)."""
from __future__ import annotations

import pytest

from tessera import LLM
from tessera.models.registry import router_classes

from tests.models.parity import (Case, check_chunked_prefill, check_greedy_alone_and_batched,
                                 check_prefill_and_decode_logits, make_tiny)

pytestmark = pytest.mark.usefixtures("one_thread")

NUM_KV_BLOCKS = 64
PROMPT_LENGTHS = (5, 23, 47)
MULTIPLIERS = dict(embedding_multiplier=12.0, attention_multiplier=0.02, residual_multiplier=0.22,
                   logits_scaling=8.0)
CASES = {
    "granite-gqa": MULTIPLIERS,
    "granite-tied-bias": dict(MULTIPLIERS, tie_word_embeddings=True, attention_bias=True, mlp_bias=True),
}


def make_tiny_granite(folder, tokenizer_dir, seed: int = 0, name: str = "granite-gqa"):
    from transformers import GraniteConfig, GraniteForCausalLM

    return make_tiny(folder, tokenizer_dir, GraniteConfig, GraniteForCausalLM, seed=seed, pad_token_id=0,
                     **CASES[name])


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def case(request, tmp_path_factory, tiny_tokenizer_dir) -> Case:
    folder = tmp_path_factory.mktemp(request.param)
    hf = make_tiny_granite(folder, tiny_tokenizer_dir, seed=len(request.param), name=request.param)
    llm = LLM(folder, dtype="float32", num_kv_blocks=NUM_KV_BLOCKS, show_progress=False)
    return Case(request.param, folder, hf, llm)


def test_prefill_and_decode_logits_match(case: Case, monkeypatch):
    assert type(case.llm.engine.runner.model).__name__ == "GraniteForCausalLM"
    check_prefill_and_decode_logits(case.llm, case.hf, case.name, monkeypatch)


def test_greedy_matches_hf_generate_alone_and_batched(case: Case):
    check_greedy_alone_and_batched(case.llm, case.hf, PROMPT_LENGTHS)


def test_chunked_prefill_matches(case: Case, monkeypatch):
    check_chunked_prefill(case.folder, case.llm, case.hf, case.name, monkeypatch, NUM_KV_BLOCKS, PROMPT_LENGTHS)


def test_routed_by_model_type():
    assert router_classes()["granite"].__name__ == "GraniteRouter"
