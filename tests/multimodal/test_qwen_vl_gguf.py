"""Qwen2.5-VL, Qwen2-VL, Qwen3-VL, Qwen3-VL-MoE, Qwen3.5 and Qwen3.5-MoE from llama.cpp's
files: the language model's GGUF (arch qwen2vl / qwen3vl / qwen3vlmoe / qwen35 / qwen35moe,
with its M-RoPE sections) and the projector file beside it (`--mmproj`, clip projector types
qwen2.5vl_merger / qwen2vl_merger / qwen3vl_merger), written as convert_hf_to_gguf.py writes
them (qwen_vl_gguf_files.py).
Against transformers' model the files were written from: the same prompt tokens, greedy
tokens and logprobs with images; the converted folder's config is the original's."""
from __future__ import annotations

import pytest

from tessera import LLM
from tessera.weights.gguf_mmproj import MmprojError
from tests.multimodal.checkpoints import (QWEN_IMAGE, greedy, hf_qwen_generate, hf_qwen_logprobs, image_prompt,
                                          random_image)
from tests.multimodal.image_checks import assert_vision_weights_equal, check_image_prompt
from tests.multimodal.qwen_vl_gguf_files import TYPES, WINDOWED, make_qwen_vl_files
from tests.weights.gguf_writer import write_model_gguf

pytestmark = pytest.mark.usefixtures("one_thread")

N = 12
TWO_IMAGES = f"The quick {QWEN_IMAGE} brown fox {QWEN_IMAGE} jumps"
# within both the tiny checkpoints' pixel limits and the converted folders' (Qwen3-VL: at
# least 64 merged 32-pixel patches)
IMAGE_SIZES = {"qwen2": [(224, 196), (64, 90)], "qwen3": [(256, 256), (300, 260)]}


@pytest.fixture(scope="module", params=TYPES)
def qwen_files(request, tmp_path_factory):
    kind = request.param
    folder = tmp_path_factory.mktemp(f"{kind}-hf")
    hf, text, mmproj = make_qwen_vl_files(kind, folder, tmp_path_factory.mktemp(f"{kind}-gguf"))
    return folder, hf, text, mmproj


def images_for(hf, count: int = 2) -> list:
    sizes = IMAGE_SIZES[hf.config.model_type[:5]]
    return [random_image(i + 1, size=sizes[i]) for i in range(count)]


def test_the_gguf_and_its_mmproj_equal_transformers(qwen_files, tmp_path):
    folder, hf, text, mmproj = qwen_files
    images = images_for(hf)
    prompt, want = hf_qwen_generate(hf, folder, TWO_IMAGES, images, N)
    with LLM(text, mmproj=mmproj, dtype="float32", num_kv_blocks=64, show_progress=False,
             cache_dir=tmp_path / "cache") as llm:
        assert llm.engine.supports_images and llm.engine.router.full_config.model_type == hf.config.model_type
        text_only = check_image_prompt(llm, TWO_IMAGES, images, prompt, want,
                                       lambda got: hf_qwen_logprobs(hf, folder, TWO_IMAGES, images, got), N)
        assert_vision_weights_equal(llm, hf)
    _, plain = hf_qwen_generate(hf, folder, "Paged attention stores", [], N)
    assert text_only.outputs[0].token_ids == plain


def test_the_gguf_alone_is_its_text_model(qwen_files, tmp_path):
    """Without a projector the file is its text model (M-RoPE over text is plain rotary)."""
    folder, hf, text, _ = qwen_files
    text_type = {"qwen2_vl": "qwen2", "qwen2_5_vl": "qwen2", "qwen3_vl": "qwen3", "qwen3_vl_moe": "qwen3_moe",
                 "qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
    with LLM(text, dtype="float32", num_kv_blocks=16, show_progress=False, cache_dir=tmp_path / "cache") as llm:
        assert not llm.engine.supports_images
        assert llm.engine.router.config.model_type == text_type[hf.config.model_type]
        out = llm.generate("The quick brown fox", greedy(N), use_tqdm=False)[0]
    _, want = hf_qwen_generate(hf, folder, "The quick brown fox", [], N)
    assert out.outputs[0].token_ids == want


def test_the_files_give_back_the_checkpoints_config(qwen_files, tmp_path):
    """What the tower runs with: the converted folder's vision config is the original's
    (Qwen2.5-VL's windows from n_wa_pattern and llama.cpp's 112 pixels; Qwen2-VL's MLP ratio
    from its tensors; Qwen3-VL's DeepStack layers from theirs), and so are the text model's
    (M-RoPE sections, interleaved for Qwen3-VL; experts) and the vision tokens."""
    folder, hf, text, mmproj = qwen_files
    with LLM(text, mmproj=mmproj, dtype="float32", num_kv_blocks=16, show_progress=False,
             cache_dir=tmp_path / "cache") as llm:
        config = llm.engine.router.full_config
    want, got = hf.config.vision_config.to_dict(), config.vision_config.to_dict()
    fields = type(hf.config.vision_config)().to_dict()  # (the class's own: the tiny config carries strays)
    keys = [k for k in fields if k not in ("initializer_range", "tokens_per_second", "transformers_version", "dtype")]
    assert {k: got.get(k) for k in keys} == {k: want[k] for k in keys}
    want_rope, got_rope = hf.config.text_config.rope_parameters, config.text_config.rope_parameters
    for key in ("mrope_section", "mrope_interleaved", "rope_theta"):
        assert got_rope.get(key) == want_rope.get(key), key
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "head_dim", "num_experts",
                "num_experts_per_tok", "moe_intermediate_size", "mlp_only_layers"):
        assert getattr(config.text_config, key, None) == getattr(hf.config.text_config, key, None), key
    for name in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
        assert getattr(config, name) == getattr(hf.config, name)


