"""Idefics3 / SmolVLM against transformers (float32): image tiles, a whole view, and row /
column marker tokens between an image's runs of image tokens."""
from __future__ import annotations

import pytest

from tessera import LLM
from tessera.sampling.params import SamplingParams
from tests.conftest import TINY_CORPUS
from tests.multimodal.checkpoints import hf_image_generate, make_tiny_idefics3, random_image

pytestmark = pytest.mark.usefixtures("one_thread")


def test_tiled_images_equal_transformers(tmp_path):
    """A wide image (tiles in one row) and a square one take different numbers of tokens;
    each image's span runs from its first image token to its last, markers between
    included, and the tokens equal transformers' alone and chunked."""
    hf = make_tiny_idefics3(tmp_path, TINY_CORPUS)
    images = [random_image(1, size=(100, 40)), random_image(2, size=(40, 40))]
    text = "The quick <image> brown fox <image> jumps"
    prompt, want = hf_image_generate(hf, tmp_path, text, images, 16)
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    with LLM(tmp_path, dtype="float32", num_kv_blocks=64, show_progress=False) as llm:
        ids, inputs = llm.engine.process_images(text, images)
        counts = [llm.engine.process_images("<image>", [image], False)[0].count(3) for image in images]
        assert counts[0] != counts[1] and sum(counts) == ids.count(3)
        first, second = inputs.images
        assert ids[first.start] == ids[first.end - 1] == 3 and first.end < second.start
        assert ids[first.start:first.end].count(3) == counts[0] < first.end - first.start  # markers inside
        out = llm.generate({"prompt": text, "multi_modal_data": {"image": images}}, greedy, use_tqdm=False)[0]
        assert out.prompt_token_ids == prompt
        assert out.outputs[0].token_ids == want
    with LLM(tmp_path, dtype="float32", num_kv_blocks=64, max_num_batched_tokens=8, max_num_seqs=8,
             show_progress=False) as chunked:
        out = chunked.generate({"prompt": text, "multi_modal_data": {"image": images}}, greedy, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == want
