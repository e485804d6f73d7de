"""A multimodal model's own processor (transformers' AutoProcessor from the model folder):
it expands each image placeholder of a prompt into the model's image tokens and turns the
images into the encoder's inputs."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable, Sequence

import torch
from PIL import Image

from tessera.multimodal.images import image_hash
from tessera.multimodal.inputs import ImageSpan, MultimodalInputs

logger = logging.getLogger(__name__)

# processor outputs that describe the text, not the images
TEXT_KEYS = ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids")

# per-image token counts from the processor's outputs; None: every image has the same count
TokenCounter = Callable[[dict[str, torch.Tensor], int], list[int]]


class PromptImageError(ValueError):
    """A prompt and its images that do not fit together."""


class ImagePrompts:
    """Loaded once per model; `__call__` is safe from any thread (no state is kept)."""

    def __init__(self, folder: Path, image_token_id: int, count_tokens: TokenCounter | None = None):
        from transformers import AutoProcessor

        # transformers falls back to its PIL image processors without torchvision (and says
        # so on every load); those are the ones tessera runs
        previous = logging.getLogger("transformers").level
        logging.getLogger("transformers").setLevel(logging.ERROR)
        try:
            self.processor = AutoProcessor.from_pretrained(str(folder))
        finally:
            logging.getLogger("transformers").setLevel(previous)
        self.image_token_id = image_token_id
        self.count_tokens = count_tokens
        # what a prompt writes where an image goes (chat templates write it themselves)
        self.placeholder: str = getattr(self.processor, "image_token", None) or ""
        if not self.placeholder:
            raise ValueError(f"{folder}: the processor names no image token")

    @property
    def chat_template(self) -> str | None:
        return getattr(self.processor, "chat_template", None)

    def __call__(self, text: str, images: Sequence[Image.Image],
                 add_special_tokens: bool = True) -> tuple[list[int], MultimodalInputs | None]:
        """The prompt's token ids (placeholders expanded) and its images' inputs (None for
        a prompt without images)."""
        found = text.count(self.placeholder)
        if found != len(images):
            raise PromptImageError(
                f"the prompt has {found} image placeholder{'s' * (found != 1)} ({self.placeholder}) "
                f"but {len(images)} image{'s' * (len(images) != 1)} came with it")
        if not images:
            ids = self.processor.tokenizer(text, add_special_tokens=add_special_tokens).input_ids
            return list(ids), None
        out = self.processor(text=[text], images=list(images), return_tensors="pt",
                             add_special_tokens=add_special_tokens)
        ids = out["input_ids"][0].tolist()
        encoder_inputs = {k: v for k, v in out.items() if k not in TEXT_KEYS and isinstance(v, torch.Tensor)}
        positions = [i for i, t in enumerate(ids) if t == self.image_token_id]
        counts = (self.count_tokens(encoder_inputs, len(images)) if self.count_tokens is not None
                  else _equal_counts(len(positions), len(images)))
        if sum(counts) != len(positions):
            raise PromptImageError(f"the processor wrote {len(positions)} image tokens for images of "
                                   f"{sum(counts)} features")
        spans, first = [], 0
        for image, count in zip(images, counts):
            mine = positions[first:first + count]
            spans.append(ImageSpan(mine[0], mine[-1] + 1, image_hash(image)))
            first += count
        return ids, MultimodalInputs(spans, positions, encoder_inputs)


def _equal_counts(num_positions: int, num_images: int) -> list[int]:
    if num_positions % num_images:
        raise PromptImageError(f"{num_positions} image tokens do not split evenly over {num_images} images")
    return [num_positions // num_images] * num_images
