from tessera.models.base import BaseRouter
from tessera.models.glm4.modeling import Glm4ForCausalLM


class Glm4Router(BaseRouter):
    """GLM-4-0414 and GLM-Z1 (dense)."""
    model_types = ("glm4",)
    model_cls = Glm4ForCausalLM
    supports_tensor_parallel = True  # tests/distributed/test_tensor_parallel.py
    supports_gguf = True  # tests/weights/test_gguf_models.py (arch glm4: weights/gguf_glm4.py)
    gguf_names = {"post_attention_norm": "post_self_attn_layernorm", "post_ffw_norm": "post_mlp_layernorm",
                  "ffn_up": "mlp.gate_up_proj"}  # (gate and up fused, gate rows first)
    supports_lora = True  # tests/lora/test_lora_models.py
