"""Gemma 3 with images against transformers' Gemma3ForConditionalGeneration (float32). Its
image tokens attend to each other (transformers' token_type_ids mask), not causally: each
test's transformers answer with a causal mask differs, so equal tokens and logprobs show the
mask is Gemma 3's. Chunks never split an image, prefix-cache hits may end inside one, and
the sliding-window layers (window 8) are shorter than an image (16 tokens)."""
from __future__ import annotations

import json

import pytest
import torch

from tessera import LLM
from tessera.engine.sequence import Sequence
from tessera.models.registry import router_classes
from tessera.multimodal.inputs import MultimodalInputs, consecutive_runs
from tessera.sampling.params import SamplingParams
from tests.conftest import TINY_CORPUS
from tests.multimodal.checkpoints import (GEMMA3_IMAGE, TOKENS_PER_IMAGE, greedy, hf_image_generate,
                                          hf_image_logprobs, image_prompt, make_tiny_gemma3, random_image)

pytestmark = pytest.mark.usefixtures("one_thread")

N = 16
TWO_IMAGES = f"The quick {GEMMA3_IMAGE} brown fox {GEMMA3_IMAGE} jumps"


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-gemma3")
    return folder, make_tiny_gemma3(folder, TINY_CORPUS)


def hf_causal_generate(model, folder, text: str, images: list, n: int) -> list[int]:
    """transformers' greedy tokens with the image mask left out (plain causal attention)."""
    from transformers import AutoProcessor

    inputs = AutoProcessor.from_pretrained(str(folder))(images=images, text=text, return_tensors="pt")
    inputs.pop("token_type_ids")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def test_images_attend_to_themselves_as_in_transformers(tiny_gemma3):
    folder, hf = tiny_gemma3
    images = [random_image(1), random_image(2, size=(64, 30))]
    prompt, want = hf_image_generate(hf, folder, TWO_IMAGES, images, N)
    assert want != hf_causal_generate(hf, folder, TWO_IMAGES, images, N)
    with LLM(folder, dtype="float32", num_kv_blocks=64, show_progress=False) as llm:
        image_token = llm.engine.router.image_token_id
        assert prompt.count(image_token) == 2 * TOKENS_PER_IMAGE
        out = llm.generate(image_prompt(TWO_IMAGES, images), greedy(logprobs=0), use_tqdm=False)[0]
        assert llm.engine.block_manager.all_free()
    assert out.prompt_token_ids == prompt
    got = out.outputs[0].token_ids
    assert got == want
    logprobs = [lp[t].logprob for t, lp in zip(got, out.outputs[0].logprobs)]
    assert logprobs == pytest.approx(hf_image_logprobs(hf, folder, TWO_IMAGES, images, got), abs=1e-4)


