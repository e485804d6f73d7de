"""LLaVA through tessera against transformers' LlavaForConditionalGeneration (float32): the
native language model fed the vision tower's features at the image placeholders."""
from __future__ import annotations

import pytest
import torch
from PIL import Image

from tessera import LLM
from tessera.engine.request_checks import RequestError
from tessera.sampling.params import SamplingParams
from tests.conftest import TINY_CORPUS
from tests.multimodal.checkpoints import (TOKENS_PER_IMAGE, data_url, greedy, hf_image_generate, hf_image_logprobs,
                                          image_prompt, make_tiny_llava, make_tiny_llava_next, random_image)

pytestmark = pytest.mark.usefixtures("one_thread")

N = 16
TWO_IMAGES = "The quick <image> brown fox <image> jumps"


@pytest.fixture(scope="module")
def llm(tiny_llava):
    folder, _ = tiny_llava
    with LLM(folder, dtype="float32", num_kv_blocks=128, show_progress=False) as llm:
        yield llm


def test_greedy_tokens_and_logprobs_equal_transformers(tiny_llava, llm):
    folder, hf = tiny_llava
    images = [random_image(1), random_image(2, size=(64, 30))]
    prompt, want = hf_image_generate(hf, folder, TWO_IMAGES, images, N)
    assert prompt.count(3) == 2 * TOKENS_PER_IMAGE
    out = llm.generate(image_prompt(TWO_IMAGES, images), greedy(logprobs=0), use_tqdm=False)[0]
    assert out.prompt_token_ids == prompt
    got = out.outputs[0].token_ids
    assert got == want
    logprobs = [lp[t].logprob for t, lp in zip(got, out.outputs[0].logprobs)]
    assert logprobs == pytest.approx(hf_image_logprobs(hf, folder, TWO_IMAGES, images, got), abs=1e-4)


def test_the_image_changes_the_answer(tiny_llava, llm):
    """The features reach the model: another image (same placeholder ids) gives other
    tokens, each equal to transformers' for its own image."""
    folder, hf = tiny_llava
    outs = []
    for seed in (3, 4):
        images = [random_image(seed)]
        text = "A picture <image> of"
        _, want = hf_image_generate(hf, folder, text, images, N)
        got = llm.generate(image_prompt(text, images), greedy(), use_tqdm=False)[0].outputs[0].token_ids
        assert got == want
        outs.append(got)
    assert outs[0] != outs[1]


def test_a_batch_mixing_images_and_text(tiny_llava, llm):
    folder, hf = tiny_llava
    cases = [("The quick <image> brown", [random_image(5)]), ("Paged attention stores", []),
             (TWO_IMAGES, [random_image(6), random_image(7)])]
    want = [hf_image_generate(hf, folder, text, images, N)[1] for text, images in cases]
    prompts = [image_prompt(text, images) if images else text for text, images in cases]
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want


def test_chunked_prefill_splits_an_image(tiny_llava):
    """8-token steps: each image's 16 placeholders span three steps; the tokens are the
    unchunked ones."""
    folder, hf = tiny_llava
    images = [random_image(8), random_image(9)]
    _, want = hf_image_generate(hf, folder, TWO_IMAGES, images, N)
    with LLM(folder, dtype="float32", num_kv_blocks=128, max_num_batched_tokens=8, max_num_seqs=8,
             show_progress=False) as llm:
        got = llm.generate(image_prompt(TWO_IMAGES, images), greedy(), use_tqdm=False)[0].outputs[0].token_ids
    assert got == want


def test_prefix_cache_keys_blocks_by_their_images(tiny_llava):
    """Blocks holding an image's placeholders are reused only for the same pixels; the text
    before the first image is reused whatever the images."""
    folder, hf = tiny_llava
    text = "Continuous batching lets requests join between steps and " * 2 + "<image> then"
    first, second = [random_image(10)], [random_image(11)]
    with LLM(folder, dtype="float32", num_kv_blocks=128, block_size=8, show_progress=False) as llm:
        bm = llm.engine.block_manager
        a = llm.generate(image_prompt(text, first), greedy(), use_tqdm=False)[0]
        hits = bm.prefix_hits
        b = llm.generate(image_prompt(text, second), greedy(), use_tqdm=False)[0]
        text_blocks = a.prompt_token_ids.index(3) // 8  # full blocks before the first placeholder
        assert bm.prefix_hits - hits == text_blocks * 8
        hits = bm.prefix_hits
        again = llm.generate(image_prompt(text, first), greedy(), use_tqdm=False)[0]
        assert bm.prefix_hits - hits == (len(a.prompt_token_ids) - 1) // 8 * 8  # all but the last token's block
        assert llm.engine.block_manager.all_free()
    assert again.outputs[0].token_ids == a.outputs[0].token_ids == hf_image_generate(hf, folder, text, first, N)[1]
    assert b.outputs[0].token_ids == hf_image_generate(hf, folder, text, second, N)[1]


