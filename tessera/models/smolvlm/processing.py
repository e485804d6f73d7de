"""SmolVLM's prompts (SmolVLM2-256M / 500M / 2.2B-Video-Instruct, model type "smolvlm"): its
architecture and its image processor are Idefics3's, generated from them, but transformers'
SmolVLMProcessor needs torchvision (for video) and num2words, so tessera serves its images
through Idefics3's processor, which lays an image's tiles, whole view and their marker
tokens out as SmolVLM's does: the folder's image processor (SmolVLMImageProcessor, its PIL
build without torchvision), its tokenizer, the image_seq_len of processor_config.json and
the folder's chat template."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tessera.multimodal.processor import ImagePrompts, folder_chat_template


def image_seq_len(folder: Path) -> int:
    """The image tokens a tile takes: processor_config.json's, else the tower's patch grid
    shuffled by the connector's scale factor (the config's, transformers' defaults filling in)."""
    settings = folder / "processor_config.json"
    if settings.is_file():
        value = json.loads(settings.read_text()).get("image_seq_len")
        if value is not None:
            return int(value)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(folder))
    side = config.vision_config.image_size // config.vision_config.patch_size
    return (side // config.scale_factor) ** 2


class SmolVLMImagePrompts(ImagePrompts):
    def load_processor(self, folder: Path) -> Any:
        from transformers import AutoImageProcessor, AutoTokenizer, Idefics3Processor

        tokenizer = AutoTokenizer.from_pretrained(str(folder))
        template = folder_chat_template(folder) or getattr(tokenizer, "chat_template", None)
        return Idefics3Processor(image_processor=AutoImageProcessor.from_pretrained(str(folder)), tokenizer=tokenizer,
                                 image_seq_len=image_seq_len(folder), chat_template=template)