def test_chunks_never_split_an_image(tiny_gemma3):
    """8-token steps: a chunk stops before an image, or takes all 16 of its tokens past the
    budget (no step ends inside one); a batch mixing images and text equals transformers."""
    folder, hf = tiny_gemma3
    cases = [(TWO_IMAGES, [random_image(3), random_image(4)]), ("Paged attention stores", []),
             (f"A {GEMMA3_IMAGE} of", [random_image(5)])]
    want = [hf_image_generate(hf, folder, text, images, N)[1] for text, images in cases]
    with LLM(folder, dtype="float32", num_kv_blocks=64, max_num_batched_tokens=8, max_num_seqs=8,
             show_progress=False) as llm:
        scheduler = llm.engine.scheduler
        schedule, ends, sizes = scheduler.schedule, [], []

        def recording():
            plan = schedule()
            sizes.append(plan.num_batched_tokens)
            for item in plan.scheduled:
                if item.seq.multimodal is not None:
                    ends.append((item.seq.multimodal, item.seq.num_computed_tokens + item.num_new_tokens))
            return plan

        scheduler.schedule = recording
        outs = llm.generate([image_prompt(t, i) if i else t for t, i in cases], greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert max(sizes) > 8  # an image taken whole past the budget
    spans = {id(mm): mm.attention_spans for mm, _ in ends}
    assert sum(len(s) for s in spans.values()) == 3
    assert not [end for mm, end in ends if any(a < end < b for a, b in mm.attention_spans)]


def test_a_prefix_hit_may_end_inside_an_image(tiny_gemma3):
    """Blocks of 16: the second request reuses a block ending inside its (same) image,
    so its first chunk starts there and must see that image's cached keys and its later
    ones; its tokens and logprobs equal transformers'."""
    folder, hf = tiny_gemma3
    image = [random_image(6)]
    first, second = f"Paged {GEMMA3_IMAGE} attention stores", f"Paged {GEMMA3_IMAGE} batching lets"
    with LLM(folder, dtype="float32", num_kv_blocks=64, block_size=16, show_progress=False) as llm:
        bm = llm.engine.block_manager
        a = llm.generate(image_prompt(first, image), greedy(), use_tqdm=False)[0]
        hits = bm.prefix_hits
        b = llm.generate(image_prompt(second, image), greedy(logprobs=0), use_tqdm=False)[0]
        (start, end), = llm.engine.process_images(second, image)[1].attention_spans
        reused = bm.prefix_hits - hits
        assert start < reused < end and reused % 16 == 0
    assert a.outputs[0].token_ids == hf_image_generate(hf, folder, first, image, N)[1]
    got = b.outputs[0].token_ids
    assert got == hf_image_generate(hf, folder, second, image, N)[1]
    logprobs = [lp[t].logprob for t, lp in zip(got, b.outputs[0].logprobs)]
    assert logprobs == pytest.approx(hf_image_logprobs(hf, folder, second, image, got), abs=1e-4)


@pytest.mark.parametrize("tied", [True, False])
def test_head_tying_and_end_of_turn_from_the_top_level(tied, tmp_path):
    """As the released checkpoints state them: tying and the EOS ids (with <end_of_turn>)
    at the config's top level, the text config keeping its defaults."""
    hf = make_tiny_gemma3(tmp_path, TINY_CORPUS, seed=2, tie_word_embeddings=tied, eos_token_id=[2, 6])
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "gemma3" and "vision_config" in saved
    images = [random_image(7)]
    text = f"A {GEMMA3_IMAGE} of"
    with LLM(tmp_path, dtype="float32", num_kv_blocks=64, show_progress=False) as llm:
        assert llm.engine.router.config.model_type == "gemma3_text"
        assert {2, 6} <= llm.engine.router.eos_token_ids
        lm = llm.engine.model.language_model
        assert (lm.lm_head.weight is lm.model.embed_tokens.weight) == tied
        got = llm.generate(image_prompt(text, images), greedy(), use_tqdm=False)[0].outputs[0].token_ids
        text_only = llm.generate("Paged attention stores", greedy(), use_tqdm=False)[0].outputs[0].token_ids
    assert got == hf_image_generate(hf, tmp_path, text, images, N)[1]
    assert text_only == hf_image_generate(hf, tmp_path, "Paged attention stores", [], N)[1]


def test_chunk_ends_and_key_limits_of_attention_spans():
    inputs = MultimodalInputs([], list(range(4, 8)) + list(range(10, 12)))
    inputs.attention_spans = consecutive_runs(inputs.feature_positions)
    assert inputs.attention_spans == [(4, 8), (10, 12)]
    assert inputs.chunk_end(0, 6) == 4    # stops before the image
    assert inputs.chunk_end(4, 6) == 8    # starts at it: takes it whole
    assert inputs.chunk_end(5, 6) == 8    # starts inside it (a prefix hit): the rest of it
    assert inputs.chunk_end(0, 8) == 8 and inputs.chunk_end(8, 11) == 10
    assert inputs.key_limits(0, 4) is None
    assert inputs.key_limits(2, 12) == [2, 3, 7, 7, 7, 7, 8, 9, 11, 11]
    assert inputs.key_limits(6, 9) == [7, 7, 8]
    seq = Sequence("r", None, list(range(14)), SamplingParams(), 64, multimodal=inputs)
    assert seq.chunk_size(0, 6) == 4 and seq.chunk_size(4, 1) == 4
    causal = Sequence("r", None, list(range(14)), SamplingParams(), 64,
                      multimodal=MultimodalInputs([], inputs.feature_positions))
    assert causal.chunk_size(0, 6) == 6  # images attending causally split anywhere


def test_routed_by_model_type():
    assert router_classes()["gemma3"].__name__ == "Gemma3VisionRouter"
    assert router_classes()["gemma3_text"].__name__ == "Gemma3Router"


def test_pan_and_scan_crops_through_mm_processor_kwargs(tiny_gemma3):
    """--mm-processor-kwargs '{"do_pan_and_scan": true, ...}': a wide image becomes itself plus
    crops, each a run of image tokens with text between; each run attends to itself only,
    and the answer is transformers' with the same processor settings."""
    from transformers import AutoProcessor

    folder, hf = tiny_gemma3
    settings = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 28,
                "pan_and_scan_min_ratio_to_activate": 1.2}
    images = [random_image(9, size=(112, 28))]
    text = f"A {GEMMA3_IMAGE} of"
    inputs = AutoProcessor.from_pretrained(str(folder))(images=images, text=text, return_tensors="pt", **settings)
    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=N, do_sample=False, eos_token_id=None, pad_token_id=0)
    prompt = inputs["input_ids"][0].tolist()
    with LLM(folder, dtype="float32", num_kv_blocks=64, show_progress=False, mm_processor_kwargs=settings) as llm:
        ids, mm = llm.engine.process_images(text, images)
        assert ids == prompt and len(mm.attention_spans) > 1  # the image and its crops
        prompts = llm.engine.router.image_prompts  # warm-up's largest image: a strip of 4 crops
        assert prompts.largest_image_size() == (28 * 4, 28)
        assert prompts.largest_image_inputs()["pixel_values"].shape[0] == 1 + 4
        got = llm.generate(image_prompt(text, images), greedy(), use_tqdm=False)[0].outputs[0].token_ids
    assert got == out[0, len(prompt):].tolist()


def test_warm_up_measures_a_step_taking_a_whole_image_past_the_budget(tiny_gemma3, monkeypatch):
    """A step may go one image past max_num_batched_tokens: warm-up profiles that many tokens."""
    from tessera.runner import warmup

    folder, _ = tiny_gemma3
    measured = []
    profile = warmup.profile_peak_step
    monkeypatch.setattr(warmup, "profile_peak_step",
                        lambda runner, num_tokens, rows, **kw: measured.append(num_tokens)
                        or profile(runner, num_tokens, rows, **kw))
    with LLM(folder, dtype="float32", max_num_batched_tokens=8, max_num_seqs=8, memory_fraction=0.05,
             show_progress=False) as llm:
        assert llm.engine.router.longest_attention_span == TOKENS_PER_IMAGE
    assert measured == [8 + TOKENS_PER_IMAGE]