def test_chat_with_image_parts(tiny_llava, llm):
    """LLM.chat: an image_url part (a data URL) and an image_pil part become the template's
    placeholders; the answer is the rendered prompt's."""
    folder, hf = tiny_llava
    images = [random_image(12), random_image(13)]
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "Compare "}, {"type": "image_url", "image_url": {"url": data_url(images[0])}},
        {"type": "text", "text": " and "}, {"type": "image_pil", "image_pil": images[1]}]}]
    rendered = "user: Compare <image> and <image>\nassistant:"
    assert llm.engine.router.image_prompts.processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "Compare "}, {"type": "image"},
                                      {"type": "text", "text": " and "}, {"type": "image"}]}],
        add_generation_prompt=True, tokenize=False) == rendered
    got = llm.chat(messages, greedy(), use_tqdm=False)[0]
    from transformers import AutoProcessor
    inputs = AutoProcessor.from_pretrained(str(folder))(images=images, text=rendered, return_tensors="pt",
                                                        add_special_tokens=False)
    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=N, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert got.outputs[0].token_ids == out[0, inputs["input_ids"].shape[1]:].tolist()


def test_llava_with_a_qwen2_language_model(tmp_path):
    """LLaVA-Interleave's shape: the language model is Qwen2 (Q/K/V biases), run natively."""
    hf = make_tiny_llava(tmp_path, TINY_CORPUS, text_model_type="qwen2", seed=1)
    images = [random_image(14)]
    text = "A picture <image> of"
    _, want = hf_image_generate(hf, tmp_path, text, images, N)
    with LLM(tmp_path, dtype="float32", num_kv_blocks=64, show_progress=False) as llm:
        got = llm.generate(image_prompt(text, images), greedy(), use_tqdm=False)[0].outputs[0].token_ids
    assert got == want


def test_llava_next_images_of_their_own_token_counts(tmp_path):
    """LLaVA-NeXT's anyres tiling: a wide and a square image take different numbers of
    tokens; each image's span is its own count (what the prefix cache keys blocks by), and
    the tokens equal transformers'."""
    hf = make_tiny_llava_next(tmp_path, TINY_CORPUS)
    wide, square = random_image(16, size=(100, 40)), random_image(17, size=(40, 40))
    prompt, want = hf_image_generate(hf, tmp_path, TWO_IMAGES, [wide, square], N)
    with LLM(tmp_path, dtype="float32", num_kv_blocks=64, show_progress=False) as llm:
        ids, images = llm.engine.process_images(TWO_IMAGES, [wide, square])
        alone = [llm.engine.process_images("<image>", [image], False)[0].count(3) for image in (wide, square)]
        assert alone[0] != alone[1]
        assert [span.end - span.start for span in images.images] == alone
        got = llm.generate(image_prompt(TWO_IMAGES, [wide, square]), greedy(), use_tqdm=False)[0]
    assert got.prompt_token_ids == ids == prompt
    assert got.outputs[0].token_ids == want


def test_bad_images_and_prompts_are_clear_errors(llm):
    with pytest.raises(RequestError, match="2 image placeholders.*1 image"):
        llm.generate(image_prompt(TWO_IMAGES, [random_image(1)]), greedy(), use_tqdm=False)
    with pytest.raises(RequestError, match="not valid base64"):
        llm.generate(image_prompt("A <image>", ["data:image/png;base64,***"]), greedy(), use_tqdm=False)
    with pytest.raises(RequestError, match="not an image"):
        llm.generate(image_prompt("A <image>", [b"not a picture"]), greedy(), use_tqdm=False)
    with pytest.raises(ValueError, match="images only"):
        llm.generate({"prompt": "A <image>", "multi_modal_data": {"video": []}}, greedy(), use_tqdm=False)
    assert llm.engine.block_manager.all_free() and not llm.engine.requests


