"""The transformers fallback: architectures with no native folder (OLMo, StableLM with
partial rotary and LayerNorm) run through transformers' own modeling code with tessera's
paged attention, under tessera's scheduler, and give transformers' own answers: logits
within fp32 tolerance, greedy 32 tokens equal alone, batched, chunked and from the prefix
cache. A Mistral forced onto the fallback checks the sliding window passes through, and
routing (--model-impl) picks native first under auto."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tessera import LLM
from tessera.config import ModelConfig
from tessera.inspection import inspect_model
from tessera.models.registry import UnsupportedModelError
from tessera.models.transformers_fallback.modeling import TransformersCausalLM
from tessera.models.transformers_fallback.router import FallbackUnsupportedError

from tests.models.parity import (FP32_ATOL, Case, LogitRecorder, assert_rows_match,
                                 check_greedy_alone_and_batched, check_prefill_and_decode_logits,
                                 greedy, hf_generate, hf_logits, make_tiny, prompt_ids)

pytestmark = pytest.mark.usefixtures("one_thread")

NUM_KV_BLOCKS = 64
NEW_TOKENS = 32
PROMPT_LENGTHS = (5, 23, 47)


def _olmo():
    from transformers import OlmoConfig, OlmoForCausalLM
    return OlmoConfig, OlmoForCausalLM, dict(clip_qkv=None, pad_token_id=0)


def _stablelm():
    from transformers import StableLmConfig, StableLmForCausalLM
    # a quarter of each head rotated, LayerNorm with weights and biases, QKV bias
    return StableLmConfig, StableLmForCausalLM, dict(partial_rotary_factor=0.25, use_qkv_bias=True,
                                                     pad_token_id=0)


def _mistral_window():
    from transformers import MistralConfig, MistralForCausalLM
    return MistralConfig, MistralForCausalLM, dict(sliding_window=8)


CASES = {"olmo": _olmo, "stablelm": _stablelm}


def build_case(name: str, factory, tmp_path_factory, tokenizer_dir: Path, **llm_kwargs) -> Case:
    config_cls, model_cls, overrides = factory()
    folder = tmp_path_factory.mktemp(name)
    hf = make_tiny(folder, tokenizer_dir, config_cls, model_cls, seed=len(name), **overrides)
    llm = LLM(folder, dtype="float32", num_kv_blocks=NUM_KV_BLOCKS, show_progress=False, **llm_kwargs)
    return Case(name, folder, hf, llm)


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def case(request, tmp_path_factory, tiny_tokenizer_dir) -> Case:
    return build_case(request.param, CASES[request.param], tmp_path_factory, tiny_tokenizer_dir)


def test_auto_routes_types_without_a_folder_to_the_fallback(case: Case):
    model = case.llm.engine.model
    assert isinstance(model, TransformersCausalLM)
    assert type(model.hf_model) is type(case.hf)
    assert type(case.llm.engine.router).__name__ == "TransformersRouter"
    # each transformers layer got its own slice of the paged cache
    assert len(model.paged_attention) == case.hf.config.num_hidden_layers
    assert all(layer.kv_cache is not None for layer in model.paged_attention)


def test_prefill_and_decode_logits_match(case: Case, monkeypatch):
    check_prefill_and_decode_logits(case.llm, case.hf, case.name, monkeypatch)


def test_greedy_matches_hf_generate_alone_and_batched(case: Case):
    check_greedy_alone_and_batched(case.llm, case.hf, PROMPT_LENGTHS, NEW_TOKENS)


def test_mixed_steps_chunks_and_cached_prefixes_match(case: Case, monkeypatch):
    """16-token steps mix decodes with prefill chunks over cached context; the second round
    reuses the first round's cached prompt blocks. Every token equals transformers'."""
    llm = LLM(case.folder, dtype="float32", num_kv_blocks=NUM_KV_BLOCKS, max_num_batched_tokens=16,
              max_num_seqs=16, show_progress=False)
    rec = LogitRecorder(llm, monkeypatch)
    prompts = [prompt_ids(n, seed=4) for n in PROMPT_LENGTHS]
    expected = [hf_generate(case.hf, p, NEW_TOKENS) for p in prompts]
    for _ in range(2):
        outs = llm.generate(prompts, greedy(), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
    assert any(s["num_decodes"] and s["num_decodes"] < s["num_seqs"] for s in rec.steps)
    assert llm.engine.stats().prefix_cache_hits > 0
    for prompt, out in zip(prompts, outs):
        assert_rows_match(rec.for_request(out.request_id),
                          hf_logits(case.hf, prompt + out.outputs[0].token_ids), FP32_ATOL, case.name)


def test_sliding_window_passes_through(tmp_path_factory, tiny_tokenizer_dir):
    """Mistral with window 8 forced onto the fallback: transformers hands each call its
    window, the paged layers apply it, and the answers equal transformers' and native's."""
    c = build_case("mistral-window8", _mistral_window, tmp_path_factory, tiny_tokenizer_dir,
                   model_impl="transformers")
    assert isinstance(c.llm.engine.model, TransformersCausalLM)
    assert all(layer.sliding_window == 8 for layer in c.llm.engine.model.paged_attention)
    native = LLM(c.folder, dtype="float32", num_kv_blocks=NUM_KV_BLOCKS, show_progress=False,
                 model_impl="native")
    assert not isinstance(native.engine.model, TransformersCausalLM)
    prompts = [prompt_ids(n, seed=5) for n in PROMPT_LENGTHS]
    expected = [hf_generate(c.hf, p, NEW_TOKENS) for p in prompts]
    for llm in (c.llm, native):
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(), use_tqdm=False)] == expected


def test_native_only_refuses_a_type_without_a_folder(case: Case):
    with pytest.raises(UnsupportedModelError, match=r"--model-impl auto or transformers") as info:
        LLM(case.folder, dtype="float32", num_kv_blocks=8, show_progress=False, model_impl="native")
    assert repr(case.hf.config.model_type) in str(info.value)


def test_unknown_type_names_neither_path(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no-such-model"}))
    with pytest.raises(UnsupportedModelError, match="transformers has no causal LM"):
        LLM(tmp_path, num_kv_blocks=4, show_progress=False, cache_dir=tmp_path / "cache")


def test_bad_model_impl_is_a_config_error():
    with pytest.raises(ValueError, match="model_impl must be one of"):
        ModelConfig(model_impl="fast")


def test_gguf_is_refused_on_the_fallback(default_gguf, tmp_path):
    with pytest.raises(FallbackUnsupportedError, match="GGUF"):
        LLM(default_gguf, num_kv_blocks=4, show_progress=False, model_impl="transformers")


def test_inspect_reports_the_fallback_path(case: Case):
    info = inspect_model(ModelConfig(model=str(case.folder), dtype="float32"))
    assert info["path"] == "transformers"
    assert type(case.hf).__name__ in info["path_note"]
    assert info["kv_cache"]["attention_layers"] == case.hf.config.num_hidden_layers
    kinds = {op["spec"]["kind"] for op in info["ops"]}
    assert {"kv_write", "paged_attention"} <= kinds


def test_cli_inspect_shows_the_fallback_and_model_impl_switches_it(case: Case, capsys):
    from tessera.cli import main

    assert main(["inspect", "--model", str(case.folder), "--dtype", "float32"]) == 0
    report = capsys.readouterr().out
    assert "transformers fallback" in report and type(case.hf).__name__ in report
    assert main(["inspect", "--model", str(case.folder), "--model-impl", "native", "--json"]) == 2
    assert "--model-impl auto or transformers" in capsys.readouterr().err
