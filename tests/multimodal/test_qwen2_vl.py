"""Qwen2-VL and Qwen2.5-VL against transformers (float32): the native Qwen2 language model
with M-RoPE positions, transformers' vision transformers, tessera's own placeholder
expansion (transformers' Qwen processor needs torchvision)."""
from __future__ import annotations

import pytest
from safetensors.torch import load_file

from tessera import LLM
from tests.conftest import TINY_CORPUS
from tests.multimodal.checkpoints import (QWEN_IMAGE, greedy, hf_qwen_generate, image_prompt,
                                          make_tiny_qwen2_vl, random_image)
from tests.multimodal.qwen_checks import (check_batched_chunked_and_text_only, check_greedy_tokens_and_logprobs,
                                          check_lora_equals_peft, check_positions_equal_rope_index)

pytestmark = pytest.mark.usefixtures("one_thread")

N = 16
TWO_IMAGES = f"The quick {QWEN_IMAGE} brown fox {QWEN_IMAGE} jumps"


@pytest.fixture(scope="module")
def llm(tiny_qwen25_vl):
    with LLM(tiny_qwen25_vl[0], dtype="float32", num_kv_blocks=128, show_progress=False) as llm:
        yield llm


def test_positions_equal_transformers_rope_index(tiny_qwen25_vl, llm):
    check_positions_equal_rope_index(*tiny_qwen25_vl, llm)


@pytest.mark.parametrize("model_type, tied", [("qwen2_5_vl", False), ("qwen2_vl", False), ("qwen2_5_vl", True)])
def test_greedy_tokens_and_logprobs_equal_transformers(tmp_path, model_type, tied):
    """Both types; and tied embeddings stated at the top level only (Qwen2.5-VL-3B's config;
    the saved text config says False, transformers ties by the top level's flag)."""
    hf = make_tiny_qwen2_vl(tmp_path, TINY_CORPUS, model_type=model_type, seed=2, tie_word_embeddings=tied)
    if tied:
        assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    with LLM(tmp_path, dtype="float32", num_kv_blocks=64, show_progress=False) as llm:
        check_greedy_tokens_and_logprobs(tmp_path, hf, llm)


def test_batched_chunked_and_text_only(tiny_qwen25_vl, llm):
    check_batched_chunked_and_text_only(*tiny_qwen25_vl, llm)


def test_chat_renders_the_vision_tokens(tiny_qwen25_vl, llm):
    folder, hf = tiny_qwen25_vl
    image = random_image(8, size=(84, 56))
    messages = [{"role": "user", "content": [{"type": "image_pil", "image_pil": image},
                                             {"type": "text", "text": " What is it?"}]}]
    rendered = f"user: {QWEN_IMAGE} What is it?\nassistant:"
    _, want = hf_qwen_generate(hf, folder, rendered, [image], N, add_special_tokens=False)
    assert llm.chat(messages, greedy(), use_tqdm=False)[0].outputs[0].token_ids == want


def test_warm_up_measures_the_largest_image(llm):
    """What GPU warm-up encodes: an image at the processor's max_pixels (28 * 28 * 64 here),
    64 tokens after merging, more than any other image gets; its encoder peak is measured."""
    from tessera.runner.warmup import profile_image_encoder

    prompts = llm.engine.router.image_prompts
    largest = prompts.largest_image_inputs()
    assert int(largest["image_grid_thw"].prod()) // 4 == 64
    for size in [(500, 300), (64, 64), (1000, 1000)]:
        _, inputs = llm.engine.process_images(QWEN_IMAGE, [random_image(9, size=size)])
        assert inputs.num_features <= 64
    assert profile_image_encoder(llm.engine.runner, largest) >= 0


def test_lora_on_the_language_model_equals_peft(tiny_qwen25_vl, tmp_path):
    check_lora_equals_peft(*tiny_qwen25_vl, tmp_path, "q_proj|k_proj|o_proj|up_proj")


def test_mm_processor_kwargs_bound_the_image_size(tiny_qwen25_vl, tmp_path):
    """--mm-processor-kwargs '{"max_pixels": N}' (vLLM's flag): a large image is resized to at
    most N pixels, fewer tokens, and the answer is transformers' with its image processor set
    the same; settings the image processor does not have, or cannot use, and settings for a
    model that takes no images, are refused at start-up."""
    import json
    import shutil

    from tessera.config import ConfigError

    folder, hf = tiny_qwen25_vl
    images = [random_image(30, size=(200, 150))]
    text = f"A {QWEN_IMAGE} of"
    bounded = tmp_path / "bounded"  # the same checkpoint, its image processor set to the bound
    shutil.copytree(folder, bounded)
    config = json.loads((bounded / "preprocessor_config.json").read_text())
    bound = 56 * 56 * 2
    config["size"]["longest_edge"] = bound
    (bounded / "preprocessor_config.json").write_text(json.dumps(config))
    _, want = hf_qwen_generate(hf, bounded, text, images, N)
    with LLM(folder, dtype="float32", num_kv_blocks=64, show_progress=False,
             mm_processor_kwargs={"max_pixels": bound}) as llm:
        ids, inputs = llm.engine.process_images(text, images)
        assert inputs.num_features * 4 * 14 * 14 <= bound
        assert llm.engine.router.image_prompts.largest_image_size() == (int(bound ** 0.5),) * 2
        got = llm.generate(image_prompt(text, images), greedy(), use_tqdm=False)[0].outputs[0].token_ids
    assert got == want
    with LLM(folder, dtype="float32", num_kv_blocks=64, show_progress=False) as plain:
        assert plain.engine.process_images(text, images)[1].num_features > inputs.num_features
    with pytest.raises(ConfigError, match="has no setting max_pixelz"):
        LLM(folder, dtype="float32", num_kv_blocks=64, show_progress=False, mm_processor_kwargs={"max_pixelz": 1})
    with pytest.raises(ConfigError, match="return_tensors is set by tessera"):
        LLM(folder, dtype="float32", num_kv_blocks=64, show_progress=False, mm_processor_kwargs={"return_tensors": "np"})
    with pytest.raises(ConfigError, match="cannot use them"):
        LLM(folder, dtype="float32", num_kv_blocks=64, show_progress=False, mm_processor_kwargs={"max_pixels": "big"})


def test_mm_processor_kwargs_for_a_text_model_are_refused(make_tiny_llama):
    from tessera.cli import main
    from tessera.config import ConfigError

    folder, _ = make_tiny_llama()
    with pytest.raises(ConfigError, match="takes no images"):
        LLM(folder, dtype="float32", num_kv_blocks=16, show_progress=False, mm_processor_kwargs={"max_pixels": 1})
    with pytest.raises(SystemExit):
        main(["generate", "--model", str(folder), "--mm-processor-kwargs", "[1]", "hi"])
