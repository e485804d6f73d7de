"""SmolVLM2 (model type "smolvlm") from its Hugging Face folder, against transformers' model
(float32) with prompts laid out as SmolVLMProcessor lays them out: tiles, whole views and
their marker tokens; the folder's chat template."""
from __future__ import annotations

import pytest

from tessera import LLM
from tests.conftest import TINY_CORPUS
from tests.multimodal.checkpoints import CHAT_TEMPLATE, greedy, random_image
from tests.multimodal.image_checks import check_image_prompt
from tests.multimodal.smolvlm_checkpoint import hf_smolvlm_generate, hf_smolvlm_logprobs, make_tiny_smolvlm

pytestmark = pytest.mark.usefixtures("one_thread")

N = 12
TEXT = "The quick <image> brown fox <image> jumps"


@pytest.fixture(scope="module")
def smolvlm(tmp_path_factory):
    folder = tmp_path_factory.mktemp("smolvlm")
    return folder, make_tiny_smolvlm(folder, TINY_CORPUS, seed=6)


def test_tiled_images_equal_transformers(smolvlm):
    """A wide image (two tiles and its whole view) and a square one (upscaled to 2 x 2 tiles
    and its whole view): transformers' prompt ids, greedy tokens and logprobs, alone and in
    8-token chunks."""
    folder, hf = smolvlm
    images = [random_image(1, size=(100, 40)), random_image(2, size=(40, 40))]
    prompt, want = hf_smolvlm_generate(hf, folder, TEXT, images, N)
    assert prompt.count(hf.config.image_token_id) == 3 * 4 + 5 * 4
    with LLM(folder, dtype="float32", num_kv_blocks=64, show_progress=False) as llm:
        assert llm.engine.supports_images and llm.engine.router.chat_template == CHAT_TEMPLATE
        check_image_prompt(llm, TEXT, images, prompt, want,
                           lambda got: hf_smolvlm_logprobs(hf, folder, TEXT, images, got), N)
    with LLM(folder, dtype="float32", num_kv_blocks=64, max_num_batched_tokens=8, max_num_seqs=8,
             show_progress=False) as chunked:
        out = chunked.generate({"prompt": TEXT, "multi_modal_data": {"image": images}}, greedy(N), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == want


def test_a_chat_message_with_an_image(smolvlm):
    """An image content part goes through the folder's chat template (chat_template.json) to
    the same tokens as the prompt it renders."""
    folder, hf = smolvlm
    image = random_image(4, size=(90, 60))
    text = "user: <image> of\nassistant:"
    prompt, want = hf_smolvlm_generate(hf, folder, text, [image], N)
    messages = [{"role": "user", "content": [{"type": "image_pil", "image_pil": image},
                                             {"type": "text", "text": " of"}]}]
    with LLM(folder, dtype="float32", num_kv_blocks=64, show_progress=False) as llm:
        out = llm.chat(messages, greedy(N), use_tqdm=False)[0]
    assert out.prompt_token_ids == prompt and out.outputs[0].token_ids == want