def test_a_text_model_refuses_images(make_tiny_llama):
    folder, _ = make_tiny_llama()
    with LLM(folder, dtype="float32", num_kv_blocks=16, show_progress=False) as llm:
        with pytest.raises(RequestError, match="takes no images"):
            llm.generate(image_prompt("A <image>", [random_image(1)]), greedy(), use_tqdm=False)
        with pytest.raises(ValueError, match="takes no images"):
            llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": random_image(1)}]}],
                     greedy(), use_tqdm=False)


def test_tessera_generate_with_images(tiny_llava, llm, tmp_path, capsys):
    """`tessera generate --image`: before the text with --chat, at the placeholders without;
    the printed text is the LLM API's; a missing file is one line, no traceback."""
    from tessera.cli import main

    folder, _ = tiny_llava
    image = random_image(15)
    path = tmp_path / "picture.png"
    image.save(path)
    args = ["generate", "--model", str(folder), "--num-kv-blocks", "64", "--dtype", "float32",
            "--max-new-tokens", "6", "--ignore-eos", "--image", str(path)]
    assert main([*args, "--chat", "What is this?"]) == 0
    chat = llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": image},
                                                  {"type": "text", "text": "What is this?"}]}], greedy(6),
                    use_tqdm=False)[0]
    assert capsys.readouterr().out == chat.outputs[0].text + "\n"
    assert main([*args, "A <image> picture"]) == 0
    plain = llm.generate(image_prompt("A <image> picture", [image]), greedy(6), use_tqdm=False)[0]
    assert capsys.readouterr().out == plain.outputs[0].text + "\n"
    assert main([*args[:-1], str(tmp_path / "missing.png"), "A <image>"]) != 0
    assert "error: no image file at" in capsys.readouterr().err


def test_lora_on_the_language_model_equals_peft(tiny_llava, tmp_path):
    """A PEFT adapter on LLaVA's language model (trained on transformers' model, so named
    model.language_model.*): with images, tessera's greedy tokens equal PEFT's; in a batch
    the base model's rows stay the base model's. An adapter touching the vision tower is
    refused, never applied in part."""
    from tessera.lora.adapter import LoRAAdapterError
    from tessera.lora.request import LoRARequest
    from tests.lora.peft_adapters import save_peft_adapter

    folder, hf = tiny_llava
    adapter = tmp_path / "adapter"
    peft_model = save_peft_adapter(hf, adapter, seed=4, target_modules=r".*language_model.*\.(q_proj|v_proj|down_proj)")
    images = [random_image(18)]
    _, want = hf_image_generate(peft_model, folder, "A picture <image> of", images, N)
    _, base = hf_image_generate(hf, folder, "A picture <image> of", images, N)
    assert want != base
    with LLM(folder, dtype="float32", num_kv_blocks=64, enable_lora=True, show_progress=False) as llm:
        lora = LoRARequest("a", 1, str(adapter))
        outs = llm.generate([image_prompt("A picture <image> of", images)] * 2, greedy(), use_tqdm=False,
                            lora_request=[lora, None])
        assert [o.outputs[0].token_ids for o in outs] == [want, base]
        vision = tmp_path / "vision-adapter"
        save_peft_adapter(hf, vision, seed=5, target_modules=["q_proj", "v_proj"])  # the tower's too
        with pytest.raises(LoRAAdapterError, match="vision tower"):
            llm.engine.add_lora(LoRARequest("v", 2, str(vision)))


