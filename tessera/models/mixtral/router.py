from tessera.models.base import BaseRouter
from tessera.models.mixtral.modeling import MixtralForCausalLM


class MixtralRouter(BaseRouter):
    model_types = ("mixtral",)
    model_cls = MixtralForCausalLM
    is_moe = True  # tests/models/test_moe_parity.py
    supports_tensor_parallel = True  # tests/distributed/test_tensor_parallel.py
    supports_lora = True  # tests/lora/test_lora_models.py (attention; experts refused)
