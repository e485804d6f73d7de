from functools import cached_property

from tessera.models.mistral3.processing import PixtralImagePrompts
from tessera.models.vision_language import VisionLanguageRouter


class Mistral3Router(VisionLanguageRouter):
    """Mistral Small 3.1 / 3.2 (Mistral3): a Pixtral vision transformer at the image's own
    aspect ratio (2-D rotary positions), a projector merging 2 x 2 patches, and a Mistral
    language model; [IMG_BREAK] / [IMG_END] tokens sit between an image's rows."""
    model_types = ("mistral3",)
    supports_images = True  # tests/multimodal/test_mistral3.py
    supports_tensor_parallel = True  # tests/distributed/test_tensor_parallel.py
    supports_lora = True  # tests/multimodal/test_vlm_lora.py
    # a GGUF language model (arch llama or mistral3) with its --mmproj projector
    # (tests/multimodal/test_mistral3_gguf.py)
    supports_gguf = True
    image_prompts_cls = PixtralImagePrompts

    @cached_property
    def image_prompts(self) -> PixtralImagePrompts:
        prompts = super().image_prompts
        vision = self.full_config.vision_config
        model_pixels = vision.patch_size * getattr(self.full_config, "spatial_merge_size", 1)
        if prompts.processor.token_pixels != model_pixels:
            raise ValueError(f"processor_config.json makes an image token {prompts.processor.token_pixels} pixels "
                             f"a side; the model's patches merge to {model_pixels}")
        return prompts
