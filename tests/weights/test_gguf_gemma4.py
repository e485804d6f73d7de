"""Gemma 4 GGUF files, written as llama.cpp's converter writes them (gguf_gemma4.py): tessera
reads the config from the file itself (per-layer KV heads and MLP widths, which transformers'
GGUF conversion refuses) and the weights under llama.cpp's names, and gives the original
model's tokens and logprobs (quantized files: the dequantized model's)."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import gguf
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from tessera import LLM
from tests.models.parity import check_greedy_and_logprobs
from tests.models.test_gemma4 import make
from tests.weights.gguf_gemma4 import gemma4_tensors, stored_type, write_gemma4_gguf
from tests.weights.test_gguf_models import NEW_TOKENS, prompts

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("case, qtype", [("e2b", QT.F32), ("moe", QT.F32), ("e2b", QT.Q8_0)],
                         ids=["e2b", "moe", "e2b-q8_0"])
def test_gguf_gives_the_original_models_outputs(case, qtype, tmp_path, tiny_tokenizer_dir):
    hf = make(tmp_path / "hf", tiny_tokenizer_dir, case)
    path = write_gemma4_gguf(tmp_path / f"{case}.gguf", hf, Path(tiny_tokenizer_dir) / "tokenizer.json", qtype)
    llm = LLM(path, dtype="float32", num_kv_blocks=32, show_progress=False, cache_dir=tmp_path / "cache")
    assert llm.engine.router.config.model_type == "gemma4_text"
    check_greedy_and_logprobs(llm, as_stored(hf, qtype), prompts(), NEW_TOKENS)


def as_stored(model: torch.nn.Module, qtype: QT) -> torch.nn.Module:
    """The model holding what a `qtype` file stores: each tensor the writer quantizes,
    quantized and back."""
    if qtype == QT.F32:
        return model
    ref = copy.deepcopy(model)
    written = gemma4_tensors(ref)
    with torch.no_grad():
        for hf_name, tensor in ref.state_dict().items():
            if hf_name not in written or stored_type(written[hf_name][0], tuple(tensor.shape), qtype) == QT.F32:
                continue
            a = tensor.float().numpy()
            stored = gguf.quants.dequantize(gguf.quants.quantize(a, qtype), qtype)
            tensor.copy_(torch.from_numpy(stored.reshape(a.shape)))
    return ref


def test_gemma4_turn_markers_end_generation(tmp_path, tiny_tokenizer_dir):
    """A GGUF names one EOS id; Gemma 4 also ends on <turn|> and waits on <|tool_response>."""
    hf = make(tmp_path / "hf", tiny_tokenizer_dir, "e2b")
    path = write_gemma4_gguf(tmp_path / "e2b.gguf", hf, Path(tiny_tokenizer_dir) / "tokenizer.json",
                             token_overrides={500: "<turn|>", 501: "<|tool_response>"})
    llm = LLM(path, dtype="float32", num_kv_blocks=32, show_progress=False, cache_dir=tmp_path / "cache")
    assert {500, 501} <= set(llm.engine.router.eos_token_ids)


@pytest.mark.parametrize("case", ["e2b", "moe"])
def test_config_read_from_the_file(case, tmp_path, tiny_tokenizer_dir):
    """What the file says per layer, as the checkpoint's own config says it."""
    hf = make(tmp_path / "hf", tiny_tokenizer_dir, case)
    path = write_gemma4_gguf(tmp_path / f"{case}.gguf", hf, Path(tiny_tokenizer_dir) / "tokenizer.json")
    llm = LLM(path, dtype="float32", num_kv_blocks=32, show_progress=False, cache_dir=tmp_path / "cache")
    got, want = llm.engine.router.config, hf.config
    for layer in range(want.num_hidden_layers):
        assert got.per_layer_config[layer].head_dim == want.per_layer_config[layer].head_dim
        assert got.per_layer_config[layer].num_key_value_heads == want.per_layer_config[layer].num_key_value_heads
    for name in ("layer_types", "num_kv_shared_layers", "use_double_wide_mlp", "attention_k_eq_v",
                 "hidden_size_per_layer_input", "enable_moe_block", "num_experts", "top_k_experts",
                 "moe_intermediate_size", "final_logit_softcapping", "sliding_window", "tie_word_embeddings"):
        assert getattr(got, name) == getattr(want, name), name
    assert json.dumps(got.rope_parameters, sort_keys=True) == json.dumps(want.rope_parameters, sort_keys=True)


def test_large_tables_are_read_by_rows(tmp_path, tiny_tokenizer_dir, monkeypatch):
    """Every 2-D tensor read lazily (as the vocabulary tables of real files are): the
    embedding tables load in slices of rows, never dequantized whole, and the model is the
    same."""
    from tessera.ops import embedding
    from tessera.weights import gguf as tessera_gguf

    monkeypatch.setattr(tessera_gguf, "LAZY_BYTES", 0)
    monkeypatch.setattr(embedding, "ROW_SLICE_ELEMENTS", 64 * 100)  # 100 rows of the token table
    whole, sliced = [], []
    load, narrow = tessera_gguf.GGUFRows.load, tessera_gguf.GGUFRows.narrow
    monkeypatch.setattr(tessera_gguf.GGUFRows, "load", lambda self: whole.append(self.name) or load(self))
    monkeypatch.setattr(tessera_gguf.GGUFRows, "narrow",
                        lambda self, dim, start, n: sliced.append((self.name, dim, n)) or narrow(self, dim, start, n))
    hf = make(tmp_path / "hf", tiny_tokenizer_dir, "e2b")
    path = write_gemma4_gguf(tmp_path / "e2b.gguf", hf, Path(tiny_tokenizer_dir) / "tokenizer.json", QT.Q8_0)
    llm = LLM(path, dtype="float32", num_kv_blocks=32, show_progress=False, cache_dir=tmp_path / "cache")
    assert not {"token_embd.weight", "per_layer_token_embd.weight"} & set(whole)
    assert [n for name, dim, n in sliced if name == "token_embd.weight"] == [100] * 5 + [12]
    check_greedy_and_logprobs(llm, as_stored(hf, QT.Q8_0), prompts(), NEW_TOKENS)


def test_files_missing_what_gemma4_needs_are_refused_with_the_reason(tmp_path, tiny_tokenizer_dir):
    from tessera.weights.gguf_gemma4 import gemma4_config

    hf = make(tmp_path / "hf", tiny_tokenizer_dir, "moe")
    path = write_gemma4_gguf(tmp_path / "moe.gguf", hf, Path(tiny_tokenizer_dir) / "tokenizer.json")
    reader = gguf.GGUFReader(str(path))
    for key, reason in (("gemma4.attention.sliding_window_pattern", "each layer's type"),
                        ("gemma4.expert_used_count", "expert_used_count")):
        fields = {k: v for k, v in reader.fields.items() if k != key}
        with pytest.raises(ValueError, match=reason):
            gemma4_config(fields, reader.tensors)
