from tessera.models.base import BaseRouter
from tessera.models.deepseek.router import EXPERT_GGUF_NAMES
from tessera.models.glm4_moe.modeling import Glm4MoeForCausalLM


class Glm4MoeRouter(BaseRouter):
    """GLM-4.5, GLM-4.5-Air, GLM-4.6 and GLM-4.7 (glm4_moe): GQA attention and DeepSeek-V3's
    experts."""
    model_types = ("glm4_moe",)
    model_cls = Glm4MoeForCausalLM
    is_moe = True  # tests/models/test_glm4_moe.py
    supports_tensor_parallel = True  # tests/distributed/test_tensor_parallel.py
    supports_gguf = True  # tests/weights/test_gguf_glm4moe.py (arch glm4moe)
    # (llama.cpp's GLM-4 MoE names the pre-MLP norm post_attention_norm)
    gguf_names = {"post_attention_norm": "post_attention_layernorm", **EXPERT_GGUF_NAMES}
    supports_lora = True  # tests/lora/test_lora_models.py (attention; experts refused)
