from transformers import PretrainedConfig

from tessera.models.base import BaseRouter
from tessera.models.ernie4_5.modeling import Ernie45ForCausalLM


class Ernie45Router(BaseRouter):
    """ERNIE 4.5: the dense 0.3B (ernie4_5) and the MoE models (ernie4_5_moe)."""
    model_types = ("ernie4_5", "ernie4_5_moe")
    model_cls = Ernie45ForCausalLM
    is_moe = True  # tests/models/test_ernie4_5.py
    supports_tensor_parallel = True  # tests/distributed/test_tensor_parallel.py
    supports_lora = True  # tests/lora/test_lora_models.py (attention and dense MLPs; experts refused)

    def get_config(self) -> PretrainedConfig:
        config = super().get_config()
        bias = bool(getattr(config, "use_bias", False))  # (every projection's, as Llama's layers read it)
        config.attention_bias, config.mlp_bias = bias, bias
        return config
