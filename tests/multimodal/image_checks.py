"""Checks shared by the image-text tests of files converted from elsewhere (llama.cpp's GGUF
and projector files): an engine's prompt with images against transformers' answer, and its
vision side's weights against the original model's."""
from __future__ import annotations

from typing import Callable

import pytest
import torch

from tests.multimodal.checkpoints import greedy, image_prompt


def check_image_prompt(llm, text: str, images: list, prompt: list[int], want: list[int],
                       reference_logprobs: Callable[[list[int]], list[float]], n: int):
    """`llm`'s prompt tokens, greedy tokens and logprobs for `text` with `images` are
    transformers' (`prompt`, `want`, `reference_logprobs(tokens)`); returns its greedy
    output for a text-only prompt, run by the same engine after."""
    out = llm.generate(image_prompt(text, images), greedy(n, logprobs=0), use_tqdm=False)[0]
    text_only = llm.generate("Paged attention stores", greedy(n), use_tqdm=False)[0]
    assert out.prompt_token_ids == prompt
    got = out.outputs[0].token_ids
    assert got == want
    logprobs = [lp[t].logprob for t, lp in zip(got, out.outputs[0].logprobs)]
    assert logprobs == pytest.approx(reference_logprobs(got), abs=1e-4)
    return text_only


def assert_vision_weights_equal(llm, hf: torch.nn.Module) -> None:
    """Every weight and buffer of the engine's vision side (transformers' modules, loaded from
    a checkpoint or a projector file) equals the original model's (`hf`: a
    *ForConditionalGeneration; float32 up to a unit of rounding: a norm stored as 1 + w)."""
    ours = llm.engine.model.vision.hf.state_dict()
    theirs = hf.model.state_dict()
    assert ours and set(ours) <= set(theirs)
    for name, tensor in ours.items():
        torch.testing.assert_close(tensor.float(), theirs[name].float(), atol=1e-6, rtol=0, msg=name)
