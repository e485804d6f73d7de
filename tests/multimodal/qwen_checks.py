"""Checks both Qwen VL test files run (Qwen2-VL / Qwen2.5-VL and Qwen3-VL): M-RoPE positions
equal transformers' get_rope_index, greedy tokens and logprobs, batched and chunked
prompts with images equal transformers, and a LoRA adapter equals PEFT's."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tessera import LLM
from tests.multimodal.checkpoints import (QWEN_IMAGE, greedy, hf_qwen_generate, hf_qwen_logprobs, image_prompt,
                                          random_image)

N = 16
TWO_IMAGES = f"The quick {QWEN_IMAGE} brown fox {QWEN_IMAGE} jumps"


def check_positions_equal_rope_index(folder: Path, hf: torch.nn.Module, llm: LLM) -> None:
    """The prompt's M-RoPE positions (3-D for image tokens, compressed after each image)
    and the offset of the output's are transformers' get_rope_index."""
    images = [random_image(1, size=(70, 100)), random_image(2, size=(60, 60))]
    ids, inputs = llm.engine.process_images(TWO_IMAGES, images)
    pad = llm.engine.router.image_token_id
    grids = torch.cat([image.encoder_inputs["image_grid_thw"] for image in inputs.images])
    want, delta = hf.model.get_rope_index(torch.tensor([ids]), (torch.tensor([ids]) == pad).int(),
                                          image_grid_thw=grids)
    want = want[:, 0]
    rows = torch.tensor(inputs.feature_positions)
    assert torch.equal(inputs.image_rope, want[:, rows])
    text_rows = [i for i in range(len(ids)) if i not in set(inputs.feature_positions)]
    assert [inputs.rope_positions[i] for i in text_rows] == want[0, text_rows].tolist()
    assert want[:, text_rows].eq(want[0, text_rows]).all()  # a text token's three components agree
    assert inputs.rope_delta == int(delta) < 0  # images take fewer positions than tokens
    assert inputs.rope_position(len(ids) + 3) == len(ids) + 3 + int(delta)


def check_greedy_tokens_and_logprobs(folder: Path, hf: torch.nn.Module, llm: LLM) -> None:
    """Two images of two sizes: the prompt's ids, greedy tokens and their logprobs are
    transformers'."""
    images = [random_image(3, size=(70, 100)), random_image(4, size=(60, 60))]
    prompt, want = hf_qwen_generate(hf, folder, TWO_IMAGES, images, N)
    out = llm.generate(image_prompt(TWO_IMAGES, images), greedy(logprobs=0), use_tqdm=False)[0]
    assert out.prompt_token_ids == prompt
    got = out.outputs[0].token_ids
    assert got == want
    logprobs = [lp[t].logprob for t, lp in zip(got, out.outputs[0].logprobs)]
    assert logprobs == pytest.approx(hf_qwen_logprobs(hf, folder, TWO_IMAGES, images, got), abs=1e-4)


def check_batched_chunked_and_text_only(folder: Path, hf: torch.nn.Module, llm: LLM) -> None:
    """Images of two sizes and a text prompt in one batch, then again in 8-token steps
    (the images split over steps, text after them in steps with no image row)."""
    cases = [(TWO_IMAGES, [random_image(5, size=(64, 128)), random_image(6, size=(90, 50))]),
             ("Paged attention stores", []), (f"A {QWEN_IMAGE} picture of", [random_image(7)])]
    want = [hf_qwen_generate(hf, folder, text, images, N)[1] for text, images in cases]
    prompts = [image_prompt(text, images) if images else text for text, images in cases]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(), use_tqdm=False)] == want
    with LLM(folder, dtype="float32", num_kv_blocks=128, max_num_batched_tokens=8, max_num_seqs=8,
             show_progress=False) as chunked:
        assert [o.outputs[0].token_ids for o in chunked.generate(prompts, greedy(), use_tqdm=False)] == want


def check_lora_equals_peft(folder: Path, hf: torch.nn.Module, tmp_path: Path, targets: str) -> None:
    """A PEFT adapter on the language model, with images and M-RoPE positions: tessera's
    greedy tokens equal PEFT's (and differ from the base model's)."""
    from tessera.lora.request import LoRARequest
    from tests.lora.peft_adapters import save_peft_adapter

    adapter = tmp_path / "adapter"
    peft_model = save_peft_adapter(hf, adapter, seed=6, target_modules=rf".*language_model.*\.({targets})")
    text, images = f"A {QWEN_IMAGE} picture of", [random_image(10, size=(70, 100))]
    _, want = hf_qwen_generate(peft_model, folder, text, images, N)
    assert want != hf_qwen_generate(hf, folder, text, images, N)[1]
    with LLM(folder, dtype="float32", num_kv_blocks=64, enable_lora=True, show_progress=False) as llm:
        got = llm.generate(image_prompt(text, images), greedy(), use_tqdm=False,
                           lora_request=LoRARequest("a", 1, str(adapter)))[0].outputs[0].token_ids
    assert got == want
