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
from pathlib import Path
from typing import Sequence

import torch
from PIL import Image

from tessera.multimodal.inputs import MultimodalInputs
from tessera.multimodal.processor import ImagePrompts, folder_chat_template

IMAGE_PAD = "<|image_pad|>"


class _Processor:
    """The two halves of a Qwen VL processor that run without torchvision."""

    def __init__(self, folder: Path):
        from transformers import AutoImageProcessor, AutoTokenizer

        self.image_processor = AutoImageProcessor.from_pretrained(str(folder))
        self.tokenizer = AutoTokenizer.from_pretrained(str(folder))
        self.image_token = IMAGE_PAD
        self.chat_template = getattr(self.tokenizer, "chat_template", None) or folder_chat_template(folder)


class QwenVLImagePrompts(ImagePrompts):
    def load_processor(self, folder: Path) -> _Processor:
        return _Processor(folder)

    @property
    def merge_size(self) -> int:
        return int(getattr(self.processor.image_processor, "merge_size", 2))

    def expand(self, text: str, images: Sequence[Image.Image],
               add_special_tokens: bool) -> tuple[list[int], dict[str, torch.Tensor]]:
        out = self.processor.image_processor(images=list(images), return_tensors="pt")
        grids = out["image_grid_thw"]
        pieces = text.split(IMAGE_PAD)
        counts = (grids.prod(-1) // self.merge_size ** 2).tolist()
        expanded = pieces[0] + "".join(IMAGE_PAD * n + piece for n, piece in zip(counts, pieces[1:]))
        ids = self.processor.tokenizer(expanded, add_special_tokens=add_special_tokens).input_ids
        return list(ids), {"pixel_values": out["pixel_values"], "image_grid_thw": grids}

    def largest_image_size(self) -> tuple[int, int]:
        processor = self.processor.image_processor
        size = getattr(processor, "size", None) or {}
        most = getattr(processor, "max_pixels", None) or size.get("longest_edge") or size.get("max_pixels") or 12845056
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
