from tessera.models.smolvlm.processing import SmolVLMImagePrompts
from tessera.models.vision_language import VisionLanguageRouter


class SmolVLMRouter(VisionLanguageRouter):
    """SmolVLM2 (model type "smolvlm"): Idefics3's architecture (a SigLIP tower over an
    image's tiles and its whole view, a pixel-shuffle connector, a Llama language model)
    with its prompts laid out by Idefics3's processor (processing.py). Images, not video."""
    model_types = ("smolvlm",)
    supports_images = True  # tests/multimodal/test_smolvlm.py
    supports_tensor_parallel = True  # tests/distributed/test_tensor_parallel.py
    supports_lora = True  # tests/multimodal/test_vlm_lora.py
    image_prompts_cls = SmolVLMImagePrompts
