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
    image_prompts_cls = PixtralImagePrompts
