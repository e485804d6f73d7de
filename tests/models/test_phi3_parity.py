"""Tessera's Phi-3 against transformers' on tiny random checkpoints.

Phi-3 is the Llama stack with checkpoints that store fused `qkv_proj` and `gate_up_proj`
(tessera/models/phi3), so this checks that those load whole, and longrope: short factors
up to original_max_position_embeddings, long factors beyond, with Phi-3's attention
scaling of cos/sin (factor 512 / original > 1 in both cases). "longrope-short" never
leaves the short factors (original 128); "longrope-long" (original 32) has every prompt
start past the switch, so every token uses the long factors. Not tested because not
matched: a sequence that crosses the switch during generation. transformers' Phi-3
generate then drops its cache and recomputes the whole sequence with the long factors;
tessera keeps the keys already cached (short factors) and uses the long ones from there on
(see ops/rotary.py). Reference logits are transformers' step-by-step `generate` logits.
Same float32 tolerance and reasoning as test_llama_parity.py (FP32_ATOL, tests/models/parity.py).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tessera import LLM
from tessera.models.registry import router_classes

from tests.models.parity import (FP32_ATOL, VOCAB, Case, LogitRecorder,
                                 check_greedy_alone_and_batched, greedy, hf_generate, prompt_ids)

pytestmark = pytest.mark.usefixtures("one_thread")

NUM_KV_BLOCKS = 64
HALF_HEAD = 8  # head_dim 16

BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0,
            initializer_range=0.1, tie_word_embeddings=False, sliding_window=None)


def longrope(original: int, half: int = HALF_HEAD) -> dict:
    """`half`: factors for half the rotated dimensions (6 with partial rotary over 12 of 16)."""
    rope = dict(rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=original,
                short_factor=[1.0 + 0.05 * i for i in range(half)],
                long_factor=[1.0 + 2.0 * i for i in range(half)])
    return dict(rope_parameters=rope, original_max_position_embeddings=original)


# name -> (config overrides, greedy prompt lengths, logits prompt lengths)
CASES = {
    "default-gqa": ({}, (5, 23, 47), (27,)),
    "default-mha-tied": (dict(num_key_value_heads=4, tie_word_embeddings=True), (5, 23, 47), (27,)),
    "longrope-short": (longrope(128), (5, 23, 47), (27,)),  # 47 + 32 stays under 128
    "longrope-long": (longrope(32), (33, 40, 47), (33, 40)),  # every prompt is past 32
    "sliding-window": (dict(sliding_window=8), (5, 23, 47), (27,)),  # window << context
    # Phi-4-mini's shape: rotary over 3/4 of each head (12 of 16 here), longrope, tied
    "partial-longrope-tied": (dict(partial_rotary_factor=0.75, tie_word_embeddings=True, **longrope(32, half=6)),
                              (33, 40, 47), (33,)),
    "partial-half": (dict(partial_rotary_factor=0.5), (5, 23, 47), (27,)),
}

def make_tiny_phi3(folder: Path, tokenizer_dir: Path, seed: int = 0, **overrides) -> torch.nn.Module:
    """Saves a random transformers Phi3ForCausalLM (+ the tiny tokenizer) to `folder`;
    returns the float32 eval-mode model."""
    from transformers import AutoTokenizer, Phi3Config, Phi3ForCausalLM

    torch.manual_seed(seed)
    model = Phi3ForCausalLM(Phi3Config(**{**BASE, **overrides})).eval()
    g = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(folder)
    return model


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def case(request, tmp_path_factory, tiny_tokenizer_dir) -> Case:
    folder = tmp_path_factory.mktemp(request.param)
    hf = make_tiny_phi3(folder, tiny_tokenizer_dir, seed=len(request.param), **CASES[request.param][0])
    llm = LLM(folder, dtype="float32", num_kv_blocks=NUM_KV_BLOCKS, show_progress=False)
    return Case(request.param, folder, hf, llm)


def hf_step_logits(model: torch.nn.Module, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy generate: its tokens and the logits row of each step."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0, output_logits=True,
                             return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), [row[0].float() for row in out.logits]


def test_checkpoint_is_fused_and_loaded(case: Case):
    """Guards the fixture: the checkpoint really stores fused tensors, loaded unchanged."""
    model = case.llm.engine.runner.model
    assert type(model).__name__ == "Phi3ForCausalLM"
    hf_layer, layer = case.hf.model.layers[1], model.model.layers[1]
    torch.testing.assert_close(layer.self_attn.qkv_proj.weight, hf_layer.self_attn.qkv_proj.weight,
                               rtol=0, atol=0)
    torch.testing.assert_close(layer.mlp.gate_up_proj.weight, hf_layer.mlp.gate_up_proj.weight,
                               rtol=0, atol=0)
    torch.testing.assert_close(layer.input_layernorm.weight, hf_layer.input_layernorm.weight)
    tied = CASES[case.name][0].get("tie_word_embeddings", False)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied


def test_prefill_and_decode_logits_match(case: Case, monkeypatch):
    rec = LogitRecorder(case.llm, monkeypatch)
    for prompt_len in CASES[case.name][2]:
        prompt = prompt_ids(prompt_len, seed=1)
        out = case.llm.generate([prompt], greedy(9), use_tqdm=False)[0]
        want_tokens, want_rows = hf_step_logits(case.hf, prompt, 9)
        assert out.outputs[0].token_ids == want_tokens
        rows = rec.for_request(out.request_id)
        assert [p for p, _ in rows] == list(range(prompt_len, prompt_len + 9))
        for (prefix, row), want in zip(rows, want_rows):
            diff = (row - want).abs().max().item()
            assert diff <= FP32_ATOL, f"{case.name}: logits after {prefix} tokens differ by {diff:.3g}"


def test_greedy_matches_hf_generate_alone_and_batched(case: Case):
    check_greedy_alone_and_batched(case.llm, case.hf, CASES[case.name][1])


def test_longrope_long_factors_matter(tmp_path, tiny_tokenizer_dir):
    """Guards the longrope-long case: with the long factors replaced by the short ones,
    transformers' tokens change, so the parity above really tests the long factors."""
    prompt = prompt_ids(47, seed=3)
    overrides = CASES["longrope-long"][0]
    hf = make_tiny_phi3(tmp_path / "a", tiny_tokenizer_dir, seed=8, **overrides)
    rope = overrides["rope_parameters"]
    same = dict(overrides, rope_parameters={**rope, "long_factor": rope["short_factor"]})
    hf_short = make_tiny_phi3(tmp_path / "b", tiny_tokenizer_dir, seed=8, **same)
    assert hf_generate(hf, prompt, 8) != hf_generate(hf_short, prompt, 8)


def test_routed_by_model_type():
    assert router_classes()["phi3"].__name__ == "Phi3Router"


def test_partial_rotary_leaves_the_rest_of_each_head_alone(case: Case):
    """The rotated width is the config's share of the head: a rotary over all of it (or
    none of the rest kept) would change transformers' answer, which the parity above checks."""
    model = case.llm.engine.runner.model
    factor = CASES[case.name][0].get("partial_rotary_factor", 1.0)
    assert model.model.layers[0].self_attn.rotary.rotary_dim == int(16 * factor)
