"""Rope scaling stretches the context past max_position_embeddings, as vLLM derives it (yarn:
factor x the original length; dynamic and linear: factor x max_position_embeddings): the
default max_model_len is the stretched one, and prompts beyond the trained length match
transformers."""
from __future__ import annotations

import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from tessera import LLM, SamplingParams
from tests.models.parity import check_greedy_and_logprobs, hf_generate, make_tiny, prompt_ids

pytestmark = pytest.mark.usefixtures("one_thread")

SCALINGS = {
    "yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0}, 128),
    "dynamic": ({"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}, 64),
    "linear": ({"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}, 64),
}


@pytest.mark.parametrize("kind", list(SCALINGS))
def test_scaled_context_beyond_the_trained_length(kind, tiny_tokenizer_dir, tmp_path):
    rope, stretched = SCALINGS[kind]
    hf = make_tiny(tmp_path, tiny_tokenizer_dir, LlamaConfig, LlamaForCausalLM, max_position_embeddings=32,
                   rope_parameters=rope)
    llm = LLM(tmp_path, dtype="float32", num_kv_blocks=64, show_progress=False)
    assert llm.engine.max_model_len == stretched
    prompt = prompt_ids(stretched - 12 if kind != "dynamic" else 40, 3)
    if kind == "dynamic":
        # its frequencies follow the length at each step (as transformers' generate computes
        # them), which a one-pass logprob reference cannot reproduce: greedy tokens only
        out = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0]
        assert out.token_ids == hf_generate(hf, prompt, 6)
    else:
        check_greedy_and_logprobs(llm, hf, [prompt], 6)
    with pytest.raises(ValueError, match=f"stretched by its rope scaling to {stretched}"):
        LLM(tmp_path, dtype="float32", num_kv_blocks=64, show_progress=False, max_model_len=stretched + 1)
