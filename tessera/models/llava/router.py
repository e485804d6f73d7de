from tessera.models.vision_language import VisionLanguageRouter


class LlavaRouter(VisionLanguageRouter):
    """LLaVA 1.5 and the checkpoints of its shape (llava-hf, LLaVA-Interleave): a CLIP or
    SigLIP tower, an MLP projector, and a Llama, Mistral or Qwen2 language model; every
    image takes the same number of tokens."""
    model_types = ("llava",)
    same_tokens_per_image = True  # its processor resizes and crops every image to one size
    supports_images = True  # tests/multimodal/test_llava.py
    supports_tensor_parallel = True  # tests/distributed/test_tensor_parallel.py
    supports_lora = True  # tests/multimodal/test_llava.py, test_qwen2_vl.py


class LlavaNextRouter(VisionLanguageRouter):
    """LLaVA-NeXT (1.6): LLaVA with "anyres" tiling: an image is a base view plus the tiles
    of the grid its aspect ratio picks, so its token count depends on its size."""
    model_types = ("llava_next",)
    supports_images = True  # tests/multimodal/test_llava.py
    supports_tensor_parallel = True  # tests/distributed/test_tensor_parallel.py
    supports_lora = True  # tests/multimodal/test_vlm_lora.py