def test_preemption_async_scheduling_and_ngram_drafts_keep_the_answers(tiny_llava):
    """Prompts with images in a cache too small for all of them (preempted, recomputed and
    re-encoded), with async scheduling and with n-gram drafts: every answer is the one its
    prompt gets alone."""
    folder, _ = tiny_llava
    prompts = [image_prompt(TWO_IMAGES, [random_image(40 + i), random_image(50 + i)]) for i in range(4)]
    prompts += [image_prompt("A picture <image> of", [random_image(60 + i)]) for i in range(3)]
    with LLM(folder, dtype="float32", num_kv_blocks=64, enable_prefix_caching=False, show_progress=False) as solo:
        want = [solo.generate(p, greedy(24), use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    for extra in ({"async_scheduling": True}, {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}):
        with LLM(folder, dtype="float32", num_kv_blocks=14, block_size=8, max_num_batched_tokens=16,
                 max_num_seqs=8, show_progress=False, **extra) as tight:
            got = tight.generate(prompts, greedy(24), use_tqdm=False)
            assert tight.engine.stats().num_preemptions > 0 or extra.get("speculative_config")
            assert tight.engine.block_manager.all_free()
        assert [o.outputs[0].token_ids for o in got] == want, extra


def test_each_image_is_encoded_once_for_a_group_of_siblings(tiny_llava, monkeypatch):
    """n = 4 sampled completions of a prompt whose image ends in its last block: the
    siblings read the first one's features (one encode per image, not per sibling)."""
    folder, _ = tiny_llava
    with LLM(folder, dtype="float32", num_kv_blocks=64, show_progress=False) as llm:
        llm.engine.runner.encoder_cache.max_bytes = 0  # no cache across requests: the group's own sharing
        calls = []
        encode = llm.engine.model.encode_images
        monkeypatch.setattr(llm.engine.model, "encode_images", lambda inputs: calls.append(1) or encode(inputs))
        out = llm.generate(image_prompt("A picture <image>", [random_image(70)]),
                           SamplingParams(max_tokens=4, n=4, temperature=1.0, seed=3), use_tqdm=False)[0]
        assert len(out.outputs) == 4 and len(calls) == 1
        assert llm.engine.block_manager.all_free()


def test_transparent_images_lie_on_white_and_arrays_are_images(tiny_llava, llm):
    """An RGBA image's transparent pixels are white, as transformers' processors make them
    (not the colour stored under them); numpy and torch arrays are images too; a
    placeholder without its image is an error, as are URLs of other schemes."""
    import numpy as np

    folder, hf = tiny_llava
    pixels = np.array(random_image(19).convert("RGBA"))
    pixels[:, :25, 3] = 0
    rgba = Image.fromarray(pixels)
    _, want = hf_image_generate(hf, folder, "A <image> of", [rgba], N)
    got = llm.generate(image_prompt("A <image> of", [rgba]), greedy(), use_tqdm=False)[0].outputs[0].token_ids
    assert got == want
    plain = random_image(20)
    by_image = llm.generate(image_prompt("A <image> of", [plain]), greedy(), use_tqdm=False)[0].outputs[0].token_ids
    array = np.asarray(plain)
    tensor = torch.from_numpy(array).permute(2, 0, 1)
    for same in (array, tensor, array.astype(np.float32) / 255, tensor.to(torch.bfloat16) / 256 * 256 / 255):
        assert llm.generate(image_prompt("A <image> of", [same]), greedy(), use_tqdm=False)[0].outputs[0].token_ids == by_image
    with pytest.raises(RequestError, match="floats in \\[0, 1\\]; got float32 from"):
        llm.generate(image_prompt("A <image> of", [array.astype(np.float32)]), greedy(), use_tqdm=False)
    with pytest.raises(RequestError, match="1 image placeholder.*0 images"):
        llm.generate(image_prompt("A <image> of", []), greedy(), use_tqdm=False)
    with pytest.raises(RequestError, match="http\\(s\\)://, data: or file://"):
        llm.generate(image_prompt("A <image> of", ["ftp://example/x.png"]), greedy(), use_tqdm=False)


def test_an_image_seen_before_skips_the_encoder(tiny_llava, monkeypatch):
    """The same picture after other text (no prefix to reuse) takes its features from the
    encoder cache; the answer is still transformers'; other pixels are encoded, and so is
    the first picture again once the cache is reset."""
    folder, hf = tiny_llava
    image = random_image(71)
    with LLM(folder, dtype="float32", num_kv_blocks=64, show_progress=False) as llm:
        calls = []
        encode = llm.engine.model.encode_images
        monkeypatch.setattr(llm.engine.model, "encode_images", lambda inputs: calls.append(1) or encode(inputs))
        for text in ("A picture <image> of", "Paged attention stores <image> then"):
            got = llm.generate(image_prompt(text, [image]), greedy(), use_tqdm=False)[0].outputs[0].token_ids
            assert got == hf_image_generate(hf, folder, text, [image], N)[1]
        assert len(calls) == 1 and llm.engine.runner.encoder_cache.hits == 1
        llm.generate(image_prompt("A picture <image> of", [random_image(72)]), greedy(), use_tqdm=False)
        assert len(calls) == 2
        assert llm.reset_mm_cache() == 2 and llm.engine.runner.encoder_cache.bytes == 0
        llm.reset_prefix_cache()
        llm.generate(image_prompt("A picture <image> of", [image]), greedy(), use_tqdm=False)
        assert len(calls) == 3  # (vLLM's reset_mm_cache: encoded again)
