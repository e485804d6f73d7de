"""Tessera's Mistral against transformers' on tiny random checkpoints whose sliding window
(8, or 5 with an explicit head_dim) is far shorter than prompt + generation, so every
off-by-one in the window mask (transformers: the query at p sees keys in (p - w, p]) shows
up in the logits, in decode, in prefill and in chunked prefill over cached context. A
window-None case checks that None means full attention. Same float32
tolerance as test_llama_parity.py (FP32_ATOL, tests/models/parity.py); norm weights are
randomised (parity.make_tiny)."""
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
    "mistral-window8": dict(sliding_window=8),
    "mistral-window5-headdim-tied": dict(sliding_window=5, head_dim=24, tie_word_embeddings=True),
    "mistral-full": dict(sliding_window=None),
}


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def case(request, tmp_path_factory, tiny_tokenizer_dir) -> Case:
    from transformers import MistralConfig, MistralForCausalLM

    folder = tmp_path_factory.mktemp(request.param)
    hf = make_tiny(folder, tiny_tokenizer_dir, MistralConfig, MistralForCausalLM,
                   seed=len(request.param), **CASES[request.param])
    llm = LLM(folder, dtype="float32", num_kv_blocks=NUM_KV_BLOCKS, show_progress=False)
    return Case(request.param, folder, hf, llm)


def test_checkpoint_has_what_the_case_claims(case: Case):
    model = case.llm.engine.runner.model
    assert type(model).__name__ == "MistralForCausalLM"
    window = CASES[case.name]["sliding_window"]
    assert case.hf.config.sliding_window == window
    for layer in model.model.layers:
        assert layer.self_attn.attn.sliding_window == window
    assert model.model.layers[0].self_attn.head_dim == case.hf.model.layers[0].self_attn.head_dim
    if window is not None:  # the window really changes transformers' answer here
        prompt = prompt_ids(40, seed=9)
        full = type(case.hf)(type(case.hf.config)(**{**case.hf.config.to_dict(), "sliding_window": None}))
        full.load_state_dict(case.hf.state_dict())
        assert not torch.allclose(hf_logits(full.eval(), prompt), hf_logits(case.hf, prompt), atol=1e-3)


def test_prefill_and_decode_logits_match(case: Case, monkeypatch):
    check_prefill_and_decode_logits(case.llm, case.hf, case.name, monkeypatch)


def test_greedy_matches_hf_generate_alone_and_batched(case: Case):
    check_greedy_alone_and_batched(case.llm, case.hf, PROMPT_LENGTHS)


def test_chunked_prefill_matches(case: Case, monkeypatch):
    """Prompts of 47 tokens go in chunks of 16 that attend to cached context through the
    window; tokens and logits equal transformers' and the unchunked engine's."""
    check_chunked_prefill(case.folder, case.llm, case.hf, case.name, monkeypatch, NUM_KV_BLOCKS,
                          PROMPT_LENGTHS)


def test_routed_by_model_type():
    assert router_classes()["mistral"].__name__ == "MistralRouter"
