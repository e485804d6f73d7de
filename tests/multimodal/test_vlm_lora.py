"""LoRA on the language model of every multimodal type: an adapter PEFT trained on
transformers' model gives PEFT's greedy tokens with images (llava and Qwen2.5-VL have
theirs in their own test files)."""
from __future__ import annotations

import pytest
import torch

from tessera import LLM
from tessera.lora.request import LoRARequest
from tessera.sampling.params import SamplingParams
from tests.conftest import TINY_CORPUS
from tests.lora.peft_adapters import save_peft_adapter
from tests.multimodal import checkpoints, gemma4_checkpoint, smolvlm_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")
N = 12


def _hf_tokens(model, folder, kind: str, text: str, images: list, llm: LLM) -> list[int]:
    """transformers' (or PEFT's) greedy tokens; Mistral 3's ids come from tessera's own
    expansion (its test checks that expansion against the layout written out)."""
    if kind == "gemma4":  # (its transformers processor needs torchvision)
        return gemma4_checkpoint.hf_gemma4_generate(model, folder, text, images, N)[1]
    if kind == "smolvlm":  # (so does SmolVLM's)
        return smolvlm_checkpoint.hf_smolvlm_generate(model, folder, text, images, N)[1]
    if kind != "mistral3":
        return checkpoints.hf_image_generate(model, folder, text, images, N)[1]
    from transformers import AutoImageProcessor

    ids, _ = llm.engine.process_images(text, images)
    pixels = AutoImageProcessor.from_pretrained(str(folder))(images=images, patch_size=14, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids]), pixel_values=pixels["pixel_values"],
                             image_sizes=pixels["image_sizes"], max_new_tokens=N, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("kind, placeholder", [("llava_next", "<image>"), ("idefics3", "<image>"),
                                               ("smolvlm", "<image>"),
                                               ("mistral3", "[IMG]"), ("gemma3", checkpoints.GEMMA3_IMAGE),
                                               ("gemma4", gemma4_checkpoint.GEMMA4_IMAGE)])
def test_lora_with_images_equals_peft(kind, placeholder, tmp_path):
    make = {"llava_next": checkpoints.make_tiny_llava_next, "idefics3": checkpoints.make_tiny_idefics3,
            "smolvlm": smolvlm_checkpoint.make_tiny_smolvlm,
            "mistral3": checkpoints.make_tiny_mistral3, "gemma3": checkpoints.make_tiny_gemma3,
            "gemma4": gemma4_checkpoint.make_tiny_gemma4}[kind]
    folder = tmp_path / kind
    hf = make(folder, TINY_CORPUS, seed=5)
    adapter = tmp_path / "adapter"
    peft_model = save_peft_adapter(hf, adapter, seed=7,
                                   target_modules=r".*(language_model|text_model).*\.(q_proj|v_proj|down_proj)")
    text, images = f"A picture {placeholder} of", [checkpoints.random_image(3, size=(70, 50))]
    with LLM(folder, dtype="float32", num_kv_blocks=64, enable_lora=True, show_progress=False) as llm:
        want = _hf_tokens(peft_model, folder, kind, text, images, llm)
        assert want != _hf_tokens(hf, folder, kind, text, images, llm)
        got = llm.generate({"prompt": text, "multi_modal_data": {"image": images}},
                           SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True), use_tqdm=False,
                           lora_request=LoRARequest("a", 1, str(adapter)))[0].outputs[0].token_ids
    assert got == want
