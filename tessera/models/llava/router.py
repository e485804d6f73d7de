from tessera.models.vision_language import VisionLanguageRouter


class LlavaRouter(VisionLanguageRouter):
    """LLaVA 1.5 and the checkpoints of its shape (llava-hf, LLaVA-Interleave): a CLIP or
    SigLIP tower, an MLP projector, and a Llama, Mistral or Qwen2 language model; every
    image takes the same number of tokens."""
    model_types = ("llava",)
    supports_images = True  # tests/multimodal/test_llava.py
    supports_tensor_parallel = True  # tests/distributed/test_tensor_parallel.py
