"""Tessera's Gemma2 against transformers' on tiny random checkpoints: soft-capped attention
scores and final logits, alternating sliding window (window 8, shorter than prompt +
generation) and full layers, sqrt(hidden)-scaled embeddings, the four (1 + w) norms per
layer, query_pre_attn_scalar scaling (here not head_dim) and the gelu_pytorch_tanh MLP.
Small soft-caps are chosen so capping changes the answer. Same float32 tolerance as
test_llama_parity.py (FP32_ATOL, tests/models/parity.py); norm weights are randomised
(parity.make_tiny)."""
from __future__ import annotations

import pytest
import torch

from tessera import LLM
from tessera.models.registry import router_classes

from tests.models.parity import (VOCAB, Case, check_chunked_prefill, check_greedy_alone_and_batched,
                                 check_prefill_and_decode_logits, make_tiny)

pytestmark = pytest.mark.usefixtures("one_thread")

NUM_KV_BLOCKS = 64
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


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def case(request, tmp_path_factory, tiny_tokenizer_dir) -> Case:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    folder = tmp_path_factory.mktemp(request.param)
    hf = make_tiny(folder, tiny_tokenizer_dir, Gemma2Config, Gemma2ForCausalLM,
                   seed=len(request.param), base=BASE, attn_implementation="eager",
                   **CASES[request.param])
    llm = LLM(folder, dtype="float32", num_kv_blocks=NUM_KV_BLOCKS, show_progress=False)
    return Case(request.param, folder, hf, llm)


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
    check_prefill_and_decode_logits(case.llm, case.hf, case.name, monkeypatch)


def test_greedy_matches_hf_generate_alone_and_batched(case: Case):
    check_greedy_alone_and_batched(case.llm, case.hf, PROMPT_LENGTHS)


def test_chunked_prefill_matches(case: Case, monkeypatch):
    check_chunked_prefill(case.folder, case.llm, case.hf, case.name, monkeypatch, NUM_KV_BLOCKS,
                          PROMPT_LENGTHS)


def test_routed_by_model_type():
    assert router_classes()["gemma2"].__name__ == "Gemma2Router"


@pytest.mark.parametrize("with_residual", [False, True])
def test_bf16_norms_round_once_as_transformers(with_residual):
    """In bf16, transformers multiplies the float32 normalised row by (1 + w) in float32 and
    rounds once; tessera keeps 1 + w in float32 and does the same, bit for bit (1 + w in
    bf16 would be off by up to 2^-9 per channel)."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm as HFGemma2RMSNorm

    from tessera.models.gemma2.modeling import Gemma2RMSNorm
    from tessera.ops.registry import OpTarget
    from tessera.weights.loader import load_weights

    hidden = 576
    g = torch.Generator().manual_seed(0)
    hf = HFGemma2RMSNorm(hidden, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        hf.weight.copy_(0.3 * torch.randn(hidden, generator=g))
    ours = Gemma2RMSNorm(hidden, 1e-6, OpTarget("cpu", torch.bfloat16))
    load_weights(ours, [("weight", hf.weight.detach())])
    assert ours.weight.dtype == torch.float32
    x = (3 * torch.randn(8, hidden, generator=g)).bfloat16()
    residual = torch.randn(8, hidden, generator=g).bfloat16()
    with torch.no_grad():
        if with_residual:
            got, summed = ours(x, residual)
            assert torch.equal(summed, residual + x)  # the decoder layer's bf16 add
            want = hf(residual + x)
        else:
            got, want = ours(x), hf(x)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want)
