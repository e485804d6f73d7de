"""Tessera's Mistral against transformers' on tiny random checkpoints whose sliding window
(8, or 5 with an explicit head_dim) is far shorter than prompt + generation, so every
off-by-one in the window mask (transformers: the query at p sees keys in (p - w, p]) shows
up in the logits, in decode, in prefill and in chunked prefill over cached context. A
window-None case checks that None means full attention. Same tolerances as
test_llama_parity.py; norm weights are randomised."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tessera import LLM
from tessera.models.registry import router_classes
from tessera.sampling.params import SamplingParams

from tests.models.test_llama_parity import (FP32_ATOL, LogitRecorder, assert_rows_match,
                                            hf_generate, hf_logits, prompt_ids)

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 512
NUM_KV_BLOCKS = 64
GREEDY_NEW_TOKENS = 32
PROMPT_LENGTHS = (5, 23, 47)

BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, initializer_range=0.1,
            tie_word_embeddings=False)
CASES = {
    "mistral-window8": dict(sliding_window=8),
    "mistral-window5-headdim-tied": dict(sliding_window=5, head_dim=24, tie_word_embeddings=True),
    "mistral-full": dict(sliding_window=None),
}


def make_tiny(folder: Path, tokenizer_dir: Path, config_cls, model_cls, seed: int = 0,
              base: dict = BASE, **overrides) -> torch.nn.Module:
    """Saves a random transformers model (+ the tiny tokenizer) to `folder`; returns the
    float32 eval-mode model. Norm weights are randomised around 1 (a loader that skipped
    them, or a model that did not apply them, would fail)."""
    from transformers import AutoTokenizer

    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**base, **overrides})).eval()
    g = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith(".weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(folder)
    return model


@dataclass
class Case:
    name: str
    folder: Path
    hf: torch.nn.Module
    llm: LLM


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def case(request, tmp_path_factory, tiny_tokenizer_dir) -> Case:
    from transformers import MistralConfig, MistralForCausalLM

    folder = tmp_path_factory.mktemp(request.param)
    hf = make_tiny(folder, tiny_tokenizer_dir, MistralConfig, MistralForCausalLM,
                   seed=len(request.param), **CASES[request.param])
    llm = LLM(folder, dtype="float32", num_kv_blocks=NUM_KV_BLOCKS, show_progress=False)
    return Case(request.param, folder, hf, llm)


def greedy(n: int = GREEDY_NEW_TOKENS) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


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
    prompt = prompt_ids(27, seed=1)  # decodes cross the block boundary at 32
    rec = LogitRecorder(case.llm, monkeypatch)
    out = case.llm.generate([prompt], greedy(9), use_tqdm=False)[0]
    tokens = out.outputs[0].token_ids
    rows = rec.for_request(out.request_id)
    assert [p for p, _ in rows] == list(range(27, 36))  # 1 prefill + 8 decodes
    assert [s["query_lens"] for s in rec.steps] == [[27]] + [[1]] * 8
    assert_rows_match(rows, hf_logits(case.hf, prompt + tokens), FP32_ATOL, case.name)


def test_greedy_matches_hf_generate_alone_and_batched(case: Case):
    prompts = [prompt_ids(n, seed=3) for n in PROMPT_LENGTHS]
    expected = [hf_generate(case.hf, p, GREEDY_NEW_TOKENS) for p in prompts]
    for prompt, want in zip(prompts, expected):
        assert case.llm.generate([prompt], greedy(), use_tqdm=False)[0].outputs[0].token_ids == want
    batched = case.llm.generate(prompts, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in batched] == expected


def test_chunked_prefill_matches(case: Case, monkeypatch):
    """Prompts of 47 tokens go in chunks of 16 that attend to cached context through the
    window; tokens and logits equal transformers' and the unchunked engine's."""
    prompts = [prompt_ids(n, seed=4) for n in PROMPT_LENGTHS]
    whole = [o.outputs[0].token_ids for o in case.llm.generate(prompts, greedy(), use_tqdm=False)]
    chunked_llm = LLM(case.folder, dtype="float32", num_kv_blocks=NUM_KV_BLOCKS,
                      max_num_batched_tokens=16, max_num_seqs=16, show_progress=False)
    rec = LogitRecorder(chunked_llm, monkeypatch)
    outs = chunked_llm.generate(prompts, greedy(), use_tqdm=False)
    assert max(sum(s["query_lens"]) for s in rec.steps) == 16
    assert [o.outputs[0].token_ids for o in outs] == whole
    for prompt, out in zip(prompts, outs):
        tokens = out.outputs[0].token_ids
        assert tokens == hf_generate(case.hf, prompt, GREEDY_NEW_TOKENS)
        assert_rows_match(rec.for_request(out.request_id), hf_logits(case.hf, prompt + tokens),
                          FP32_ATOL, f"{case.name} chunked {len(prompt)}")


def test_routed_by_model_type():
    assert router_classes()["mistral"].__name__ == "MistralRouter"
