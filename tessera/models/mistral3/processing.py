"""Mistral 3's prompts (Pixtral's layout): an image keeps its aspect ratio, its longest edge
at most the processor's, cut into patches that the projector merges 2 x 2; it takes one
[IMG] token per merged patch, row by row, each row closed by [IMG_BREAK] and the last by
[IMG_END] (transformers' PixtralProcessor.replace_image_token). That processor needs
torchvision, so tessera expands the placeholders itself with transformers' image
processor and the tokenizer, reading the processor's settings from processor_config.json."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import torch
from PIL import Image

from tessera.multimodal.processor import ImagePrompts, OwnExpansionProcessor, expand_placeholders


class _Processor(OwnExpansionProcessor):
    def __init__(self, folder: Path):
        settings = {}
        if (folder / "processor_config.json").is_file():
            settings = json.loads((folder / "processor_config.json").read_text())
        super().__init__(folder, settings.get("image_token", "[IMG]"))
        self.image_break_token = settings.get("image_break_token", "[IMG_BREAK]")
        self.image_end_token = settings.get("image_end_token", "[IMG_END]")
        # pixels a side of one merged patch: one image token
        self.token_pixels = int(settings.get("patch_size", 14)) * int(settings.get("spatial_merge_size", 2))


def image_tokens(processor: _Processor, height: int, width: int) -> str:
    """An image's tokens for a resized image of height x width pixels."""
    rows, cols = height // processor.token_pixels, width // processor.token_pixels
    tokens = ([processor.image_token] * cols + [processor.image_break_token]) * rows
    tokens[-1] = processor.image_end_token
    return "".join(tokens)


class PixtralImagePrompts(ImagePrompts):
    # the patch size is the model's (processor_config.json), passed on every call
    reserved_kwargs = (*ImagePrompts.reserved_kwargs, "patch_size")

    def load_processor(self, folder: Path) -> _Processor:
        return _Processor(folder)

    def expand(self, text: str, images: Sequence[Image.Image],
               add_special_tokens: bool) -> tuple[list[int], dict[str, torch.Tensor]]:
        p = self.processor
        out = p.image_processor(images=list(images), patch_size=p.token_pixels, return_tensors="pt",
                                **self.processor_kwargs)
        expanded = expand_placeholders(text, p.image_token, [image_tokens(p, h, w) for h, w in out["image_sizes"].tolist()])
        ids = p.tokenizer(expanded, add_special_tokens=add_special_tokens).input_ids
        return list(ids), {"pixel_values": out["pixel_values"], "image_sizes": out["image_sizes"]}

    def per_image(self, encoder_inputs: dict[str, torch.Tensor], images: Sequence[Image.Image],
                  num_tokens: int) -> list[tuple[int, dict[str, torch.Tensor]]]:
        """Each image, cut from the padded batch to its own size."""
        sizes = encoder_inputs["image_sizes"]
        step = self.processor.token_pixels
        return [((h // step) * (w // step),
                 {"pixel_values": encoder_inputs["pixel_values"][i:i + 1, :, :h, :w].clone(),  # not a view
                  "image_sizes": sizes[i:i + 1].clone()})
                for i, (h, w) in enumerate(sizes.tolist())]

    def largest_image_size(self) -> tuple[int, int]:
        size = self.processor_kwargs.get("size") or getattr(self.processor.image_processor, "size", None) or {}
        edge = size.get("longest_edge") if isinstance(size, dict) else getattr(size, "longest_edge", None)
        return (int(edge or 1540),) * 2
