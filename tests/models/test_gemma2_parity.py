"""Tessera's Gemma2 against transformers' on tiny random checkpoints: soft-capped attention
scores and final logits, alternating sliding window (window 8, shorter than prompt +
generation) and full layers, sqrt(hidden)-scaled embeddings, the four (1 + w) norms per
layer, query_pre_attn_scalar scaling (here not head_dim) and the gelu_pytorch_tanh MLP.
Small soft-caps are chosen so capping changes the answer. Same tolerances as
test_llama_parity.py; norm weights are randomised (tests/models/test_mistral_parity.py)."""
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
from tests.models.test_mistral_parity import make_tiny

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 512
NUM_KV_BLOCKS = 64
GREEDY_NEW_TOKENS = 32
PROMPT_LENGTHS = (5, 23, 47)

BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
            rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.1,
            query_pre_attn_scalar=24, sliding_window=8, attn_logit_softcapping=1.5,
            final_logit_softcapping=2.0)
CASES = {
    "gemma2-tied": {},
    "gemma2-untied-nocap": dict(tie_word_embeddings=False, attn_logit_softcapping=None,
                                final_logit_softcapping=None),
}


@dataclass
class Case:
    name: str
    folder: Path
    hf: torch.nn.Module
    llm: LLM


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def case(request, tmp_path_factory, tiny_tokenizer_dir) -> Case:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    folder = tmp_path_factory.mktemp(request.param)
    hf = make_tiny(folder, tiny_tokenizer_dir, Gemma2Config, Gemma2ForCausalLM,
                   seed=len(request.param), base=BASE, attn_implementation="eager",
                   **CASES[request.param])
    llm = LLM(folder, dtype="float32", num_kv_blocks=NUM_KV_BLOCKS, show_progress=False)
    return Case(request.param, folder, hf, llm)


def greedy(n: int = GREEDY_NEW_TOKENS) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


def test_checkpoint_has_what_the_case_claims(case: Case):
    model = case.llm.engine.runner.model
    assert type(model).__name__ == "Gemma2ForCausalLM"
    cfg = case.hf.config
    windows = [layer.self_attn.attn.sliding_window for layer in model.model.layers]
    assert windows == [8 if t == "sliding_attention" else None for t in cfg.layer_types]
    assert None in windows and 8 in windows  # really alternating
    assert all(layer.self_attn.attn.softcap == cfg.attn_logit_softcapping for layer in model.model.layers)
    assert model.model.layers[0].self_attn.attn.scale == 24 ** -0.5
    hf_norm = case.hf.model.layers[1].post_feedforward_layernorm.weight
    torch.testing.assert_close(model.model.layers[1].post_feedforward_layernorm.weight, 1 + hf_norm)
    tied = cfg.tie_word_embeddings
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied


def test_prefill_and_decode_logits_match(case: Case, monkeypatch):
    prompt = prompt_ids(27, seed=1)
    rec = LogitRecorder(case.llm, monkeypatch)
    out = case.llm.generate([prompt], greedy(9), use_tqdm=False)[0]
    tokens = out.outputs[0].token_ids
    rows = rec.for_request(out.request_id)
    assert [p for p, _ in rows] == list(range(27, 36))
    assert_rows_match(rows, hf_logits(case.hf, prompt + tokens), FP32_ATOL, case.name)


def test_greedy_matches_hf_generate_alone_and_batched(case: Case):
    prompts = [prompt_ids(n, seed=3) for n in PROMPT_LENGTHS]
    expected = [hf_generate(case.hf, p, GREEDY_NEW_TOKENS) for p in prompts]
    for prompt, want in zip(prompts, expected):
        assert case.llm.generate([prompt], greedy(), use_tqdm=False)[0].outputs[0].token_ids == want
    batched = case.llm.generate(prompts, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in batched] == expected


def test_chunked_prefill_matches(case: Case, monkeypatch):
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
    assert router_classes()["gemma2"].__name__ == "Gemma2Router"
