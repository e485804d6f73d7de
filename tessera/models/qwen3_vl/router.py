from tessera.models.qwen2_vl.processing import QwenVLImagePrompts
from tessera.models.qwen3.router import Qwen3Router
from tessera.models.qwen3_moe.router import Qwen3MoeRouter
from tessera.models.qwen3_vl.modeling import Qwen3VLForCausalLM, Qwen3VLMoeForCausalLM
from tessera.models.vision_language import VisionLanguageRouter


class Qwen3VLRouter(VisionLanguageRouter):
    """Qwen3-VL (dense): transformers' vision transformer, whose DeepStack features the
    native Qwen3 language model adds after its first layers, with interleaved M-RoPE
    positions. Images only (no video yet)."""
    model_types = ("qwen3_vl",)
    supports_images = True  # tests/multimodal/test_qwen3_vl.py
    supports_tensor_parallel = True  # tests/distributed/test_tensor_parallel.py
    supports_lora = True  # tests/multimodal/test_qwen3_vl.py
    # a GGUF language model (arch qwen3vl: Qwen3's tensors) with its --mmproj projector
    # (tests/multimodal/test_qwen_vl_gguf.py)
    supports_gguf = True
    gguf_text_router = Qwen3Router
    image_prompts_cls = QwenVLImagePrompts

    def language_model_cls(self):
        return Qwen3VLForCausalLM


class Qwen3VLMoeRouter(Qwen3VLRouter):
    """Qwen3-VL-MoE (30B-A3B, 235B-A22B): the same, over Qwen3-MoE's layers; its stacked
    expert tensors are read in either layout (ops/moe.py)."""
    model_types = ("qwen3_vl_moe",)
    supports_images = True  # tests/multimodal/test_qwen3_vl.py
    is_moe = True  # tests/multimodal/test_qwen3_vl.py
    supports_tensor_parallel = True  # tests/distributed/test_tensor_parallel.py
    supports_lora = True  # tests/multimodal/test_qwen3_vl.py (attention; experts refused)
    supports_gguf = True  # tests/multimodal/test_qwen_vl_gguf.py
    gguf_text_router = Qwen3MoeRouter  # (arch qwen3vlmoe: Qwen3-MoE's stacked experts)

    def language_model_cls(self):
        return Qwen3VLMoeForCausalLM
