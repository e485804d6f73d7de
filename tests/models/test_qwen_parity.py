"""Tessera's Qwen2 and Qwen3 against transformers' on tiny random checkpoints.

Both are the Llama stack with another attention class swapped in (tessera/models/qwen2,
qwen3), so this checks what differs: Qwen2's Q/K/V biases (and no o_proj bias), Qwen3's
per-head q_norm / k_norm before rotary and its explicit head_dim (here not hidden/heads),
with GQA, tied and untied embeddings. Norm weights and biases are randomised so a loader
that skipped them, or a model that did not apply them, would fail. Same float32 tolerance
and reasoning as test_llama_parity.py (FP32_ATOL, tests/models/parity.py).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tessera import LLM
from tessera.models.registry import router_classes

from tests.models.parity import (VOCAB, Case, check_greedy_alone_and_batched,
                                 check_prefill_and_decode_logits, greedy, hf_generate, prompt_ids)

pytestmark = pytest.mark.usefixtures("one_thread")

NUM_KV_BLOCKS = 64
PROMPT_LENGTHS = (5, 23, 47)

BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, initializer_range=0.1,
            tie_word_embeddings=False)
CASES = {
    "qwen2-gqa-untied": ("qwen2", {}),
    "qwen2-gqa-tied": ("qwen2", dict(tie_word_embeddings=True)),
    # head_dim 24: q is 4 x 24 = 96 wide, not hidden_size 64, so a model that derived
    # head_dim from hidden_size / heads would not even load.
    "qwen3-gqa-headdim": ("qwen3", dict(head_dim=24, rope_parameters={
        "rope_type": "default", "rope_theta": 1000000.0})),
    "qwen3-tied-bias": ("qwen3", dict(head_dim=16, tie_word_embeddings=True, attention_bias=True)),
}


def make_tiny_qwen(folder: Path, tokenizer_dir: Path, kind: str, seed: int = 0,
                   **overrides) -> torch.nn.Module:
    """Saves a random transformers Qwen2/Qwen3ForCausalLM (+ the tiny tokenizer) to
    `folder`; returns the float32 eval-mode model."""
    from transformers import (AutoTokenizer, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                              Qwen3ForCausalLM)

    config_cls, model_cls = {"qwen2": (Qwen2Config, Qwen2ForCausalLM),
                             "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[kind]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**BASE, **overrides})).eval()
    g = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(folder)
    return model


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def case(request, tmp_path_factory, tiny_tokenizer_dir) -> Case:
    kind, overrides = CASES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    hf = make_tiny_qwen(folder, tiny_tokenizer_dir, kind, seed=len(request.param), **overrides)
    llm = LLM(folder, dtype="float32", num_kv_blocks=NUM_KV_BLOCKS, show_progress=False)
    return Case(request.param, folder, hf, llm)


def test_checkpoint_has_what_the_case_claims(case: Case):
    """Guards the fixtures: the parameters the cases are about really exist and are loaded."""
    model = case.llm.engine.runner.model
    kind, overrides = CASES[case.name]
    attn = model.model.layers[0].self_attn
    assert type(model).__name__ == ("Qwen2ForCausalLM" if kind == "qwen2" else "Qwen3ForCausalLM")
    hf_attn = case.hf.model.layers[0].self_attn
    assert (attn.qkv_proj.bias is not None) == (hf_attn.q_proj.bias is not None)
    assert (attn.o_proj.bias is not None) == (hf_attn.o_proj.bias is not None)
    if kind == "qwen2":
        assert attn.qkv_proj.bias is not None and attn.o_proj.bias is None
    else:
        torch.testing.assert_close(attn.q_norm.weight, hf_attn.q_norm.weight)
        torch.testing.assert_close(attn.k_norm.weight, hf_attn.k_norm.weight)
        assert attn.head_dim == overrides["head_dim"]
    tied = overrides.get("tie_word_embeddings", False)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied


def test_prefill_and_decode_logits_match(case: Case, monkeypatch):
    check_prefill_and_decode_logits(case.llm, case.hf, case.name, monkeypatch)


def test_greedy_matches_hf_generate_alone_and_batched(case: Case):
    check_greedy_alone_and_batched(case.llm, case.hf, PROMPT_LENGTHS)


def test_routed_by_model_type():
    routers = router_classes()
    assert routers["qwen2"].__name__ == "Qwen2Router" and not routers["qwen2"].gguf_permute_qk
    assert routers["qwen3"].__name__ == "Qwen3Router" and not routers["qwen3"].gguf_permute_qk


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_sliding_window_config_is_refused(kind, tmp_path, tiny_tokenizer_dir):
    make_tiny_qwen(tmp_path, tiny_tokenizer_dir, kind, use_sliding_window=True, sliding_window=16,
                   max_window_layers=0)
    with pytest.raises(ValueError, match="sliding window attention is not supported yet"):
        LLM(tmp_path, dtype="float32", num_kv_blocks=NUM_KV_BLOCKS, show_progress=False)


# --- GGUF -------------------------------------------------------------------------------------

def write_qwen_gguf(path: Path, model: torch.nn.Module, tokenizer_json: Path) -> Path:
    """F32 GGUF the way llama.cpp's converter writes qwen2 / qwen3: `<arch>.*` metadata,
    llama.cpp tensor names, Q and K rows NOT permuted, q_norm/k_norm as attn_q_norm/attn_k_norm."""
    from tests.weights.gguf_writer import write_model_gguf

    return write_model_gguf(path, model, tokenizer_json, model.config.model_type)


@pytest.mark.parametrize("name", ["qwen2-gqa-untied", "qwen3-gqa-headdim"])
def test_f32_gguf_gives_transformers_tokens(name, tmp_path, tiny_tokenizer_dir):
    kind, overrides = CASES[name]
    hf = make_tiny_qwen(tmp_path / "hf", tiny_tokenizer_dir, kind, seed=3, **overrides)
    path = write_qwen_gguf(tmp_path / f"{kind}.gguf", hf, Path(tiny_tokenizer_dir) / "tokenizer.json")
    llm = LLM(path, dtype="float32", num_kv_blocks=NUM_KV_BLOCKS, show_progress=False,
              cache_dir=tmp_path / "cache")
    model = llm.engine.runner.model
    assert type(model).__name__ == type(hf).__name__
    assert model.model.layers[0].self_attn.head_dim == hf.model.layers[0].self_attn.head_dim
    prompts = [prompt_ids(7, seed=6), prompt_ids(23, seed=6)]
    outs = llm.generate(prompts, greedy(16), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_generate(hf, p, 16) for p in prompts]