def test_the_windows_matter(qwen_files):
    """Full attention in every layer of the tower gives the prompt other logprobs: the
    match above holds for the windows read from the file (n_wa_pattern, 112 pixels)."""
    folder, hf, _, _ = qwen_files
    if hf.config.model_type != "qwen2_5_vl":
        pytest.skip("Qwen2-VL's tower has no windows")
    images, prompt = images_for(hf, 1), f"A {QWEN_IMAGE} of"
    _, tokens = hf_qwen_generate(hf, folder, prompt, images, 4)
    windowed = hf_qwen_logprobs(hf, folder, prompt, images, tokens)
    visual = hf.model.visual
    visual.fullatt_block_indexes = [0, 1]
    try:
        full = hf_qwen_logprobs(hf, folder, prompt, images, tokens)
    finally:
        visual.fullatt_block_indexes = WINDOWED["fullatt_block_indexes"]
    assert max(abs(a - b) for a, b in zip(windowed, full)) > 1e-3


def test_refusals(qwen_files, tmp_path):
    folder, hf, text, mmproj = qwen_files
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    llama_gguf = write_model_gguf(tmp_path / "llama.gguf", llama, folder / "tokenizer.json", "llama")
    with pytest.raises(MmprojError, match=r"goes with the GGUF of a Qwen image-text model \(.+\), not a llama one"):
        LLM(llama_gguf, mmproj=mmproj, dtype="float32", show_progress=False, cache_dir=tmp_path / "cache")


def test_two_ranks_give_one_ranks_tokens(qwen_files, tmp_path):
    """Each rank reads its slices of the text GGUF, the driver alone the projector file."""
    folder, hf, text, mmproj = qwen_files
    images, prompt = images_for(hf, 1), f"A {QWEN_IMAGE} of"
    _, want = hf_qwen_generate(hf, folder, prompt, images, N)
    with LLM(text, mmproj=mmproj, dtype="float32", num_kv_blocks=64, show_progress=False,
             cache_dir=tmp_path / "cache", tensor_parallel_size=2) as llm:
        out = llm.generate(image_prompt(prompt, images), greedy(N), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == want


def test_served_over_http_with_an_image(qwen_files, tmp_path, monkeypatch):
    """`tessera serve --model model.gguf --mmproj mmproj.gguf`: a chat with an image_url part
    (a data URL) through the OpenAI client answers as transformers does."""
    import openai

    from tests.multimodal.checkpoints import data_url
    from tests.server.conftest import start_server

    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    folder, hf, text, mmproj = qwen_files
    image = images_for(hf, 1)[0]
    rendered = f"user: {QWEN_IMAGE} What is it?\nassistant:"
    _, want = hf_qwen_generate(hf, folder, rendered, [image], N, add_special_tokens=False)
    running = start_server(text, llm_kwargs={"mmproj": mmproj, "cache_dir": tmp_path / "cache"})
    try:
        # (decoded by the GGUF's own vocabulary: the tiny one pads the model's with [PADn] tokens)
        expected = running.engine.engine.tokenizer.decode(want, skip_special_tokens=True)
        client = openai.OpenAI(base_url=f"{running.url}/v1", api_key="-")
        reply = client.chat.completions.create(
            model="tiny", max_tokens=N, temperature=0.0, extra_body={"ignore_eos": True},
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image)}},
                                                   {"type": "text", "text": " What is it?"}]}])
        assert reply.choices[0].message.content == expected
        running.assert_idle()
    finally:
        running.stop()
