"""Gemma 4 with images against transformers' Gemma4ForConditionalGeneration (float32): the
vision tower's soft tokens (a variable count per image, by its aspect ratio) in place of the
placeholders (the audio tower of the small releases not built), the padding token's per-layer embeddings at image rows, and where the text
config says use_bidirectional_attention "vision" (the larger releases) an image's tokens
seeing each other on the sliding layers only. The language model is the "e2b" one of
tests/models/test_gemma4.py (per-layer embeddings, KV sharing, a window of 8)."""
from __future__ import annotations

import pytest
import torch

from tessera import LLM
from tessera.models.gemma4.modeling import Gemma4Model
from tests.conftest import TINY_CORPUS
from tests.multimodal.checkpoints import greedy, image_prompt, random_image
from tests.multimodal.gemma4_checkpoint import GEMMA4_IMAGE, hf_gemma4_generate, hf_gemma4_inputs, make_tiny_gemma4

pytestmark = pytest.mark.usefixtures("one_thread")

N = 16
TWO_IMAGES = f"The quick {GEMMA4_IMAGE} brown fox {GEMMA4_IMAGE} jumps"


@pytest.fixture(scope="module", params=["bidirectional", "causal"])
def tiny_gemma4(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"tiny-gemma4-{request.param}")
    bidirectional = request.param == "bidirectional"
    return folder, make_tiny_gemma4(folder, TINY_CORPUS, bidirectional=bidirectional, audio=not bidirectional)


def hf_logprobs(model, folder, text: str, images: list, tokens: list[int]) -> list[float]:
    inputs = hf_gemma4_inputs(folder, text, images)
    prompt_len = inputs["input_ids"].shape[1]
    inputs["input_ids"] = torch.cat([inputs["input_ids"], torch.tensor([tokens])], dim=1)
    text_types = torch.zeros(1, len(tokens), dtype=torch.long)
    inputs["mm_token_type_ids"] = torch.cat([inputs["mm_token_type_ids"], text_types], 1)
    with torch.no_grad():
        logits = model(**inputs).logits[0].float()
    logp = torch.log_softmax(logits[prompt_len - 1:-1], dim=-1)
    return logp[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()


def test_images_match_transformers(tiny_gemma4):
    """Two images of different shapes: the prompt's expansion, tokens and logprobs equal
    transformers'; the bidirectional model's answer differs from a causal reading of it."""
    folder, hf = tiny_gemma4
    images = [random_image(1), random_image(2, size=(64, 30))]
    prompt, want = hf_gemma4_generate(hf, folder, TWO_IMAGES, images, N)
    with LLM(folder, dtype="float32", num_kv_blocks=64, show_progress=False) as llm:
        router = llm.engine.router
        bidirectional = hf.config.text_config.use_bidirectional_attention == "vision"
        assert router.longest_attention_span == (70 if bidirectional else 0)
        vision = llm.engine.model.vision.hf  # the small releases' audio tower: skipped, never built
        assert vision.audio_tower is None and (hf.model.audio_tower is None) == bidirectional
        out = llm.generate(image_prompt(TWO_IMAGES, images), greedy(logprobs=0), use_tqdm=False)[0]
        assert llm.engine.block_manager.all_free()
    assert out.prompt_token_ids == prompt
    assert prompt.count(router.image_token_id) == 63 + 60  # each image's pooled patches (of 70 at most)
    got = out.outputs[0].token_ids
    assert got == want
    logprobs = [lp[t].logprob for t, lp in zip(got, out.outputs[0].logprobs)]
    assert logprobs == pytest.approx(hf_logprobs(hf, folder, TWO_IMAGES, images, got), abs=1e-4)
    if bidirectional:  # without the image mask transformers answers otherwise
        inputs = hf_gemma4_inputs(folder, TWO_IMAGES, images)
        inputs.pop("mm_token_type_ids")
        with torch.no_grad():
            causal = hf.generate(**inputs, max_new_tokens=N, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert causal[0, len(prompt):].tolist() != want


def test_image_rows_take_the_padding_tokens_per_layer_embeddings(tiny_gemma4):
    """Looking up the placeholder's own per-layer embedding at image rows (not the padding
    token's, as transformers does) moves the logprobs: the parity above checks it."""
    folder, hf = tiny_gemma4
    images = [random_image(3)]
    text = f"A {GEMMA4_IMAGE} of"
    want = hf_gemma4_generate(hf, folder, text, images, N)[1]
    reference = hf_logprobs(hf, folder, text, images, want)
    with LLM(folder, dtype="float32", num_kv_blocks=64, show_progress=False) as llm:
        model = llm.engine.model.language_model.model
        assert isinstance(model, Gemma4Model) and llm.engine.router.image_token_id in model.placeholder_ids.tolist()
        runs = []
        for _ in range(2):
            out = llm.generate(image_prompt(text, images), greedy(logprobs=0), use_tqdm=False)[0].outputs[0]
            runs.append([lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs)][:4])
            model.placeholder_ids = model.placeholder_ids[:0]
    assert runs[0] == pytest.approx(reference[:4], abs=1e-4)
    assert max(abs(a - b) for a, b in zip(runs[1], reference)) > 1e-3


def test_chunked_steps_and_a_batch_with_text(tiny_gemma4):
    """8-token steps (a bidirectional image taken whole past the budget; a causal one split
    anywhere), a batch mixing images and text: each answer equals transformers'."""
    folder, hf = tiny_gemma4
    cases = [(TWO_IMAGES, [random_image(4), random_image(5, size=(30, 64))]), ("Paged attention stores", []),
             (f"A {GEMMA4_IMAGE} of", [random_image(6)])]
    want = [hf_gemma4_generate(hf, folder, text, images, N)[1] for text, images in cases]
    with LLM(folder, dtype="float32", num_kv_blocks=64, max_num_batched_tokens=8, max_num_seqs=8,
             show_progress=False) as llm:
        outs = llm.generate([image_prompt(t, i) if i else t for t, i in cases], greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want


def test_a_prefix_hit_inside_an_image(tiny_gemma4):
    """Blocks of 16: a second prompt with the same image reuses blocks ending inside it."""
    folder, hf = tiny_gemma4
    image = [random_image(7)]
    first, second = f"Paged {GEMMA4_IMAGE} attention stores", f"Paged {GEMMA4_IMAGE} batching lets"
    with LLM(folder, dtype="float32", num_kv_blocks=64, block_size=16, show_progress=False) as llm:
        llm.generate(image_prompt(first, image), greedy(), use_tqdm=False)
        hits = llm.engine.block_manager.prefix_hits
        got = llm.generate(image_prompt(second, image), greedy(), use_tqdm=False)[0].outputs[0].token_ids
        assert llm.engine.block_manager.prefix_hits - hits >= 32
    assert got == hf_gemma4_generate(hf, folder, second, image, N)[1]
