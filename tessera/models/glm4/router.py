from tessera.models.base import BaseRouter
from tessera.models.glm4.modeling import Glm4ForCausalLM


class Glm4Router(BaseRouter):
    """GLM-4-0414 and GLM-Z1 (dense)."""
    model_types = ("glm4",)
    model_cls = Glm4ForCausalLM
    supports_tensor_parallel = True  # tests/distributed/test_tensor_parallel.py
    supports_lora = True  # tests/lora/test_lora_models.py
