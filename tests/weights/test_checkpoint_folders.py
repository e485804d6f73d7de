"""Hugging Face folders as users have them: Mistral's repositories (an index plus a
consolidated.safetensors of the same weights under Mistral's names), folders without a
tokenizer, and configs a native folder does not handle (with the way out named)."""
from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from tessera import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")


def load(folder, **kwargs) -> LLM:
    return LLM(folder, dtype="float32", num_kv_blocks=16, show_progress=False, **kwargs)


def test_the_index_names_the_files_and_consolidated_weights_are_left_out(make_tiny_llama, tmp_path):
    folder, hf = make_tiny_llama()
    repo = tmp_path / "mistral-repo"
    shutil.copytree(folder, repo)
    tensors = load_file(str(repo / "model.safetensors"))
    (repo / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(repo / file))
    (repo / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: f for f, part in shards.items() for n in part}}))
    # Mistral's own layout of the same weights, which transformers ignores too
    save_file({"layers.0.attention.wq.weight": tensors["model.layers.0.self_attn.q_proj.weight"]},
              str(repo / "consolidated.safetensors"))
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    got = load(repo).generate([[5, 6, 7]], greedy, use_tqdm=False)[0].outputs[0].token_ids
    want = load(folder).generate([[5, 6, 7]], greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert got == want
    (repo / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        load(repo)


def test_a_folder_without_a_tokenizer_says_so(make_tiny_llama, tmp_path):
    folder, _ = make_tiny_llama()
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(folder / name, bare / name)
    with pytest.raises(ValueError, match="has no tokenizer.*--tokenizer"):
        load(bare)
    with pytest.raises(ValueError, match="does not download"):
        load(bare, tokenizer="some-org/some-tokenizer")
    assert load(bare, tokenizer=str(folder)).tokenizer is not None


def test_a_config_the_native_folder_refuses_names_the_fallback(make_tiny_llama):
    folder, _ = make_tiny_llama(hidden_act="gelu")
    with pytest.raises(ValueError, match="--model-impl transformers"):
        load(folder)
    llm = load(folder, model_impl="transformers")
    assert llm.engine.router.implementation == "transformers"
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3


def test_model_safetensors_wins_over_a_stale_index(make_tiny_llama, tmp_path):
    """As in transformers: a folder holding model.safetensors loads it, whatever an index
    left from an earlier sharded download says."""
    folder, _ = make_tiny_llama()
    repo = tmp_path / "repo"
    shutil.copytree(folder, repo)
    (repo / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"lm_head.weight": "model-00001-of-00002.safetensors"}}))
    greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    assert load(repo).generate([[5, 6]], greedy, use_tqdm=False)[0].outputs[0].token_ids == \
        load(folder).generate([[5, 6]], greedy, use_tqdm=False)[0].outputs[0].token_ids


def test_generation_config_values_no_request_could_use_fail_at_start(make_tiny_llama, tmp_path):
    folder, _ = make_tiny_llama()
    repo = tmp_path / "repo"
    shutil.copytree(folder, repo)
    (repo / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "top_p": 0.0}))
    with pytest.raises(ValueError, match="top_p.*--generation-config vllm"):
        load(repo)
    assert load(repo, generation_config="vllm").get_default_sampling_params().top_p == 1.0
