"""Qwen3.5 and Qwen3.5-MoE image-text checkpoints against transformers (float32): Qwen3-VL's
vision transformer (no DeepStack) and the native Qwen3.5 language model, whose linear
attention layers carry their recurrent state across image and text tokens and whose gated
attention layers take interleaved M-RoPE positions over a quarter of each head."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tessera import LLM
from tests.conftest import TINY_CORPUS
from tests.multimodal.checkpoints import make_tiny_qwen3_5_vl
from tests.multimodal.qwen_checks import (check_batched_chunked_and_text_only, check_greedy_tokens_and_logprobs,
                                          check_lora_equals_peft, check_positions_equal_rope_index)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe"])
def tiny_qwen3_5(request, tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    folder = tmp_path_factory.mktemp(request.param)
    hf = make_tiny_qwen3_5_vl(folder, TINY_CORPUS, seed=3, moe=request.param.endswith("moe"))
    assert hf.config.model_type == request.param
    return folder, hf


@pytest.fixture(scope="module")
def llm(tiny_qwen3_5):
    with LLM(tiny_qwen3_5[0], dtype="float32", num_kv_blocks=128, show_progress=False) as llm:
        yield llm


def test_greedy_tokens_and_logprobs_equal_transformers(tiny_qwen3_5, llm):
    assert llm.engine.supports_images and llm.engine.runner.state_layers
    check_greedy_tokens_and_logprobs(*tiny_qwen3_5, llm)


def test_positions_equal_transformers_rope_index(tiny_qwen3_5, llm):
    check_positions_equal_rope_index(*tiny_qwen3_5, llm)


def test_batched_chunked_and_text_only(tiny_qwen3_5, llm):
    """8-token steps split the images: the recurrent state carries over inside an image."""
    check_batched_chunked_and_text_only(*tiny_qwen3_5, llm)


def test_lora_on_the_language_model_equals_peft(tiny_qwen3_5, tmp_path):
    """An adapter on both kinds of attention (Gated DeltaNet's projections, gated
    attention's q_proj whose rows interleave query and gate) and the MLP, with images."""
    check_lora_equals_peft(*tiny_qwen3_5, tmp_path, "q_proj|o_proj|in_proj_qkv|in_proj_z|out_proj")
