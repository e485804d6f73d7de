"""Mistral 3 (Mistral Small 3.1's shape) against transformers (float32): Pixtral's tower at
the image's own aspect ratio, rows of [IMG] tokens closed by [IMG_BREAK] / [IMG_END]."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoImageProcessor, AutoTokenizer

from tessera import LLM
from tessera.sampling.params import SamplingParams
from tests.conftest import TINY_CORPUS
from tests.multimodal.checkpoints import make_tiny_mistral3, random_image

pytestmark = pytest.mark.usefixtures("one_thread")
N = 16


@pytest.mark.parametrize("text_type", ["mistral", "ministral3", "mistral4"])
def test_images_of_their_own_shapes_equal_transformers(tmp_path, text_type):
    """A 100 x 40 image is resized to 56 x 22 -> 56 x 28 (whole 14-pixel tokens): 2 rows of
    4 tokens; a 40 x 40 one to 42 x 42: 3 rows of 3. The layout is PixtralProcessor's,
    written out here; the tokens after it equal transformers' model on those ids. With
    Ministral 3's and Mistral Small 4's language models (their image-text checkpoints) too."""
    hf = make_tiny_mistral3(tmp_path, TINY_CORPUS, text_type=text_type)
    assert hf.config.text_config.model_type == text_type
    wide, square = random_image(1, size=(100, 40)), random_image(2, size=(40, 40))
    text = "The quick [IMG] brown fox [IMG] jumps"
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    expected_text = ("The quick " + "[IMG]" * 4 + "[IMG_BREAK]" + "[IMG]" * 4 + "[IMG_END]" + " brown fox "
                     + ("[IMG]" * 3 + "[IMG_BREAK]") * 2 + "[IMG]" * 3 + "[IMG_END]" + " jumps")
    prompt = tokenizer(expected_text).input_ids
    pixels = AutoImageProcessor.from_pretrained(str(tmp_path))(images=[wide, square], patch_size=14, return_tensors="pt")
    assert pixels["image_sizes"].tolist() == [[28, 56], [42, 42]]
    with torch.no_grad():
        out = hf.generate(input_ids=torch.tensor([prompt]), pixel_values=pixels["pixel_values"],
                          image_sizes=pixels["image_sizes"], max_new_tokens=N, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    want = out[0, len(prompt):].tolist()
    greedy = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)
    with LLM(tmp_path, dtype="float32", num_kv_blocks=64, show_progress=False) as llm:
        ids, images = llm.engine.process_images(text, [wide, square])
        assert ids == prompt
        assert [image.num_features for image in images.images] == [8, 9]
        got = llm.generate({"prompt": text, "multi_modal_data": {"image": [wide, square]}}, greedy, use_tqdm=False)[0]
        assert got.outputs[0].token_ids == want
        chat = llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": square},
                                                      {"type": "text", "text": " jumps"}]}], greedy, use_tqdm=False)
        assert len(chat[0].outputs[0].token_ids) == N
