from tessera.models.base import BaseRouter
from tessera.models.deepseek.modeling import DeepseekForCausalLM


class DeepseekRouter(BaseRouter):
    """DeepSeek-V2 / V2-Lite / V2.5 (deepseek_v2), DeepSeek-V3 / R1 (deepseek_v3) and
    GLM-4.7-Flash (glm4_moe_lite): multi-head latent attention over a latent cache, shared and
    routed experts."""
    model_types = ("deepseek_v2", "deepseek_v3", "glm4_moe_lite")
    model_cls = DeepseekForCausalLM
    is_moe = True  # tests/models/test_deepseek.py
    supports_tensor_parallel = True  # tests/distributed/test_tensor_parallel.py
    supports_lora = True  # tests/lora/test_lora_models.py (the projections around the latent; not kv_b_proj)
