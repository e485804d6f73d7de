"""Tessera's Ministral 3 against transformers' on tiny random checkpoints: Mistral's layers
with YaRN (mscale, as Ministral 3 ships it) and Llama 4's query temperature past YaRN's
original context. The original context here is 16 tokens, so prompts and generations
cross it several times (the scale steps at 16, 32, 48, ...). Same float32 tolerance as
test_llama_parity.py (FP32_ATOL, tests/models/parity.py); norm weights are randomised
(parity.make_tiny)."""
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
ROPE = {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 16.0, "original_max_position_embeddings": 16,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.1}

CASES = {
    "ministral3-yarn-temperature": dict(rope_parameters=ROPE),
    "ministral3-headdim-tied-window": dict(rope_parameters=ROPE, head_dim=24, tie_word_embeddings=True,
                                           sliding_window=8),
}


def make_tiny_ministral3(folder, tokenizer_dir, seed: int = 0, name: str = "ministral3-yarn-temperature"):
    from transformers import Ministral3Config, Ministral3ForCausalLM

    return make_tiny(folder, tokenizer_dir, Ministral3Config, Ministral3ForCausalLM, seed=seed, pad_token_id=0,
                     **CASES[name])


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def case(request, tmp_path_factory, tiny_tokenizer_dir) -> Case:
    folder = tmp_path_factory.mktemp(request.param)
    hf = make_tiny_ministral3(folder, tiny_tokenizer_dir, seed=len(request.param), name=request.param)
    llm = LLM(folder, dtype="float32", num_kv_blocks=NUM_KV_BLOCKS, show_progress=False)
    return Case(request.param, folder, hf, llm)


def test_checkpoint_has_what_the_case_claims(case: Case):
    model = case.llm.engine.runner.model
    assert type(model).__name__ == "Ministral3ForCausalLM"
    assert model.model.beta == 0.1 and model.model.original == 16
    # the query temperature really changes transformers' answer here
    prompt = prompt_ids(40, seed=9)
    config = case.hf.config
    plain = type(case.hf)(type(config)(**{**config.to_dict(), "rope_parameters": {**ROPE, "llama_4_scaling_beta": 0.0}}))
    plain.load_state_dict(case.hf.state_dict())
    assert not torch.allclose(hf_logits(plain.eval(), prompt), hf_logits(case.hf, prompt), atol=1e-3)


def test_prefill_and_decode_logits_match(case: Case, monkeypatch):
    check_prefill_and_decode_logits(case.llm, case.hf, case.name, monkeypatch)


def test_greedy_matches_hf_generate_alone_and_batched(case: Case):
    check_greedy_alone_and_batched(case.llm, case.hf, PROMPT_LENGTHS)


def test_chunked_prefill_matches(case: Case, monkeypatch):
    check_chunked_prefill(case.folder, case.llm, case.hf, case.name, monkeypatch, NUM_KV_BLOCKS, PROMPT_LENGTHS)


def test_routed_by_model_type():
    assert router_classes()["ministral3"].__name__ == "Ministral3Router"
