from tessera.models.vision_language import VisionLanguageRouter


class Idefics3Router(VisionLanguageRouter):
    """Idefics3 and SmolVLM (SmolVLM-256M/500M/2.2B-Instruct are idefics3 checkpoints): a
    SigLIP tower over an image's tiles and a downscaled whole view, a pixel-shuffle
    connector, and a Llama language model; an image's token count follows its tiles, and
    row/column marker tokens sit between its runs of image tokens."""
    model_types = ("idefics3",)
    supports_images = True  # tests/multimodal/test_idefics3.py
    supports_tensor_parallel = True  # tests/distributed/test_tensor_parallel.py
    supports_lora = True  # tests/multimodal/test_vlm_lora.py
    # a GGUF language model (arch llama) with its --mmproj projector (tests/multimodal/test_idefics3_gguf.py)
    supports_gguf = True
