"""Rope scaling in GGUF files, written as llama.cpp's converter writes it (tests/weights/
gguf_writer.py): Llama 3.1's "llama3" scaling as the precomputed rope_freqs tensor, linear and
yarn as rope.scaling.* keys. transformers' GGUF config conversion reads none of these, so
each file is checked against the original Hugging Face model: the same greedy tokens and the
same log-probabilities, at positions where unscaled rope gives visibly different ones."""
from __future__ import annotations

import json
import re
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from tessera import LLM
from tests.models.parity import check_greedy_and_logprobs, hf_token_logprobs
from tests.weights.gguf_writer import llama3_rope_freqs, write_llama_gguf

ROPE_THETA = 10000.0
HEAD_DIM = 16  # the tiny Llama's 64 / 4 heads: 8 frequencies, wavelengths 6 to ~3200 tokens
SCALINGS = {
    # original length 64: the ramp covers two of the eight frequencies (wavelengths 16-64)
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": ROPE_THETA},
    "linear": {"rope_type": "linear", "factor": 4.0, "rope_theta": ROPE_THETA},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
             "rope_theta": ROPE_THETA},
}
NEW_TOKENS = 12
LOGPROB_ATOL = 1e-4

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_model(make_tiny_llama, rope_parameters: dict, seed: int) -> torch.nn.Module:
    _, model = make_tiny_llama(seed=seed, initializer_range=0.1, rope_parameters=rope_parameters)
    return model


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in (23, 60)]


@pytest.fixture(scope="module")
def tokenizer_json(tiny_tokenizer_dir) -> Path:
    return Path(tiny_tokenizer_dir) / "tokenizer.json"


@pytest.mark.parametrize("kind", list(SCALINGS))
def test_scaled_rope_gguf_matches_the_original_model(kind, make_tiny_llama, tokenizer_json, tmp_path):
    model = tiny_model(make_tiny_llama, SCALINGS[kind], seed=11)
    path = write_llama_gguf(tmp_path / f"{kind}.gguf", model, tokenizer_json, QT.F32, context_length=512)
    llm = LLM(path, dtype="float32", num_kv_blocks=32, show_progress=False, cache_dir=tmp_path / "cache")

    # the file really carries the scaling the way llama.cpp stores it
    reader = gguf.GGUFReader(str(path))
    names = {t.name for t in reader.tensors}
    assert ("rope_freqs.weight" in names) == (kind == "llama3")
    assert ("llama.rope.scaling.type" in reader.fields) == (kind != "llama3")

    tokens = check_greedy_and_logprobs(llm, model, prompts(), NEW_TOKENS, atol=LOGPROB_ATOL)
    # so that a loader ignoring the scaling fails above: unscaled rope moves these a lot
    unscaled = tiny_model(make_tiny_llama, {"rope_type": "default", "rope_theta": ROPE_THETA}, seed=11)
    unscaled.load_state_dict(model.state_dict())
    for prompt, got in zip(prompts(), tokens):
        want, wrong = (hf_token_logprobs(m, prompt, got) for m in (model, unscaled))
        assert max(abs(a - b) for a, b in zip(wrong, want)) > 100 * LOGPROB_ATOL


def test_llama3_rope_freqs_land_in_the_config(make_tiny_llama, tokenizer_json, tmp_path):
    model = tiny_model(make_tiny_llama, SCALINGS["llama3"], seed=12)
    path = write_llama_gguf(tmp_path / "llama3.gguf", model, tokenizer_json, QT.Q8_0, context_length=512)
    llm = LLM(path, dtype="float32", num_kv_blocks=32, show_progress=False, cache_dir=tmp_path / "cache")
    folder = llm.engine.router.metadata_dir
    saved = json.loads((folder / "config.json").read_text())
    want = llama3_rope_freqs(SCALINGS["llama3"], HEAD_DIM)
    assert saved["rope_freq_factors"] == [float(x) for x in want]
    assert 1.0 < want.min() * 8 and want.max() == 8.0 and (want == 1.0).any()  # all three regimes
    assert ((want > 1.0) & (want < 8.0)).sum() == 2


