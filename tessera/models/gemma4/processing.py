"""Gemma 4's prompts (transformers' Gemma4Processor, whose video side needs torchvision, so
tessera expands the placeholders itself with the image processor and the tokenizer): an image
keeps its aspect ratio, resized to fit max_soft_tokens x pooling_kernel_size^2 patches, and
takes one soft token per pooled patch, written boi + image_token x N + eoi where the prompt
had the image token. The encoder's inputs are the patches, padded to the patch budget, and
their (x, y) positions (-1 for padding)."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch
from PIL import Image

from tessera.multimodal.processor import ImagePrompts, OwnExpansionProcessor, expand_placeholders


class _Processor(OwnExpansionProcessor):
    def __init__(self, folder: Path):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(folder))
        named = [getattr(tokenizer, name, None) for name in ("image_token", "boi_token", "eoi_token")]
        if not all(named):
            raise ValueError(f"{folder}: the tokenizer names no image_token / boi_token / eoi_token "
                             "(Gemma 4's processor reads them there)")
        super().__init__(folder, named[0])
        self.boi_token, self.eoi_token = named[1], named[2]


class Gemma4ImagePrompts(ImagePrompts):
    def load_processor(self, folder: Path) -> _Processor:
        return _Processor(folder)

    def _setting(self, name: str) -> int:
        """--mm-processor-kwargs' value, else the image processor's."""
        value = self.processor_kwargs.get(name)
        return int(value if value is not None else getattr(self.processor.image_processor, name))

    def expand(self, text: str, images: Sequence[Image.Image],
               add_special_tokens: bool) -> tuple[list[int], dict[str, torch.Tensor]]:
        p = self.processor
        out = p.image_processor(images=list(images), return_tensors="pt", **self.processor_kwargs)
        expansions = [p.boi_token + p.image_token * n + p.eoi_token for n in out["num_soft_tokens_per_image"].tolist()]
        ids = p.tokenizer(expand_placeholders(text, p.image_token, expansions),
                          add_special_tokens=add_special_tokens).input_ids
        return list(ids), {"pixel_values": out["pixel_values"], "image_position_ids": out["image_position_ids"]}

    def per_image(self, encoder_inputs: dict[str, torch.Tensor], images: Sequence[Image.Image],
                  num_tokens: int) -> list[tuple[int, dict[str, torch.Tensor]]]:
        """Each image's padded patches: its tokens are its real patches over the pooling."""
        pooled = self._setting("pooling_kernel_size") ** 2
        positions = encoder_inputs["image_position_ids"]
        real = (positions != -1).all(dim=-1).sum(dim=-1).tolist()
        return [(count // pooled, {"pixel_values": encoder_inputs["pixel_values"][i:i + 1].clone(),
                                   "image_position_ids": positions[i:i + 1].clone()})
                for i, count in enumerate(real)]

    def longest_image_tokens(self) -> int:
        return self._setting("max_soft_tokens")
