from transformers import PretrainedConfig

from tessera.models.base import BaseRouter
from tessera.models.deepseek.router import EXPERT_GGUF_NAMES
from tessera.models.ernie4_5.modeling import Ernie45ForCausalLM


class Ernie45Router(BaseRouter):
    """ERNIE 4.5's dense model (ernie4_5: the 0.3B)."""
    model_types = ("ernie4_5",)
    model_cls = Ernie45ForCausalLM
    supports_tensor_parallel = True  # tests/distributed/test_tensor_parallel.py
    supports_gguf = True  # tests/weights/test_gguf_ernie4_5.py (arch ernie4_5: weights/gguf_ernie4_5.py)
    gguf_names = EXPERT_GGUF_NAMES  # (the MoE router's; dense files have none of them)
    supports_lora = True  # tests/lora/test_lora_models.py

    def get_config(self) -> PretrainedConfig:
        config = super().get_config()
        bias = bool(getattr(config, "use_bias", False))  # (every projection's, as Llama's layers read it)
        config.attention_bias, config.mlp_bias = bias, bias
        return config


class Ernie45MoeRouter(Ernie45Router):
    """ERNIE 4.5's MoE models (ernie4_5_moe: 21B-A3B, 300B-A47B)."""
    model_types = ("ernie4_5_moe",)
    is_moe = True  # tests/models/test_ernie4_5.py
    supports_gguf = True  # tests/weights/test_gguf_ernie4_5.py (arch ernie4_5-moe)
    supports_tensor_parallel = True  # tests/distributed/test_tensor_parallel.py
    supports_lora = True  # tests/lora/test_lora_models.py (attention and dense MLPs; experts refused)