@pytest.mark.parametrize("keys, message", [
    ({"llama.rope.scaling.type": "longrope"}, "rope scaling type 'longrope' is not supported"),
    ({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0},
     "needs rope.scaling.factor and rope.scaling.original_context_length"),
])
def test_rope_scaling_tessera_cannot_map_is_a_clear_error(keys, message, make_tiny_llama, tokenizer_json, tmp_path):
    model = tiny_model(make_tiny_llama, {"rope_type": "default", "rope_theta": ROPE_THETA}, seed=13)
    path = write_llama_gguf(tmp_path / "odd.gguf", model, tokenizer_json, QT.F32, extra_metadata=keys)
    with pytest.raises(ValueError, match=re.escape(message)):
        LLM(path, dtype="float32", num_kv_blocks=32, show_progress=False, cache_dir=tmp_path / "cache")


def test_yarn_with_a_log_multiplier_is_refused(make_tiny_llama, tokenizer_json, tmp_path):
    model = tiny_model(make_tiny_llama, SCALINGS["yarn"], seed=14)
    path = write_llama_gguf(tmp_path / "yarn.gguf", model, tokenizer_json, QT.F32,
                            extra_metadata={"llama.rope.scaling.yarn_log_multiplier": 0.1})
    with pytest.raises(ValueError, match=r"yarn_log_multiplier.*not supported"):
        LLM(path, dtype="float32", num_kv_blocks=32, show_progress=False, cache_dir=tmp_path / "cache")


@pytest.mark.parametrize("factors, message", [
    (np.ones(HEAD_DIM), "8 frequencies"),  # one per dimension instead of one per pair
    (np.array([1, 1, 1, 0, 1, 1, 1, 1], dtype=np.float32), "not positive finite"),
])
def test_malformed_rope_freqs_are_a_clear_error(factors, message, make_tiny_llama, tokenizer_json, tmp_path):
    model = tiny_model(make_tiny_llama, {"rope_type": "default", "rope_theta": ROPE_THETA}, seed=15)
    path = write_llama_gguf(tmp_path / "bad.gguf", model, tokenizer_json, QT.F32,
                            extra_tensors={"rope_freqs.weight": factors})
    with pytest.raises(ValueError, match=re.escape(message)):
        LLM(path, dtype="float32", num_kv_blocks=32, show_progress=False, cache_dir=tmp_path / "cache")


def test_a_factor_without_a_type_is_linear(make_tiny_llama, tokenizer_json, tmp_path):
    """llama.cpp reads rope.scaling.factor with no rope.scaling.type as linear scaling."""
    model = tiny_model(make_tiny_llama, SCALINGS["linear"], seed=16)
    plain = tiny_model(make_tiny_llama, {"rope_type": "default", "rope_theta": ROPE_THETA}, seed=16)
    plain.load_state_dict(model.state_dict())
    path = write_llama_gguf(tmp_path / "factor.gguf", plain, tokenizer_json, QT.F32,
                            extra_metadata={"llama.rope.scaling.factor": 4.0})
    llm = LLM(path, dtype="float32", num_kv_blocks=32, show_progress=False, cache_dir=tmp_path / "cache")
    check_greedy_and_logprobs(llm, model, prompts(), NEW_TOKENS, atol=LOGPROB_ATOL)


def test_longrope_factors_of_the_wrong_length_are_refused():
    from tessera.ops.rotary import rope_frequencies

    params = {"rope_type": "longrope", "rope_theta": ROPE_THETA, "original_max_position_embeddings": 32,
              "max_position_embeddings": 512, "long_factor": [2.0] * 8, "short_factor": [1.5]}
    assert rope_frequencies(HEAD_DIM, {**params, "short_factor": [1.5] * 8})[0].shape == (8,)
    with pytest.raises(ValueError, match="1 short factors for 8 frequencies"):
        rope_frequencies(HEAD_DIM, params)
