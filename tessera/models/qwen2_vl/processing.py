"""Qwen2-VL's prompts: its image processor cuts an image into 14-pixel patches on a grid
(t, h, w) whose 2 x 2 neighbours the vision tower merges, so an image takes
h * w / 4 tokens; each <|image_pad|> of the prompt is repeated that often. transformers'
Qwen processors also need torchvision (for video), so tessera does this expansion itself
with transformers' image processor and the tokenizer.

Positions (M-RoPE, as transformers' get_rope_index for images): text tokens count up one
by one; an image's tokens take (t, h, w) = (s, s + row, s + column) from the position s it
starts at, and the text after it goes on from s + max(rows, columns)."""
from __future__ import annotations

import math
from functools import cached_property
from pathlib import Path
from typing import Sequence

import torch
from PIL import Image

from tessera.multimodal.inputs import MultimodalInputs
from tessera.multimodal.processor import ImagePrompts, OwnExpansionProcessor, expand_placeholders

IMAGE_PAD = "<|image_pad|>"


class QwenVLImagePrompts(ImagePrompts):
    def load_processor(self, folder: Path) -> OwnExpansionProcessor:
        return OwnExpansionProcessor(folder, IMAGE_PAD)

    @property
    def merge_size(self) -> int:
        return int(getattr(self.processor.image_processor, "merge_size", 2))

    def expand(self, text: str, images: Sequence[Image.Image],
               add_special_tokens: bool) -> tuple[list[int], dict[str, torch.Tensor]]:
        out = self.processor.image_processor(images=list(images), return_tensors="pt", **self.image_kwargs)
        grids = out["image_grid_thw"]
        counts = (grids.prod(-1) // self.merge_size ** 2).tolist()
        expanded = expand_placeholders(text, IMAGE_PAD, [IMAGE_PAD * n for n in counts])
        ids = self.processor.tokenizer(expanded, add_special_tokens=add_special_tokens).input_ids
        return list(ids), {"pixel_values": out["pixel_values"], "image_grid_thw": grids}

    @cached_property
    def image_kwargs(self) -> dict:
        """--mm-processor-kwargs as the image processor takes them: vLLM's min_pixels /
        max_pixels become the size's shortest / longest edge (transformers deprecated them
        as call arguments)."""
        settings = dict(self.processor_kwargs)
        if "min_pixels" in settings or "max_pixels" in settings:
            size = {k: v for k, v in dict(settings.get("size") or self.processor.image_processor.size or {}).items()
                    if v is not None}
            for key, edge in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
                if key in settings:
                    size[edge] = settings.pop(key)
            settings["size"] = size
        return settings

    def largest_image_size(self) -> tuple[int, int]:
        processor = self.processor.image_processor
        size = self.image_kwargs.get("size") or getattr(processor, "size", None) or {}
        most = (size.get("longest_edge") or getattr(processor, "max_pixels", None) or size.get("max_pixels")
                or 12845056)
        side = math.isqrt(int(most))
        return (side, side)

    def per_image(self, encoder_inputs: dict[str, torch.Tensor], images: Sequence[Image.Image],
                  num_tokens: int) -> list[tuple[int, dict[str, torch.Tensor]]]:
        """The patch rows of pixel_values are the images' in order, t * h * w each."""
        grids = encoder_inputs["image_grid_thw"]
        patches = grids.prod(-1).tolist()
        rows = encoder_inputs["pixel_values"].split(patches)
        return [(n // self.merge_size ** 2, {"pixel_values": r, "image_grid_thw": grids[i:i + 1]})
                for i, (n, r) in enumerate(zip(patches, rows))]

    def add_positions(self, inputs: MultimodalInputs, ids: list[int],
                      encoder_inputs: dict[str, torch.Tensor]) -> None:
        grids = encoder_inputs["image_grid_thw"].tolist()
        rope: list[int] = []
        image_rope: list[torch.Tensor] = []
        current = 0
        for span, (t, h, w) in zip(inputs.images, grids):
            if span.end - span.start != span.num_features:
                raise ValueError("an image's tokens are not one run")
            text = span.start - len(rope)
            rope.extend(range(current, current + text))
            current += text
            h, w = h // self.merge_size, w // self.merge_size
            grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"))
            block = grid.reshape(3, -1) + current
            image_rope.append(block)
            rope.extend(block[0].tolist())
            current += max(h, w)
        tail = len(ids) - len(rope)
        rope.extend(range(current, current + tail))
        top = max(current + tail - 1, max(int(b.max()) for b in image_rope))
        inputs.rope_positions = rope
        inputs.image_rope = torch.cat(image_rope, dim=1)
        inputs.rope_delta = top + 1 - len(ids)
