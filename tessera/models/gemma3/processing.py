"""Gemma 3's prompts: transformers' Gemma3Processor (PIL) expands each <start_of_image> into
its run of image tokens; only the largest image, what warm-up encodes, is Gemma's own."""
from __future__ import annotations

from typing import Any

from tessera.multimodal.processor import ImagePrompts


class Gemma3ImagePrompts(ImagePrompts):
    def largest_image_size(self) -> tuple[int, int]:
        """Every image is resized to one square; with pan-and-scan a wide image also gives
        up to pan_and_scan_max_num_crops crops, encoded in the same call as the image: a
        strip that many squares wide takes the most."""
        side = int((self._setting("size") or {}).get("height") or 896)
        if not self._setting("do_pan_and_scan"):
            return (side, side)
        return (side * int(self._setting("pan_and_scan_max_num_crops") or 4), side)

    def _setting(self, name: str) -> Any:
        """--mm-processor-kwargs' value, else the image processor's."""
        value = self.processor_kwargs.get(name)
        return value if value is not None else getattr(self.processor.image_processor, name, None)
