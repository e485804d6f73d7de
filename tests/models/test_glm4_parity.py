"""Tessera's GLM-4 against transformers' on tiny random checkpoints: rotary over half of
each head on neighbouring pairs, Q/K/V biases, the fused gate_up_proj loaded whole, and
norms after the attention and the MLP as well as before. Same float32 tolerance as
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
    "glm4-gqa-bias": dict(head_dim=16),
    "glm4-tied-no-bias-quarter": dict(head_dim=16, tie_word_embeddings=True, attention_bias=False,
                                      partial_rotary_factor=0.25),
}


def make_tiny_glm4(folder, tokenizer_dir, seed: int = 0, name: str = "glm4-gqa-bias"):
    from transformers import Glm4Config, Glm4ForCausalLM

    return make_tiny(folder, tokenizer_dir, Glm4Config, Glm4ForCausalLM, seed=seed, pad_token_id=0, **CASES[name])


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def case(request, tmp_path_factory, tiny_tokenizer_dir) -> Case:
    folder = tmp_path_factory.mktemp(request.param)
    hf = make_tiny_glm4(folder, tiny_tokenizer_dir, seed=len(request.param), name=request.param)
    llm = LLM(folder, dtype="float32", num_kv_blocks=NUM_KV_BLOCKS, show_progress=False)
    return Case(request.param, folder, hf, llm)


def test_prefill_and_decode_logits_match(case: Case, monkeypatch):
    attn = case.llm.engine.runner.model.model.layers[0].self_attn
    assert attn.rotary.rotary_dim == int(16 * CASES[case.name].get("partial_rotary_factor", 0.5))
    check_prefill_and_decode_logits(case.llm, case.hf, case.name, monkeypatch)


def test_greedy_matches_hf_generate_alone_and_batched(case: Case):
    check_greedy_alone_and_batched(case.llm, case.hf, PROMPT_LENGTHS)


def test_chunked_prefill_matches(case: Case, monkeypatch):
    check_chunked_prefill(case.folder, case.llm, case.hf, case.name, monkeypatch, NUM_KV_BLOCKS, PROMPT_LENGTHS)


def test_routed_by_model_type():
    assert router_classes()["glm4"].__name__ == "Glm4Router"
