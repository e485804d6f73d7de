"""Qwen3-VL and Qwen3-VL-MoE against transformers (float32): the native Qwen3 (or
Qwen3-MoE) language model with interleaved M-RoPE positions and DeepStack (features of
earlier vision layers added after its first layers), transformers' vision transformer,
tessera's placeholder expansion; the MoE's expert tensors in the published layout."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tessera import LLM
from tests.conftest import TINY_CORPUS
from tests.multimodal.checkpoints import (QWEN_IMAGE, hf_qwen_generate, hf_qwen_logprobs, make_tiny_qwen3_vl,
                                          random_image)
from tests.multimodal.qwen_checks import (check_batched_chunked_and_text_only, check_greedy_tokens_and_logprobs,
                                          check_lora_equals_peft, check_positions_equal_rope_index)

pytestmark = pytest.mark.usefixtures("one_thread")

N = 16
TWO_IMAGES = f"The quick {QWEN_IMAGE} brown fox {QWEN_IMAGE} jumps"


@pytest.fixture(scope="module", params=["qwen3_vl", "qwen3_vl_moe"])
def tiny_qwen3_vl(request, tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    folder = tmp_path_factory.mktemp(request.param)
    hf = make_tiny_qwen3_vl(folder, TINY_CORPUS, seed=2, moe=request.param.endswith("moe"))
    assert hf.config.model_type == request.param
    return folder, hf


@pytest.fixture(scope="module")
def llm(tiny_qwen3_vl):
    with LLM(tiny_qwen3_vl[0], dtype="float32", num_kv_blocks=128, show_progress=False) as llm:
        yield llm


def test_greedy_tokens_and_logprobs_equal_transformers(tiny_qwen3_vl, llm):
    check_greedy_tokens_and_logprobs(*tiny_qwen3_vl, llm)


def test_deepstack_and_interleaving_change_the_answer(tiny_qwen3_vl, monkeypatch):
    """The parity above would catch a skipped DeepStack level or block-wise M-RoPE: each
    changes transformers' own log-probabilities by far more than its tolerance."""
    folder, hf = tiny_qwen3_vl
    text_model = type(hf.model.language_model)
    images = [random_image(3, size=(70, 100)), random_image(4, size=(60, 60))]
    tokens = hf_qwen_generate(hf, folder, TWO_IMAGES, images, 8)[1]
    base = hf_qwen_logprobs(hf, folder, TWO_IMAGES, images, tokens)
    with monkeypatch.context() as m:
        m.setattr(text_model, "_deepstack_process", lambda self, hidden, *args: hidden)
        assert max(abs(a - b) for a, b in zip(base, hf_qwen_logprobs(hf, folder, TWO_IMAGES, images, tokens))) > 1e-3
    with monkeypatch.context() as m:  # blocks of t, h, w frequencies (Qwen2-VL's) instead of turns
        def blocks(self, freq):
            section = torch.repeat_interleave(torch.arange(3), torch.tensor(self.mrope_section))
            mixed = freq[0].clone()
            for axis in (1, 2):
                mixed[..., section == axis] = freq[axis][..., section == axis]
            return torch.cat((mixed, mixed), dim=-1)
        m.setattr(type(hf.model.language_model.rotary_emb), "recomposition_frequencies", blocks)
        assert max(abs(a - b) for a, b in zip(base, hf_qwen_logprobs(hf, folder, TWO_IMAGES, images, tokens))) > 1e-3


def test_positions_equal_transformers_rope_index(tiny_qwen3_vl, llm):
    check_positions_equal_rope_index(*tiny_qwen3_vl, llm)


def test_batched_chunked_and_text_only(tiny_qwen3_vl, llm):
    check_batched_chunked_and_text_only(*tiny_qwen3_vl, llm)


def test_lora_on_the_language_model_equals_peft(tiny_qwen3_vl, tmp_path):
    check_lora_equals_peft(*tiny_qwen3_vl, tmp_path, "q_proj|v_proj|o_proj|down_proj")


def test_warm_up_measures_the_largest_image(llm):
    """What GPU warm-up encodes: an image at the processor's max_pixels (32 * 32 * 64 here),
    64 tokens after merging, with its DeepStack levels beside them."""
    from tessera.runner.warmup import profile_image_encoder

    largest = llm.engine.router.image_prompts.largest_image_inputs()
    assert int(largest["image_grid_thw"].prod()) // 4 == 64
    features = llm.engine.model.encode_images(largest)
    assert features.shape == (64, 64 * 3)  # the main features and two levels, 64 wide each
    assert profile_image_encoder(llm.engine.runner, largest) >= 0
