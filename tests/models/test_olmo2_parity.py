"""Tessera's OLMo 2 and OLMo 3 against transformers' on tiny random checkpoints: post-norm
layers (the attention's and the MLP's outputs normed, then added), query / key norms over
all heads at once; OLMo 3 with a sliding window (8) on three layers of four and its own
rotary table per layer type (YaRN on the full-attention layers). Same float32 tolerance as
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
    "olmo2-gqa": ("olmo2", dict(pad_token_id=0)),
    "olmo2-mha-tied": ("olmo2", dict(num_key_value_heads=4, tie_word_embeddings=True, pad_token_id=0)),
    "olmo3-window8-yarn": ("olmo3", dict(num_hidden_layers=4, sliding_window=8, pad_token_id=0, rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 4.0,
                           "original_max_position_embeddings": 128}})),
}


def make_tiny_olmo(folder, tokenizer_dir, seed: int = 0, name: str = "olmo2-gqa", **more):
    import transformers

    kind, overrides = CASES[name]
    prefix = {"olmo2": "Olmo2", "olmo3": "Olmo3"}[kind]
    return make_tiny(folder, tokenizer_dir, getattr(transformers, f"{prefix}Config"),
                     getattr(transformers, f"{prefix}ForCausalLM"), seed=seed, **{**overrides, **more})


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def case(request, tmp_path_factory, tiny_tokenizer_dir) -> Case:
    folder = tmp_path_factory.mktemp(request.param)
    hf = make_tiny_olmo(folder, tiny_tokenizer_dir, seed=len(request.param), name=request.param)
    llm = LLM(folder, dtype="float32", num_kv_blocks=NUM_KV_BLOCKS, show_progress=False)
    return Case(request.param, folder, hf, llm)


def test_checkpoint_has_what_the_case_claims(case: Case):
    model = case.llm.engine.runner.model
    assert type(model).__name__ == "Olmo2ForCausalLM" and case.hf.config.model_type == CASES[case.name][0]
    windows = [layer.self_attn.attn.sliding_window for layer in model.model.layers]
    if case.name.startswith("olmo3"):
        assert windows == [8, 8, 8, None] and model.model.type_rotary is not None
    else:
        assert set(windows) == {None} and model.model.type_rotary is None


def test_prefill_and_decode_logits_match(case: Case, monkeypatch):
    check_prefill_and_decode_logits(case.llm, case.hf, case.name, monkeypatch)


def test_greedy_matches_hf_generate_alone_and_batched(case: Case):
    check_greedy_alone_and_batched(case.llm, case.hf, PROMPT_LENGTHS)


def test_chunked_prefill_matches(case: Case, monkeypatch):
    check_chunked_prefill(case.folder, case.llm, case.hf, case.name, monkeypatch, NUM_KV_BLOCKS, PROMPT_LENGTHS)


def test_routed_by_model_type():
    assert router_classes()["olmo2"].__name__ == router_classes()["olmo3"].__name__ == "Olmo2Router"
