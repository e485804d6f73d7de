from tessera.models.qwen2.router import Qwen2Router
from tessera.models.qwen2_vl.modeling import Qwen2VLForCausalLM
from tessera.models.qwen2_vl.processing import QwenVLImagePrompts
from tessera.models.vision_language import VisionLanguageRouter


class Qwen2VLRouter(VisionLanguageRouter):
    """Qwen2-VL and Qwen2.5-VL: their vision transformers (transformers' modules) and a
    Qwen2 language model with M-RoPE positions. Images only (no video yet)."""
    model_types = ("qwen2_vl", "qwen2_5_vl")
    supports_images = True  # tests/multimodal/test_qwen2_vl.py
    supports_tensor_parallel = True  # tests/distributed/test_tensor_parallel.py
    supports_lora = True  # tests/multimodal/test_llava.py, test_qwen2_vl.py
    # a GGUF language model (arch qwen2vl: Qwen2's tensors) with its --mmproj projector
    # (tests/multimodal/test_qwen_vl_gguf.py)
    supports_gguf = True
    gguf_text_router = Qwen2Router
    image_prompts_cls = QwenVLImagePrompts

    def language_model_cls(self):
        return Qwen2VLForCausalLM
